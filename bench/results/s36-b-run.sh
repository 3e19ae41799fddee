#!/bin/bash
# Session 36's first device call, on main 1cbb7ca (session 35's merges, then rev11, rcpu6, fio11; credits off by
# default, fio10, rev10, stall10) against session 35's base 6405c3b (.gpu-base, for the stall):
# 1. pytest -m gpu of test_gpu.py and test_gpu_plan.py (the final form of session 35's GPU
#    tests has not run on a GPU); 2. bench/gpu.py --json, the full run (all 13 fields);
# 3. bench/stall.py at its defaults, base and head alternated three rounds (issue 17's stall line).
# (s36-a-run.sh ran stall10's three-tree script; the machine was taken back mid-call.)
set -u
T0=$(date +%s); el() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; cat /proc/loadavg
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
(python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
(cd .gpu-base && PYTHONPATH=/tmp/site python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
wait; ls kvtier/*/*.so .gpu-base/kvtier/*/*.so | wc -l
el setup
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_gpu_plan.py --maxfail=5 > $OUT/pytest-gpu.txt 2>&1; tail -3 $OUT/pytest-gpu.txt
el pytest
timeout 120 python3 bench/gpu.py --json > $OUT/gpu.json 2>$OUT/gpu-err.txt || tail -3 $OUT/gpu-err.txt
python3 - $OUT/gpu.json <<'PY' | tee $OUT/gpu-fields.txt
import json, sys
d = json.load(open(sys.argv[1]))
for k in ("onboard_ratio_2m", "offload_ratio_2m", "onboard_ratio_layers", "offload_ratio_layers",
          "ratio_onboard_gbps_64k", "ratio_onboard_gbps_16k", "ratio_offload_gbps_64k",
          "ratio_offload_gbps_16k", "matmul_ratio_beside_onboard", "onboard_ratio_beside_matmul",
          "layerwise_overlap", "single_cuda_get_p50_us", "hbm_onboard_ratio_2m"):
    print(k, d.get(k))
PY
el gpu
unset PYTHONPATH
for r in base-r1 head-r1 head-r2 base-r2 base-r3 head-r3; do T=$PWD/.gpu-base; case $r in head*) T=$PWD;; esac
  [ $(( $(date +%s) - T0 )) -lt 330 ] || { echo "stall $r skipped"; continue; }
  (cd $T && PYTHONPATH=/tmp/site:$T timeout 30 python3 bench/stall.py --json) > /tmp/s.json 2>/dev/null
  python3 - /tmp/s.json $r $OUT/stall.jsonl <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):])
d["run"] = sys.argv[2]
open(sys.argv[3], "a").write(json.dumps(d) + "\n")
print(sys.argv[2], d["worst_p99_ratio"], d["loadavg_start"],
      [(r, c["alone_p99_us"], c["beside_p99_us"], c["p99_ratio"]) for r, c in d["conditions"].items()])
PY
done
el stall
