#!/bin/bash
# Session 41's second device call: bench/copy_enqueue.py again (its two-thread case fixed:
# each thread makes the device current first), twice, to see whether the enqueue's per-CPU
# spread repeats and whether two threads hand copies to the driver faster than one.
set -u
H=$PWD
source bench/results/device-lib.sh
setup_trees $H
for r in r1 r2; do
PYTHONPATH=/tmp/site:$H timeout 100 python3 bench/copy_enqueue.py --json > $OUT/copy-enqueue-$r.json 2>$OUT/copy-enqueue-$r.err || tail -5 $OUT/copy-enqueue-$r.err
grep -i "error" $OUT/copy-enqueue-$r.err | head -3
python3 - $OUT/copy-enqueue-$r.json <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
if d:
    print("per cpu us/copy", {c: r["enqueue_us_per_copy"] for c, r in d["per_cpu"].items()})
    print("two threads", d["two_threads"])
PY
el "enqueue $r"
done
