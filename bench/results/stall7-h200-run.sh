#!/bin/bash
# stall7's one H200 call: bench/stall.py at its defaults, main 16b2ada's tree (.gpu-stall7-base)
# and this branch's (.gpu-stall7) alternated main, branch, branch, main; then
# bench/stall_steps.py once per tree if the call is still under 90 s.
# Usage (repository root of the device's copy): bash .gpu-stall7/bench/results/stall7-h200-run.sh
# Locally (dry run): PY=... STALL_ARGS='--cold-blocks 512 --samples 100 --readers 1' OUT=... bash ...
set -u
T0=$(date +%s); H=$PWD/.gpu-stall7; B=$PWD/.gpu-stall7-base; PY=${PY:-python3}
el() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export PYTHONUNBUFFERED=1
(cd $H && PYTHONPATH=/tmp/site $PY setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
(cd $B && PYTHONPATH=/tmp/site $PY setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
wait; ls $H/kvtier/*/*.so $B/kvtier/*/*.so | wc -l
el built; nproc; cat /proc/loadavg
py() { local t=$1; shift; (cd $t && PYTHONPATH=/tmp/site:$t $PY "$@"); }
stall() {
  timeout 25 bash -c "cd $1 && PYTHONPATH=/tmp/site:$1 $PY bench/stall.py --json ${STALL_ARGS:-}" > $OUT/stall-$2.json 2>/dev/null
  $PY -c "import json,sys;d=json.load(open(sys.argv[1]));print(sys.argv[2], d['worst_p99_ratio'], d['loadavg_start'], d['loadavg_end'], [(r, c['alone_p99_us'], c['beside_p99_us'], c['p99_ratio']) for r, c in d['conditions'].items()])" $OUT/stall-$2.json $2
  el "stall $2"
}
stall $B base-r1; stall $H head-r1; stall $H head-r2; stall $B base-r2
for t in base head; do T=$B; [ $t = head ] && T=$H
  [ $(( $(date +%s) - T0 )) -lt 90 ] || { echo "steps $t skipped"; continue; }
  timeout 12 bash -c "cd $T && PYTHONPATH=/tmp/site:$T $PY bench/stall_steps.py --json" > $OUT/steps-$t.json 2>/dev/null
  $PY -c "import json,sys;d=json.load(open(sys.argv[1]));print(sys.argv[2], {k: (v['p50_us'], v['p90_us'], v['p99_us']) for k, v in d['steps'].items()})" $OUT/steps-$t.json $t
  el "steps $t"
done
