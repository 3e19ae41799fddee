#!/bin/bash
# stall12's device call (issue 17's stall line): main's tree (BASE) against this branch's
# (HEAD: a reader's piggybacked release as its steps' first step, its reply written an
# iteration after the one that builds it, a room step of >= 32 evictions in two slices), and
# HEAD without the room step's split ("nosplit": a copy of HEAD, ROOM_SPLIT_MIN out of reach),
# each built in place. Then
# 1. bench/stall.py at its defaults, alternated base, head, nosplit, nosplit, head, base, base,
#    head, nosplit (three rounds, ~12 s a run on the H200/H100 host), each run's JSON a line of
#    $OUT/stall.jsonl and a summary line in $OUT/log.txt (worst ratio, load, per readers:
#    alone p99, beside p50, beside p99, ratio);
# 2. bench/stall_trace.py --readers 8 --no-gc --task-steps once per tree (head, base), with
#    this branch's tracer copied into the base tree (its hooks wrap methods both trees have):
#    each slice's CPU p50, the reply tasks' steps (task:*) with them.
# A stall run is not started after 125 s, a trace after 150 s (each at most 30 and 22 s: the
# whole call < 3 min).
# Usage, from the repository root of the device's copy:
#     bash .gpu-stall12/bench/results/s37-stall12-run.sh [BASE] [HEAD]
# (BASE, HEAD: copies of the trees relative to $PWD, default .gpu-base and .gpu-stall12; OUT
# must be set, as the device sets it. STALL_ARGS, TRACE_ARGS: extra arguments, for a smoke
# run, e.g. STALL_ARGS="--readers 1 --cold-blocks 256 --batch 16 --host-capacity 8MiB
# --samples 50", TRACE_ARGS the same with --readers 8.)
set -u
T0=$(date +%s); B=$PWD/${1:-.gpu-base}; H=$PWD/${2:-.gpu-stall12}; PY=${PY:-python3}
N=/tmp/stall12-nosplit
LOG=$OUT/log.txt
el() { echo "$1 at $(( $(date +%s) - T0 )) s" | tee -a "$LOG"; }
left() { [ $(( $(date +%s) - T0 )) -lt "${1:-125}" ]; }
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1
cp "$H/bench/stall_trace.py" "$B/bench/stall_trace.py"
cp "$H/bench/stall_trace_hooks/sitecustomize.py" "$B/bench/stall_trace_hooks/sitecustomize.py"
(cd "$H" && PYTHONPATH=/tmp/site $PY setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
(cd "$B" && PYTHONPATH=/tmp/site $PY setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
wait
# nosplit: HEAD's built tree, the room step never split (the only difference).
rm -rf "$N" && mkdir -p "$N" && (cd "$H" && tar --exclude=.git -cf - .) | tar -xf - -C "$N"
sed -i 's/^ROOM_SPLIT_MIN = 32$/ROOM_SPLIT_MIN = 1 << 62/' "$N/kvtier/coherence/gets.py"
for T in "$B" "$H" "$N"; do
  (cd "$T" && PYTHONPATH=/tmp/site:$T $PY -c "
import kvtier.api.steps as S, kvtier.coherence.gets as G
print('$T', 'release step', hasattr(S, 'released_first'), 'room split at',
      getattr(G, 'ROOM_SPLIT_MIN', None))") | tee -a "$LOG"
done
# Each tree run once before timing (its bytecode cache written: worktree pairs were ~10% off
# without, session 36).
for T in "$B" "$H" "$N"; do (cd "$T" && PYTHONPATH=/tmp/site:$T $PY -c "import bench.stall, kvtier.api.server" 2>/dev/null); done
el built; nproc | tee -a "$LOG"; tee -a "$LOG" < /proc/loadavg
stall() {
  left || { echo "stall $2 skipped" | tee -a "$LOG"; return; }
  timeout 30 bash -c "cd $1 && PYTHONPATH=/tmp/site:$1 $PY bench/stall.py --json ${STALL_ARGS:-}" > /tmp/stall-$2.json 2>/dev/null
  $PY "$H/bench/stall_device.py" stall /tmp/stall-$2.json "$2" "$OUT/stall.jsonl" | tee -a "$LOG"
  el "stall $2"
}
stall "$B" base-r1; stall "$H" head-r1; stall "$N" nosplit-r1
stall "$N" nosplit-r2; stall "$H" head-r2; stall "$B" base-r2
stall "$B" base-r3; stall "$H" head-r3; stall "$N" nosplit-r3
PARTS="kvtier.coherence.gets:Gets.try_get,kvtier.api.server:Server._get_reply"
for t in head base; do T=$B; [ $t = head ] && T=$H
  left 150 || { echo "trace $t skipped" | tee -a "$LOG"; continue; }
  timeout 22 bash -c "cd $T && PYTHONPATH=/tmp/site:$T $PY bench/stall_trace.py --readers 8 --no-gc --task-steps --parts $PARTS --json ${TRACE_ARGS:-}" > /tmp/trace-$t.json 2>/dev/null
  $PY "$H/bench/stall_device.py" trace /tmp/trace-$t.json "$t" "$OUT/trace.jsonl" 8 | tee -a "$LOG"
  el "trace $t"
done
rm -rf "$N"
el done
