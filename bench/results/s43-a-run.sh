#!/bin/bash
# Prepared in session 43 and NOT RUN: no device came (nine starts refused, then lending paused).
# The next session's first call: bench/gpu.py --json in full (every case, every variant: the
# run the issue's "what must be shown" names), whose rows64k variants now include
# kernel_share_12/25/50 (that share of each 64 KiB onboard chunk read by the kernel beside
# the batched copies, TransferPolicy.kernel_share, off by default); then pytest -m gpu with
# what is left of the call (a policy copy_engine_split added to every data-path test).
set -u
H=$PWD
source bench/results/device-lib.sh
setup_trees $H
PYTHONPATH=/tmp/site:$H timeout 300 python3 bench/gpu.py --json > $OUT/gpu-full.json \
    2>$OUT/gpu-full.err || tail -3 $OUT/gpu-full.err
gpu_summary $OUT/gpu-full.json full; el "gpu full"
python3 - $OUT/gpu-full.json <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
v = d.get("variants_64k", {})
print("64k default onboard", d.get("ratio_onboard_gbps_64k"), "enqueue", d.get("onboard_enqueue_ms_64k"))
for k in ("kernel_share_12", "kernel_share_25", "kernel_share_50", "kernel_onboard"):
    print(k, v.get(k))
PY
REST=$(( 585 - $(date +%s) + T0 ))
PYTHONPATH=/tmp/site:$H timeout $REST python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_gpu.py tests/test_gpu_plan.py tests/test_rev12_gpu.py tests/test_gpu_kept.py \
    > $OUT/pytest-gpu.txt 2>&1
tail -2 $OUT/pytest-gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest-gpu.txt | head
el pytest
