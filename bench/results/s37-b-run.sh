#!/bin/bash
# Session 37's second device call: bench/gpu_probe.py (every client step of a 4,096-block
# get and put of 16 and 64 KiB on one time axis), twice, in two processes, on main.
set -u
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1 PYTHONPATH=/tmp/site:$PWD
python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3
for r in 1 2; do
  timeout 200 python3 bench/gpu_probe.py --json $([ $r = 2 ] && echo --no-layers) > $OUT/probe-$r.json 2> $OUT/probe-$r.txt || tail -5 $OUT/probe-$r.txt
  echo "probe $r at $(( $(date +%s) - T0 )) s"
done
grep "^## " $OUT/probe-*.txt
