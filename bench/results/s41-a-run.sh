#!/bin/bash
# Session 41's first device call, main as it is. 1. bench/copy_enqueue.py (why a 64 KiB
# onboard is bound by its copies' enqueue in some processes: the enqueuing CPU, a spinner
# beside it, more registered ranges); 2. pytest -m gpu on the whole tree; 3. bench/gpu.py
# --json in full. Each part is skipped once its start passes its END.
set -u
H=$PWD
source bench/results/device-lib.sh
setup_trees $H
lscpu | grep -E "^(Thread|Core|Socket|NUMA|Model name)" ; cat /proc/loadavg
PYTHONPATH=/tmp/site:$H timeout 120 python3 bench/copy_enqueue.py --json > $OUT/copy-enqueue.json 2>$OUT/copy-enqueue.err || tail -5 $OUT/copy-enqueue.err
python3 - $OUT/copy-enqueue.json <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
if d:
    print("topology", d["topology"]["siblings"], d["topology"]["nodes"])
    print("unpinned", d["unpinned"])
    print("per cpu us/copy", {c: r["enqueue_us_per_copy"] for c, r in d["per_cpu"].items()})
    print("per cpu gpu GB/s", {c: r["gpu_gbps"] for c, r in d["per_cpu"].items()})
    print("beside spinner", d["beside_spinner"])
    print("more ranges", d["with_16_more_ranges"])
    print("two threads", d["two_threads"])
PY
el enqueue
PYTHONPATH=/tmp/site:$H timeout 280 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_gpu.py tests/test_gpu_plan.py tests/test_rev12_gpu.py tests/test_gpu_kept.py \
    > $OUT/pytest-gpu.txt 2>&1
tail -3 $OUT/pytest-gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest-gpu.txt | head; el pytest
if left 420; then
  PYTHONPATH=/tmp/site:$H timeout 170 python3 bench/gpu.py --json > $OUT/gpu-full.json 2>$OUT/gpu-full.err || tail -3 $OUT/gpu-full.err
  gpu_summary $OUT/gpu-full.json; el "gpu full"
  python3 - $OUT/gpu-full.json <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
t = d.get("onboard_timeline_64k")
if t:
    print("64k chunks enqueue ms", [round(c[1] - c[0], 2) for c in t["chunks"]],
          "gpu ms", [round(c[3] - c[2], 2) for c in t["chunks"]], "done", t["done_ms"])
print("64k profile", (d.get("onboard_profile_64k") or [""])[0][:70])
PY
fi
