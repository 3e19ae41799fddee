#!/bin/bash
# Session 35's first device call: pytest -m gpu on the credits branch (main + put credits) and
# bench/gpu.py's 64 / 16 KiB rows with and without credits in the same process (variant
# no_credits), twice, on whatever card came. Usage: bash bench/results/s35-a-run.sh.
set -u
T0=$(date +%s); el() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; cat /proc/loadavg
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3; ls kvtier/*/*.so kvtier/*.so 2>/dev/null | wc -l
el setup
timeout 180 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_gpu_plan.py --maxfail=5 > $OUT/pytest-gpu.txt 2>&1; tail -3 $OUT/pytest-gpu.txt
el pytest
for r in 1 2; do
  timeout 110 python3 bench/gpu.py --json --cases rows64k,rows16k --variants no_credits > $OUT/gpu-rows-r$r.json 2>/tmp/g.err || tail -3 /tmp/g.err
  python3 -c "
import json,sys;d=json.load(open(sys.argv[1]))
print(sys.argv[2], {k: d.get(k) for k in ('ratio_onboard_gbps_64k','ratio_offload_gbps_64k','ratio_onboard_gbps_16k','ratio_offload_gbps_16k','pinned_h2d_gbps','pinned_d2h_gbps')})
for t in ('64k','16k'): print('  no_credits', t, d.get('variants_'+t, {}).get('no_credits'))" $OUT/gpu-rows-r$r.json r$r | tee -a $OUT/gpu-rows.txt
  el gpu-r$r
done
