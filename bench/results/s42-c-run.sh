#!/bin/bash
# Session 42's last device call, the final tree (placements and offload gathers in one thread
# block per SM by default, gpu_place_blocks 0): pytest -m gpu; then bench/gpu.py's layers case
# (its variant fork_ring3_place16 keeps the old 16 blocks, in the same process) and its rows
# cases (the offload's short edge chunks, offload_ratio_*_edges_*, and the put timelines; the
# policy variants left out: --variants ""). The whole bench did not fit the session's device
# time left.
set -u
H=$PWD
source bench/results/device-lib.sh
setup_trees $H
PYTHONPATH=/tmp/site:$H timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_gpu.py tests/test_gpu_plan.py tests/test_rev12_gpu.py tests/test_gpu_kept.py \
    > $OUT/pytest-gpu.txt 2>&1
tail -2 $OUT/pytest-gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest-gpu.txt | head
el pytest
PYTHONPATH=/tmp/site:$H timeout 100 python3 bench/gpu.py --json --cases layers,rows64k,rows16k \
    --variants "" > $OUT/gpu.json 2>$OUT/gpu.err || tail -3 $OUT/gpu.err
gpu_summary $OUT/gpu.json; el bench
python3 - $OUT/gpu.json <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
print({k: v for k, v in d.items() if "edges" in k or "chunks_" in k})
print("layers default", d.get("layerwise_overlap"), d.get("layerwise_load_ms"), d.get("layerwise_compute_ms"))
for k, v in d.items():
    if k.startswith("layerwise_variant_"):
        print(k[18:], v.get("layerwise_overlap"))
for t in ("64k", "16k"):
    print(t, d.get(f"offload_timeline_{t}"))
PY
