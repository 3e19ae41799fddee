#!/bin/bash
# issue 17, fio4 part (a): main's kvtier bench --compare on the H200 host, fio carried from the dev VM
set -u
S=$PWD/.gpu-fio4
echo "== system"; date -u; nproc; uname -r; df -T /tmp /var/tmp / $PWD 2>&1; lsblk -o NAME,SIZE,ROTA,TYPE,MOUNTPOINT 2>&1 | head; cat /proc/loadavg
mkdir -p /tmp/fiobin && tar xJf $S/fio-bin/fio4-bin.tar.xz -C /tmp/fiobin
printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/fiobin/fio4-libs exec /tmp/fiobin/fio4-libs/fio.real "$@"\n' > /tmp/fiobin/fio; chmod +x /tmp/fiobin/fio
export PATH=/tmp/fiobin:$PATH
fio --version || { echo "fio does not start"; LD_LIBRARY_PATH=/tmp/fiobin/fio4-libs ldd /tmp/fiobin/fio4-libs/fio.real | grep -i 'not found'; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/lmdb*.whl $S/extra-whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site
cd .gpu-fio4-base && PYTHONPATH=/tmp/site:$PWD python3 setup.py -q build_ext --inplace 2>&1 | grep -v -i warn | tail -3
D=""
for c in /tmp/x /var/tmp/x /root/x $PWD/../x; do mkdir -p $c && t=$(stat -f -c %T $c) && echo "$c: $t" && [ "$t" != tmpfs ] && [ "$t" != ramfs ] && D=$c && break; done
echo "directory $D"; df -T $D
for j in rw70-zipf rw70-uniform rw50-zipf rw50-uniform; do
  echo "== $j $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m kvtier.fio $S/fio-bin/$j.fio --compare --directory $D --output-format json > $OUT/fio4-h200-main-$j.json 2> $OUT/err-$j.txt
  echo "rc=$?"; python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
for j in d['jobs']:
  b=j['kvtier']['baseline']['result'] or {}
  print(j['jobname'], 'kvtier r/w MiB/s %.1f / %.1f' % (j['read']['bw_bytes']/2**20, j['write']['bw_bytes']/2**20), 'fio %.1f / %.1f' % (b.get('read',{}).get('bw_bytes',0)/2**20, b.get('write',{}).get('bw_bytes',0)/2**20), 'ratio', j['kvtier'].get('ratio_read'), j['kvtier'].get('ratio_write'))
" $OUT/fio4-h200-main-$j.json || tail -5 $OUT/err-$j.txt
done
date -u
