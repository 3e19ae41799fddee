#!/bin/bash
# Session 38's device call: bench/gpu.py's layers case (its layer-wise variants: placements
# forked, staging rings, copy engines enqueued by a worker thread) in two processes, pytest -m
# gpu, then bench/gpu.py --json in full once. Each part is skipped once its start would pass
# its END (seconds from the start).
set -u
T0=$(date +%s); el() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
left() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
H=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; cat /proc/loadavg
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1
PYTHONPATH=/tmp/site:$H python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3
el setup
layers() {
  PYTHONPATH=/tmp/site:$H timeout 120 python3 bench/gpu.py --json --reps 7 \
      --cases layers > $OUT/layers-$1.json 2> $OUT/layers-$1.err || tail -5 $OUT/layers-$1.err
  python3 bench/results/s38-layers-summary.py $OUT/layers-$1.json
  el "layers $1"
}
layers r1
PYTHONPATH=/tmp/site:$H timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_gpu.py tests/test_gpu_plan.py tests/test_rev12_gpu.py --maxfail=5 > $OUT/pytest-gpu.txt 2>&1
tail -3 $OUT/pytest-gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest-gpu.txt | head; el pytest
left 380 && layers r2
if left 430; then
  PYTHONPATH=/tmp/site:$H timeout 140 python3 bench/gpu.py --json > $OUT/gpu-full.json 2>$OUT/gpu-full.err || tail -3 $OUT/gpu-full.err
  python3 - $OUT/gpu-full.json <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
print({k: d.get(k) for k in ("onboard_ratio_2m", "offload_ratio_2m", "onboard_ratio_layers",
      "offload_ratio_layers", "ratio_onboard_gbps_64k", "ratio_onboard_gbps_16k", "ratio_offload_gbps_64k",
      "ratio_offload_gbps_16k", "matmul_ratio_beside_onboard", "onboard_ratio_beside_matmul",
      "layerwise_overlap", "single_cuda_get_p50_us", "hbm_onboard_ratio_2m")})
PY
  python3 bench/results/s38-layers-summary.py $OUT/gpu-full.json
  el "gpu full"
fi
