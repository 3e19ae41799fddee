#!/bin/bash
# stall12: bench/stall_dispatch.py (4 readers in process, 300 gets each, the collector off),
# main's tree (base) and this branch (head) in the order given (default base, head, head,
# base, base, head); one JSON line per run on stdout: the longest slice (CPU p50), the sum of
# each kind's CPU p50, the loop's CPU per get, each kind's [CPU p50, CPU p90].
# TASKS=--task-steps (default) times the reply tasks' steps too; TASKS= leaves C tasks.
# Run from the branch's root: bash bench/results/s37-stall12-inproc-pairs.sh [BASE_TREE] [TREES...]
BASE=${1:-/work/main}; shift
HEAD=$PWD
TASKS=${TASKS---task-steps}
BENCH=$(mktemp -d)
mkdir -p $BENCH/bench && cp bench/__init__.py bench/common.py bench/stall_steps.py \
    bench/stall_dispatch.py $BENCH/bench/
for tree in ${@:-base head head base base head}; do
    dir=$BASE; [ $tree = head ] && dir=$HEAD
    # The bench from a copy (its ROOT then holds no kvtier): each tree's own kvtier.
    (cd $dir && PYTHONPATH=$dir OPENBLAS_NUM_THREADS=1 $HEAD/.venv/bin/python \
        $BENCH/bench/stall_dispatch.py --gets 300 --no-gc $TASKS --json 2>/dev/null) | python3 -c "
import json, sys, os
d = json.load(sys.stdin)
print(json.dumps({'tree': '$tree', 'load': round(os.getloadavg()[0], 2), 'longest': d['longest_cpu_p50'],
                  'sum': d['sum_cpu_p50_us'], 'loop_cpu_get': d['loop_cpu_per_get_us'],
                  'dr': d['data_received']['cpu']['p50'],
                  's': {k: (v['cpu']['p50'], v['cpu']['p90']) for k, v in d['slices'].items()}}))"
done
rm -rf $BENCH
