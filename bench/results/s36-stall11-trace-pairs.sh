#!/bin/bash
# stall11: bench/stall_trace.py --readers 4 --no-gc, main's tree (base) and this branch (head)
# alternated base, head, head, base, base, head; one JSON line per run on stdout.
# Run from the branch's root: bash bench/results/s36-stall11-trace-pairs.sh [BASE_TREE]
BASE=${1:-/work/main}
HEAD=$PWD
PARTS=kvtier.coherence.engine:Engine.make_room,kvtier.coherence.gets:_room_count,kvtier.pagetable.table:PageTable.lookup,kvtier.coherence.transfers:Transfers.install_shared,kvtier.coherence.transfers:Transfers.install_read,kvtier.coherence.gets:Gets.try_get
for tree in base head head base base head; do
    dir=$BASE; [ $tree = head ] && dir=$HEAD
    (cd $dir && PYTHONPATH=$dir OPENBLAS_NUM_THREADS=1 timeout 300 .venv/bin/python \
        bench/stall_trace.py --readers 4 --no-gc --cold-blocks 4096 --samples 1500 \
        --parts $PARTS --json 2>/dev/null) | python3 -c "
import json, sys, os
d = json.load(sys.stdin); c = d['conditions']['4']
w = {k: [v.get('cpu_p50'), v['p50'], v['p90'], v['n']] for k, v in sorted(c['loop_work_us'].items())}
print(json.dumps({'tree': '$tree', 'load': os.getloadavg()[0], 'alone_p99': c['alone_p99_us'],
                  'beside_p99': c['beside_p99_us'], 'work_cpu50_p50_p90_n': w}))"
done
