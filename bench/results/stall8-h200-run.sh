#!/bin/bash
# stall8's one H200 call: main b3c67ce's tree (.gpu-stall8-base) and this branch's (.gpu-stall8).
# 1. bench/stall.py at its defaults, alternated base, head, head, base, base, head (three pairs);
# 2. bench/stall_trace.py --readers 8 once per tree (this branch's tracer, with the gc events,
#    copied into the base tree: the hooks wrap methods both trees have), head first;
# 3. bench/results/stall8-room-pairs.py (the covered drop alternated get by get, in process) and
#    bench/results/stall8-refusal-pairs.py (try_get's refusal, C and numpy alternated), if time.
# Usage (repository root of the device's copy): bash .gpu-stall8/bench/results/stall8-h200-run.sh
set -u
T0=$(date +%s); H=$PWD/.gpu-stall8; B=$PWD/.gpu-stall8-base; PY=${PY:-python3}
el() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1
cp $H/bench/stall_trace.py $B/bench/stall_trace.py
cp $H/bench/stall_trace_hooks/sitecustomize.py $B/bench/stall_trace_hooks/sitecustomize.py
(cd $H && PYTHONPATH=/tmp/site $PY setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
(cd $B && PYTHONPATH=/tmp/site $PY setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
wait; ls $H/kvtier/*/*.so $H/kvtier/*/*/*.so $B/kvtier/*/*.so $B/kvtier/*/*/*.so 2>/dev/null | wc -l
el built; nproc; cat /proc/loadavg; $PY -c "import uvloop" 2>&1 | tail -1; $PY -V
stall() {
  timeout 25 bash -c "cd $1 && PYTHONPATH=/tmp/site:$1 $PY bench/stall.py --json ${STALL_ARGS:-}" > /tmp/stall-$2.json 2>/dev/null
  $PY -c "import json,sys;d=json.load(open(sys.argv[1]));d['run']=sys.argv[2];print(json.dumps(d))" /tmp/stall-$2.json $2 >> $OUT/stall.jsonl
  $PY -c "import json,sys;d=json.load(open(sys.argv[1]));print(sys.argv[2], d['worst_p99_ratio'], d['loadavg_start'], d['loadavg_end'], [(r, c['alone_p99_us'], c['beside_p50_us'], c['beside_p99_us'], c['p99_ratio']) for r, c in d['conditions'].items()])" /tmp/stall-$2.json $2
  el "stall $2"
}
stall $B base-r1; stall $H head-r1; stall $H head-r2; stall $B base-r2; stall $B base-r3; stall $H head-r3
for t in head base; do T=$B; [ $t = head ] && T=$H
  [ $(( $(date +%s) - T0 )) -lt 110 ] || { echo "trace $t skipped"; continue; }
  timeout 20 bash -c "cd $T && PYTHONPATH=/tmp/site:$T $PY bench/stall_trace.py --readers 8 ${TRACE_ARGS:-} --json" > /tmp/trace-$t.json 2>/dev/null
  $PY -c "import json,sys;d=json.load(open(sys.argv[1]));d['run']=sys.argv[2];print(json.dumps(d))" /tmp/trace-$t.json $t >> $OUT/trace.jsonl
  $PY -c "
import json,sys;d=json.load(open(sys.argv[1]));c=d['conditions']['8']
print(sys.argv[2], {k: c[k] for k in ('alone_p99_us','beside_p50_us','beside_p99_us','tail_wait_to_data_received_us','tail_in_data_received_us','tail_gc_overlap_us','tail_gets_with_gc')})
print('  tail', c['tail_wait_by_kind_us'])
print('  work', {k: (v['n'], v['p50'], v['p99'], v['share_of_phase']) for k, v in c['loop_work_us'].items()})
print('  blocked', {k: (v['blocked_share'], v['preempted_share'], v['waiting_p99_us']) for k, v in c['loop_switches'].items()})" /tmp/trace-$t.json $t
  el "trace $t"
done
if [ $(( $(date +%s) - T0 )) -lt 125 ]; then
  (cd $H && PYTHONPATH=/tmp/site:$H timeout 20 $PY bench/results/stall8-room-pairs.py --gets 1000 ${STEPS_ARGS:-} --json 2>/dev/null) | tail -2 | sed 's/^/room /' | tee -a $OUT/pairs.txt
  el "room pairs"
fi
if [ $(( $(date +%s) - T0 )) -lt 135 ]; then
  (cd $H && PYTHONPATH=/tmp/site:$H timeout 20 $PY bench/results/stall8-refusal-pairs.py 2>/dev/null) | sed 's/^/refusal /' | tee -a $OUT/pairs.txt
  el "refusal pairs"
fi
