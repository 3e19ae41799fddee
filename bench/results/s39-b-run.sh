#!/bin/bash
# Session 39's second host: the mapped-read probe and the 16 KiB rows (default = auto against
# whole_gets = on and chunked_gets = off, in the same process) in two processes, then the
# probe's GPU test. For the other side of the floor, if this host reads mapped memory slowly.
set -u
T0=$(date +%s); el() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
H=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; cat /proc/loadavg
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1
PYTHONPATH=/tmp/site:$H python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3
el setup
for r in r1 r2; do
  PYTHONPATH=/tmp/site:$H timeout 80 python3 bench/gpu.py --json --cases rows16k \
      --variants whole_gets,chunked_gets > $OUT/rows16k-$r.json 2>$OUT/rows16k-$r.err || tail -3 $OUT/rows16k-$r.err
  python3 -c "
import json;t=open('$OUT/rows16k-$r.json').read();d=json.loads(t[t.find('{'):])
print('$r', d.get('ratio_onboard_gbps_16k'), d.get('mapped_read_probe'), d.get('methods_16k'), {k:v.get('onboard_ratio') for k,v in d.get('variants_16k',{}).items()})"
  el "rows16k $r"
done
PYTHONPATH=/tmp/site:$H timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
    -k "probe" > $OUT/pytest-probe.txt 2>&1; tail -1 $OUT/pytest-probe.txt; el pytest
