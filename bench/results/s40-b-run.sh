#!/bin/bash
# Session 40's second device call: head (page tables kept on the device, pooled upload slabs)
# against .gpu-base (9ce119f, main at the session's start). 1. pytest -m gpu on head; 2.
# bench/gpu.py's 64 / 16 KiB rows and the single and small gets, base, head, head, base; 3.
# bench/gpu_probe.py's step timelines (16 and 64 KiB, no layers) on head and base; 4.
# bench/gpu.py --json in full on head, time allowing. Each part is skipped once its start
# would pass its END (seconds from the start).
set -u
H=$PWD; B=$PWD/.gpu-base
source bench/results/device-lib.sh
setup_trees $H $B
ls $H/kvtier/*/*.so $B/kvtier/*/*.so | wc -l
PYTHONPATH=/tmp/site:$H timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_gpu.py tests/test_gpu_plan.py tests/test_rev12_gpu.py --maxfail=8 > $OUT/pytest-gpu.txt 2>&1
tail -3 $OUT/pytest-gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest-gpu.txt | head; el pytest
for r in base-r1 head-r1 head-r2 base-r2; do T=$B; case $r in head*) T=$H;; esac
  left 330 || { echo "rows $r skipped"; continue; }
  (cd $T && PYTHONPATH=/tmp/site:$T timeout 60 python3 bench/gpu.py --json --reps 7 \
      --cases rows64k,rows16k,single --variants "") > $OUT/rows-$r.json 2> $OUT/rows-$r.err \
      || tail -3 $OUT/rows-$r.err
  gpu_summary $OUT/rows-$r.json $r; el "rows $r"
done
for r in head base; do T=$B; [ $r = head ] && T=$H
  left 400 || { echo "probe $r skipped"; continue; }
  (cd $T && PYTHONPATH=/tmp/site:$T timeout 45 python3 bench/gpu_probe.py --reps 7 --no-layers \
      --json) > $OUT/gpu-probe-$r.json 2> $OUT/gpu-probe-$r.err || tail -3 $OUT/gpu-probe-$r.err
  grep "^## " $OUT/gpu-probe-$r.err | sed "s/^/$r /"; el "probe $r"
done
if left 300; then
  PYTHONPATH=/tmp/site:$H timeout 150 python3 bench/gpu.py --json > $OUT/gpu-full.json 2>$OUT/gpu-full.err || tail -3 $OUT/gpu-full.err
  gpu_summary $OUT/gpu-full.json full; el "gpu full"
fi
