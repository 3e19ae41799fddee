#!/bin/bash
# Session 40's first device call: main 9ce119f as it is. 1. the mapped-read probe in two
# processes; 2. pytest -m gpu; 3. bench/gpu.py --json in full; 4. the 16 KiB rows again with
# the sorted / chunked variants in the same process; 5. bench/stall.py twice (issue 17's stall
# line beside 1 / 4 / 8 NVMe readers), with bench/gpu_probe.py's step timeline before it. Each part is skipped once its start passes its END.
# (It ran with device-lib.sh's steps inline; they moved there afterwards, unchanged.)
set -u
H=$PWD
source bench/results/device-lib.sh
setup_trees $H
for i in 1 2; do
  PYTHONPATH=/tmp/site:$H timeout 60 python3 -c "
from kvtier.gpu import probe, warm
warm(0); print(probe.results())" >> $OUT/probe.txt 2>&1
done
cat $OUT/probe.txt; el probe
PYTHONPATH=/tmp/site:$H timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_gpu.py tests/test_gpu_plan.py tests/test_rev12_gpu.py --maxfail=8 > $OUT/pytest-gpu.txt 2>&1
tail -3 $OUT/pytest-gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest-gpu.txt | head; el pytest
if left 340; then
  PYTHONPATH=/tmp/site:$H timeout 170 python3 bench/gpu.py --json > $OUT/gpu-full.json 2>$OUT/gpu-full.err || tail -3 $OUT/gpu-full.err
  gpu_summary $OUT/gpu-full.json; el "gpu full"
fi
if left 470; then
  PYTHONPATH=/tmp/site:$H timeout 80 python3 bench/gpu.py --json --cases rows16k \
      --variants whole_gets,chunked_gets > $OUT/rows16k-r2.json 2>$OUT/rows16k-r2.err || tail -3 $OUT/rows16k-r2.err
  gpu_summary $OUT/rows16k-r2.json; el "rows16k r2"
fi
if left 500; then
  PYTHONPATH=/tmp/site:$H timeout 60 python3 bench/gpu_probe.py --reps 7 --no-layers --json \
      > $OUT/gpu-probe.json 2>$OUT/gpu-probe.err || tail -3 $OUT/gpu-probe.err
  el "gpu probe"
fi
for r in r1 r2; do
  left 555 || { echo "stall $r skipped"; continue; }
  PYTHONPATH=/tmp/site:$H timeout 30 python3 bench/stall.py --json > $OUT/stall-$r.json 2>/dev/null
  python3 - $OUT/stall-$r.json $r <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
print(sys.argv[2], d.get("worst_p99_ratio"), d.get("loadavg_start"),
      [(r, c["alone_p99_us"], c["beside_p99_us"], c["p99_ratio"]) for r, c in d.get("conditions", {}).items()])
PY
  el "stall $r"
done
