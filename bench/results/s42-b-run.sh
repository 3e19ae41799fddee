#!/bin/bash
# Session 42's second device call: the layer-wise load's placements given more thread blocks
# (TransferPolicy.place_blocks 33 / 66 / 132 / 264 against kernel_blocks' 16): bench/gpu.py's
# layers case (its variants run in the same process), in two processes. Then the rows
# cases with the new offload timelines (put_timeline: each reserve and commit sent and
# answered, the default and every chunk staged out), twice.
# (Its tree's default was 16 placement blocks, and the variants were place33/66/132/264;
# after it the default became one per SM and the variants place16/33/66/264.)
set -u
H=$PWD
source bench/results/device-lib.sh
setup_trees $H
for r in r1 r2; do
  PYTHONPATH=/tmp/site:$H timeout 200 python3 bench/gpu.py --json --cases layers \
      > $OUT/layers-$r.json 2>$OUT/layers-$r.err || tail -5 $OUT/layers-$r.err
  python3 - $OUT/layers-$r.json <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
print("default", d.get("layerwise_overlap"), d.get("layerwise_load_ms"), d.get("layerwise_compute_ms"),
      d.get("layerwise_total_ms"), d.get("layerwise_timeline"))
for k, v in d.items():
    if k.startswith("layerwise_variant_"):
        print(k[18:], v.get("layerwise_overlap"), v.get("layerwise_load_ms"),
              v.get("layerwise_compute_ms"), v.get("layerwise_total_ms"),
              {a: v.get("layerwise_timeline", {}).get(a) for a in ("compute_ms", "place_ms", "compute_wait")})
print("onboard_ratio_layers", d.get("onboard_ratio_layers"), "offload_ratio_layers", d.get("offload_ratio_layers"))
PY
  el $r
done
for r in r1 r2; do
  PYTHONPATH=/tmp/site:$H timeout 120 python3 bench/gpu.py --json --cases rows64k,rows16k \
      --variants staged_offload > $OUT/rows-$r.json 2>$OUT/rows-$r.err || tail -5 $OUT/rows-$r.err
  gpu_summary $OUT/rows-$r.json $r
  python3 - $OUT/rows-$r.json <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
for t in ("64k", "16k"):
    print(t, "offload_ms", d.get(f"offload_ms_{t}"), "variants", d.get(f"variants_{t}"))
    for sfx in ("", "_staged"):
        print(t, sfx or "default", d.get(f"offload_timeline_{t}{sfx}"))
PY
  el rows-$r
done
# pytest -m gpu on this tree (its staged_wide policy runs every data-path test with
# place_blocks=264), while the start is under 420 s.
if left 420; then
  PYTHONPATH=/tmp/site:$H timeout 280 python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/test_gpu.py tests/test_gpu_plan.py tests/test_rev12_gpu.py tests/test_gpu_kept.py \
      > $OUT/pytest-gpu.txt 2>&1
  tail -3 $OUT/pytest-gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest-gpu.txt | head
  el pytest
fi
