#!/bin/bash
# Session 38's first device call: the staged layer-wise load's placements on the kernel stream
# and a deeper staging ring (TransferPolicy.layer_fork, layer_ring, kernel_blocks), as
# bench/gpu.py's layers case's variants in the same process, with layer_timeline; two
# processes. Then pytest -m gpu (PYTEST_K: a -k expression) (test_gpu.py, test_gpu_plan.py, test_rev12_gpu.py).
set -u
T0=$(date +%s); el() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
H=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; cat /proc/loadavg
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1
PYTHONPATH=/tmp/site:$H python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3
el setup
for r in r1 r2; do
  PYTHONPATH=/tmp/site:$H timeout ${LAYERS_S:-150} python3 bench/gpu.py --json --reps 7 \
      --cases layers > $OUT/layers-$r.json 2> $OUT/layers-$r.err || tail -5 $OUT/layers-$r.err
  python3 - $OUT/layers-$r.json <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
print("default", {k: d.get(k) for k in ("layerwise_overlap", "layerwise_load_ms",
      "layerwise_compute_ms", "layerwise_total_ms", "onboard_ratio_layers")})
print("  timeline", d.get("layerwise_timeline"))
for k, v in d.items():
    if k.startswith("layerwise_variant_"):
        print(k[18:], {x: v.get(x) for x in ("layerwise_overlap", "layerwise_load_ms",
              "layerwise_compute_ms", "layerwise_total_ms")})
        print("  timeline", v.get("layerwise_timeline"))
PY
  el "layers $r"
done
PYTHONPATH=/tmp/site:$H timeout ${PYTEST_S:-200} python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_gpu.py tests/test_gpu_plan.py tests/test_rev12_gpu.py --maxfail=5 ${PYTEST_K:+-k "$PYTEST_K"} > $OUT/pytest-gpu.txt 2>&1
tail -3 $OUT/pytest-gpu.txt; el pytest
