#!/bin/bash
# Session 42's last device call, the final tree (placements and offload gathers in one thread
# block per SM by default): pytest -m gpu, then bench/gpu.py --json in full (its layers case
# keeps the old 16-block placements as the variant fork_ring3_place16; the rows cases measure
# short edge chunks for the offload, offload_ratio_*_edges_*; the rows cases' policy variants
# left out for time: --variants "").
set -u
H=$PWD
source bench/results/device-lib.sh
setup_trees $H
PYTHONPATH=/tmp/site:$H timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_gpu.py tests/test_gpu_plan.py tests/test_rev12_gpu.py tests/test_gpu_kept.py \
    > $OUT/pytest-gpu.txt 2>&1
tail -2 $OUT/pytest-gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest-gpu.txt | head
el pytest
PYTHONPATH=/tmp/site:$H timeout 230 python3 bench/gpu.py --json --variants "" > $OUT/gpu-full.json 2>$OUT/gpu-full.err || tail -3 $OUT/gpu-full.err
gpu_summary $OUT/gpu-full.json; el "gpu full"
python3 - $OUT/gpu-full.json <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
print({k: v for k, v in d.items() if "edges" in k or k in ("offload_ratio_2m", "matmul_ratio_beside_onboard_64k", "onboard_ratio_beside_matmul_64k")})
for k, v in d.items():
    if k.startswith("layerwise_variant_"):
        print(k[18:], v.get("layerwise_overlap"))
PY
