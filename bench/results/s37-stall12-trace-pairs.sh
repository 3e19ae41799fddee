#!/bin/bash
# stall12: bench/stall_trace.py --readers 4 --no-gc --task-steps, main's tree (base) and this
# branch (head) alternated base, head, head, base, base, head; one JSON line per run on stdout:
# each kind of loop work's [CPU p50, wall p50, wall p90, n] (task:* are the reply tasks' steps,
# as the head's hooks time them: the base run uses the head's bench and hooks, its own kvtier).
# Run from the branch's root: bash bench/results/s37-stall12-trace-pairs.sh [BASE_TREE] [ROUNDS]
BASE=${1:-/work/main}
ROUNDS=${2:-1}
HEAD=$PWD
BENCH=$(mktemp -d)
mkdir -p $BENCH/bench && cp -r bench/__init__.py bench/common.py bench/stall.py bench/stall_trace.py \
    bench/stall_trace_hooks $BENCH/bench/
PARTS=kvtier.coherence.gets:Gets.try_get,kvtier.api.server:Server._get_reply
for r in $(seq $ROUNDS); do
for tree in ${TREES:-base head head base base head}; do
    dir=$BASE; [ $tree = head ] && dir=$HEAD
    # The bench from a copy (its ROOT then holds no kvtier): each tree's own kvtier and tests.
    (cd $dir && PYTHONPATH=$dir OPENBLAS_NUM_THREADS=1 timeout 300 $HEAD/.venv/bin/python \
        $BENCH/bench/stall_trace.py --readers 4 --no-gc --task-steps --cold-blocks 4096 \
        --samples 1500 --parts $PARTS --json 2>/dev/null) | python3 -c "
import json, sys, os
d = json.load(sys.stdin); c = d['conditions']['4']
w = {k: [v.get('cpu_p50'), v['p50'], v['p90'], v['n']] for k, v in sorted(c['loop_work_us'].items())}
print(json.dumps({'tree': '$tree', 'load': round(os.getloadavg()[0], 2), 'alone_p99': c['alone_p99_us'],
                  'beside_p99': c['beside_p99_us'], 'tail_wait': c['tail_wait_by_kind_us'],
                  'work_cpu50_p50_p90_n': w}))"
done
done
rm -rf $BENCH
