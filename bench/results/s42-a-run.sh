#!/bin/bash
# Session 42's first device call: does the order a move reads the mapped segment in matter?
# bench/gpu.py's rows cases (4,096 x 64 KiB and 16 KiB, keys shuffled against their slots),
# the default against TransferPolicy(slot_order=True) (each chunk's blocks sorted by slot
# before its copies or kernel), in one process, twice (two processes).
# (Its tree carried a TransferPolicy.slot_order flag and the variants slot_order and
# slot_order_kernel in bench/gpu.py; both were dropped after this call: docs/DESIGN-NOTES.md,
# session 42.)
set -u
H=$PWD
source bench/results/device-lib.sh
setup_trees $H
for r in r1 r2; do
  PYTHONPATH=/tmp/site:$H timeout 150 python3 bench/gpu.py --json --cases rows64k,rows16k \
      --variants slot_order,slot_order_kernel,chunked_gets > $OUT/gpu-$r.json 2>$OUT/gpu-$r.err \
      || tail -5 $OUT/gpu-$r.err
  gpu_summary $OUT/gpu-$r.json $r
  python3 - $OUT/gpu-$r.json <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
for t in ("64k", "16k"):
    for n, v in d.get(f"variants_{t}", {}).items():
        print(t, n, v)
    tl = d.get(f"onboard_timeline_{t}")
    if tl:
        print(t, "gpu ms", [round(c[3] - c[2], 2) for c in tl["chunks"]], "done", tl["done_ms"])
PY
  el $r
done
