#!/bin/bash
# stall11's device call (issue 17's stall line): main's tree (BASE, default .gpu-base) against
# this branch's (HEAD, default .gpu-stall11: the shared install's writes in one C call,
# _gets.c install_shares), each built in place. Then
# 1. bench/stall.py at its defaults, alternated base, head, head, base, base, head (three
#    rounds, ~12 s a run on the H200 host), each run's JSON a line of $OUT/stall.jsonl and a
#    summary line in $OUT/log.txt (worst ratio, load, per readers: alone p99, beside p50,
#    beside p99, ratio);
# 2. bench/stall_trace.py --readers 8 --no-gc once per tree, head first, with this branch's
#    tracer copied into the base tree (its hooks wrap methods both trees have), the install
#    and the room step split by --parts (install_shared, install_read, make_room, try_get).
# A stall run is not started after 130 s, a trace after 145 s (each at most 30 and 22 s: the
# whole call < 3 min).
# Usage, from the repository root of the device's copy:
#     bash .gpu-stall11/bench/results/s36-stall11-h200-run.sh
# (HEAD=... BASE=... to name other copies, relative to $PWD; OUT must be set, as the device sets
# it. STALL_ARGS, TRACE_ARGS: extra arguments, for a smoke run, e.g. STALL_ARGS="--readers 1
# --cold-blocks 256 --batch 16 --host-capacity 8MiB --samples 50", TRACE_ARGS the same with
# --readers 8.)
set -u
T0=$(date +%s); H=$PWD/${HEAD:-.gpu-stall11}; B=$PWD/${BASE:-.gpu-base}; PY=${PY:-python3}
LOG=$OUT/log.txt
el() { echo "$1 at $(( $(date +%s) - T0 )) s" | tee -a "$LOG"; }
left() { [ $(( $(date +%s) - T0 )) -lt "${1:-130}" ]; }
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
(cd "$H" && PYTHONPATH=/tmp/site:$H $PY -c "from kvtier.coherence import _gets; print('head install_shares', hasattr(_gets, 'install_shares'))") | tee -a "$LOG"
(cd "$B" && PYTHONPATH=/tmp/site:$B $PY -c "from kvtier.coherence import _gets; print('base install_shares', hasattr(_gets, 'install_shares'))") | tee -a "$LOG"
# Each tree run once before timing (its bytecode cache written: worktree pairs were ~10% off
# without, session 36).
for T in "$B" "$H"; do (cd "$T" && PYTHONPATH=/tmp/site:$T $PY -c "import bench.stall, kvtier.api.server" 2>/dev/null); done
el built; nproc | tee -a "$LOG"; tee -a "$LOG" < /proc/loadavg
stall() {
  left || { echo "stall $2 skipped" | tee -a "$LOG"; return; }
  timeout 30 bash -c "cd $1 && PYTHONPATH=/tmp/site:$1 $PY bench/stall.py --json ${STALL_ARGS:-}" > /tmp/stall-$2.json 2>/dev/null
  $PY - /tmp/stall-$2.json "$2" "$OUT/stall.jsonl" <<'PY' | tee -a "$LOG"
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):])
d["run"] = sys.argv[2]
with open(sys.argv[3], "a") as fh:
    fh.write(json.dumps(d) + "\n")
print(sys.argv[2], d["worst_p99_ratio"], d["loadavg_start"], d["loadavg_end"],
      [(r, c["alone_p99_us"], c["beside_p50_us"], c["beside_p99_us"], c["p99_ratio"])
       for r, c in d["conditions"].items()])
PY
  el "stall $2"
}
stall "$B" base-r1; stall "$H" head-r1
stall "$H" head-r2; stall "$B" base-r2
stall "$B" base-r3; stall "$H" head-r3
PARTS="kvtier.coherence.transfers:Transfers.install_shared,kvtier.coherence.transfers:Transfers.install_read"
PARTS="$PARTS,kvtier.coherence.engine:Engine.make_room,kvtier.coherence.gets:Gets.try_get"
for t in head base; do T=$B; [ $t = head ] && T=$H
  left 145 || { echo "trace $t skipped" | tee -a "$LOG"; continue; }
  timeout 22 bash -c "cd $T && PYTHONPATH=/tmp/site:$T $PY bench/stall_trace.py --readers 8 --no-gc --parts $PARTS --json ${TRACE_ARGS:-}" > /tmp/trace-$t.json 2>/dev/null
  $PY - /tmp/trace-$t.json "$t" "$OUT/trace.jsonl" <<'PY' | tee -a "$LOG"
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):])
d["run"] = sys.argv[2]
with open(sys.argv[3], "a") as fh:
    fh.write(json.dumps(d) + "\n")
c = d["conditions"]["8"]
print(sys.argv[2], {k: c[k] for k in ("alone_p99_us", "beside_p50_us", "beside_p99_us",
                                      "tail_wait_to_data_received_us", "reader_gets")})
print("  tail", {k: v["us"] for k, v in c["tail_wait_by_kind_us"].items()})
print("  work", {k: (v["n"], v.get("cpu_p50"), v["p50"], v["p90"], v["share_of_phase"])
                 for k, v in c["loop_work_us"].items()})
PY
  el "trace $t"
done
el done
