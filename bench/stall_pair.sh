#!/bin/bash
# The stall's paired run in one device call (issue 17, stall4): bench/stall_trace.py on the
# base tree and on this one, then bench/stall.py base / branch alternated ROUNDS times, then
# bench/stall_steps.py on both while the budget lasts. Each run is skipped once fewer than 30 s
# of BUDGET are left (outputs so far are kept).
#
#     bench/stall_pair.sh BASE_TREE OUT_DIR [BUDGET_S] [ROUNDS]
#
# Run from this tree's root, both trees built in place. Writes OUT_DIR/<run>.json (the two
# stall_steps runs merged into steps.json) and one log (each run's stderr, exit status and end
# time). SITE: a folder put first on PYTHONPATH (the device's wheels). STALL_ARGS / STEPS_ARGS:
# extra arguments (a smoke run: STALL_ARGS="--readers 1 --cold-blocks 256 --batch 16
# --host-capacity 8MiB --samples 50" STEPS_ARGS="--cold-blocks 512 --host-capacity 8MiB --gets 20").
# TRACES: the trees traced ("base branch" by default; "branch" or "" for fewer); TRACE_AT=end
# runs them after the steps, so that a short budget spends itself on the paired runs first.
set -u
BASE=$(cd "$1" && pwd); OUT=$2; BUDGET=${3:-230}; ROUNDS=${4:-2}
HERE=$PWD
T0=$(date +%s)
LOG=$OUT/log.txt
run() {                         # run NAME TREE LIMIT_S SCRIPT ARGS...
    local name=$1 tree=$2 lim=$3; shift 3
    local left=$(( BUDGET - ($(date +%s) - T0) ))
    if [ "$left" -lt 30 ]; then echo "$name: skipped, $left s left" >> "$LOG"; return; fi
    [ "$lim" -gt "$left" ] && lim=$left
    echo "== $name ($tree, limit $lim s)" >> "$LOG"
    (cd "$tree" && PYTHONPATH="${SITE:+$SITE:}$tree" PYTHONUNBUFFERED=1 timeout "$lim" \
        python3 "$@" > "$OUT/$name.json" 2>> "$LOG")
    echo "$name: rc=$? at $(( $(date +%s) - T0 )) s" >> "$LOG"
}
(cd "$HERE" && PYTHONPATH="${SITE:+$SITE:}$HERE" python3 -c "
from kvtier.tiers import reads; from kvtier import checksums
print('branch: C read available', reads.available(), 'libxxhash', checksums._fn is not None)") >> "$LOG" 2>&1
traces() {
    for t in ${TRACES-base branch}; do
        if [ "$t" = base ]; then tree=$BASE; else tree=$HERE; fi
        run "trace-$t" "$tree" 60 bench/stall_trace.py --samples 1500 --json ${STALL_ARGS:-}
    done
}
[ "${TRACE_AT:-start}" = end ] || traces
for r in $(seq 1 "$ROUNDS"); do
    run "stall-base-r$r" "$BASE" 50 bench/stall.py --json ${STALL_ARGS:-}
    run "stall-branch-r$r" "$HERE" 50 bench/stall.py --json ${STALL_ARGS:-}
done
run steps-base "$BASE" 30 bench/stall_steps.py --json ${STEPS_ARGS:-}
run steps-branch "$HERE" 30 bench/stall_steps.py --json ${STEPS_ARGS:-}
[ "${TRACE_AT:-start}" = end ] && traces
python3 - "$OUT" <<'PY' >> "$LOG" 2>&1
import json, os, sys
out = sys.argv[1]
merged = {}
for tree in ("base", "branch"):
    p = os.path.join(out, f"steps-{tree}.json")
    if os.path.exists(p):
        with open(p) as fh:
            text = fh.read()
        merged[tree] = json.loads(text[text.find("{"):]) if "{" in text else text
        os.remove(p)
if merged:
    with open(os.path.join(out, "steps.json"), "w") as fh:
        json.dump(merged, fh, indent=1)
PY
echo "done at $(( $(date +%s) - T0 )) s" >> "$LOG"
