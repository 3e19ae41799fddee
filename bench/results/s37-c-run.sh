#!/bin/bash
# Session 37's third device call: the service's busy-poll window against the GPU rows. A GPU get
# of 4,096 small blocks leaves the service idle for 2-6 ms while the client waits on the GPU, past
# busy_poll_us (1 ms): the next get's first request then waits 0.1-0.37 ms for the service's
# loop to wake (bench/gpu_probe.py, s37-h100-probe). bench/gpu.py's 64 / 16 KiB rows with
# KVTIER_BUSY_POLL_US 1000 (the default) and 10000, alternated twice; then gpu_probe.py once
# at 10000 (no layer-wise part).
set -u
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1 PYTHONPATH=/tmp/site:$PWD
python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3
for r in b1000-r1 b10000-r1 b10000-r2 b1000-r2; do
  b=${r%-*}; b=${b#b}
  KVTIER_BUSY_POLL_US=$b timeout 60 python3 bench/gpu.py --json --reps 7 --cases rows64k,rows16k \
      --variants "" > $OUT/rows-$r.json 2> /tmp/g.err || tail -3 /tmp/g.err
  python3 - $OUT/rows-$r.json $r <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
print(sys.argv[2], {k: d.get(k) for k in ("ratio_onboard_gbps_64k", "ratio_offload_gbps_64k",
      "ratio_onboard_gbps_16k", "ratio_offload_gbps_16k")})
PY
  echo "rows $r at $(( $(date +%s) - T0 )) s"
done
KVTIER_BUSY_POLL_US=10000 timeout 90 python3 bench/gpu_probe.py --json --no-layers > $OUT/probe-b10000.json 2> $OUT/probe-b10000.txt || tail -5 $OUT/probe-b10000.txt
grep "^## " $OUT/probe-b10000.txt
echo "done at $(( $(date +%s) - T0 )) s"
