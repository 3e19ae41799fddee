#!/bin/bash
# Session 35's device call: on the merged head (this tree: put credits, fio10) against the
# session's base 6405c3b (.gpu-base): pytest -m gpu; bench/gpu.py's 64 / 16 KiB rows with and
# without credits in one process (variant no_credits); fio10's paired kvtier bench --compare
# (bench/results/s35-fio10-h200-run.sh), one round. fio carried in .gpu-fio.
set -u
T0=$(date +%s); el() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; cat /proc/loadavg
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
(python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
(cd .gpu-base && PYTHONPATH=/tmp/site python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
mkdir -p /tmp/fiobin && tar xJf .gpu-fio/fio-bin.tar.xz -C /tmp/fiobin
printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/fiobin/fio-libs exec /tmp/fiobin/fio-libs/fio.real "$@"\n' > /tmp/fiobin/fio; chmod +x /tmp/fiobin/fio
export PATH=/tmp/fiobin:$PATH; fio --version
D=""; for c in /var/tmp/x /root/x /tmp/x; do mkdir -p $c && t=$(stat -f -c %T $c) && [ "$t" != tmpfs ] && [ "$t" != ramfs ] && D=$c && break; done
echo "directory $D $(stat -f -c %T $D)"; df -h $D | tail -1
wait; ls kvtier/*/*.so .gpu-base/kvtier/*/*.so | wc -l
el setup
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_gpu_plan.py --maxfail=5 > $OUT/pytest-gpu.txt 2>&1; tail -3 $OUT/pytest-gpu.txt
el pytest
timeout 100 python3 bench/gpu.py --json --cases rows64k,rows16k --variants no_credits > $OUT/gpu-rows.json 2>/tmp/g.err || tail -3 /tmp/g.err
python3 -c "
import json,sys;d=json.load(open(sys.argv[1]))
print({k: d.get(k) for k in ('ratio_onboard_gbps_64k','ratio_offload_gbps_64k','ratio_onboard_gbps_16k','ratio_offload_gbps_16k','pinned_h2d_gbps','pinned_d2h_gbps')})
for t in ('64k','16k'): print('  no_credits', t, d.get('variants_'+t, {}).get('no_credits'))" $OUT/gpu-rows.json | tee $OUT/gpu-rows.txt
el gpu
BASE=$PWD/.gpu-base HEAD=$PWD DIR=$D K=100 LOCAL=1 ROUNDS=1 bash bench/results/s35-fio10-h200-run.sh 2>&1 | tail -22
el fio
