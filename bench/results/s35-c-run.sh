#!/bin/bash
# Session 35's last device call: bench/gpu.py's 64 / 16 KiB rows with and without put credits
# (variant no_credits) in the same process, twice, on the merged head.
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3
for r in 1 2; do
  timeout 100 python3 bench/gpu.py --json --cases rows64k,rows16k --variants no_credits > $OUT/gpu-rows-r$r.json 2>/tmp/g.err || tail -3 /tmp/g.err
  python3 -c "
import json,sys;d=json.load(open(sys.argv[1]))
print(sys.argv[2], {k: d.get(k) for k in ('ratio_onboard_gbps_64k','ratio_offload_gbps_64k','ratio_onboard_gbps_16k','ratio_offload_gbps_16k')})
for t in ('64k','16k'): print('  no_credits', t, d.get('variants_'+t, {}).get('no_credits'))" $OUT/gpu-rows-r$r.json r$r | tee -a $OUT/gpu-rows.txt
done
