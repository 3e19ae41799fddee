#!/bin/bash
# Session 40's third device call: head after the review (the vector widths kept by address
# modulo 16, the table allocated in its stream's order, the arena and slab pool safe across
# threads, the GPU test of a get in flight fixed) against .gpu-base (9ce119f). 1. pytest -m gpu
# on head; 2. bench/gpu.py's 64 / 16 KiB rows and the single and small gets, head, base, base,
# head (the second call's order reversed).
set -u
H=$PWD; B=$PWD/.gpu-base
source bench/results/device-lib.sh
setup_trees $H $B
PYTHONPATH=/tmp/site:$H timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_gpu.py tests/test_gpu_plan.py tests/test_rev12_gpu.py --maxfail=8 > $OUT/pytest-gpu.txt 2>&1
tail -3 $OUT/pytest-gpu.txt; grep -E "^(FAILED|ERROR)|^E  " $OUT/pytest-gpu.txt | head; el pytest
for r in head-r1 base-r1 base-r2 head-r2; do T=$B; case $r in head*) T=$H;; esac
  left ${ROWS_END:-300} || { echo "rows $r skipped"; continue; }
  (cd $T && PYTHONPATH=/tmp/site:$T timeout 60 python3 bench/gpu.py --json --reps 7 \
      --cases rows64k,rows16k,single --variants "") > $OUT/rows-$r.json 2> $OUT/rows-$r.err \
      || tail -3 $OUT/rows-$r.err
  gpu_summary $OUT/rows-$r.json $r; el "rows $r"
done
