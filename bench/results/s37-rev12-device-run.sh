#!/bin/bash
# rev12's device call (< 4 min): the CUDA put's commits read past by a call made before its
# wait() (tests/test_rev12_gpu.py: fails on main, a 5 s wait then a closed connection), then
# pytest -m gpu of test_gpu.py and test_gpu_plan.py on this tree (the client's read-past change
# is on every CUDA put's and get's reply path). BASE=<a copy of main's tree> (optional) runs the
# new test there too, to show it fails. Everything lands under $OUT.
set -u
T0=$(date +%s); el() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
H=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; cat /proc/loadavg
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1
build() { (cd "$1" && PYTHONPATH=/tmp/site:$1 python3 setup.py -q build_ext --inplace 2>&1 \
    | grep -i error | tail -3); }
build "$H" & [ -n "${BASE:-}" ] && build "$BASE" &
wait; el setup
PYTHONPATH=/tmp/site:$H timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_rev12_gpu.py > $OUT/rev12-gpu-head.txt 2>&1; tail -3 $OUT/rev12-gpu-head.txt
if [ -n "${BASE:-}" ]; then
  cp tests/test_rev12_gpu.py "$BASE/tests/"
  (cd "$BASE" && PYTHONPATH=/tmp/site:$BASE timeout 60 python3 -m pytest -q -p no:cacheprovider \
      -m gpu tests/test_rev12_gpu.py) > $OUT/rev12-gpu-base.txt 2>&1; tail -3 $OUT/rev12-gpu-base.txt
fi
el rev12
PYTHONPATH=/tmp/site:$H timeout 130 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_gpu.py tests/test_gpu_plan.py --maxfail=5 > $OUT/pytest-gpu.txt 2>&1
tail -3 $OUT/pytest-gpu.txt
el pytest
