#!/bin/bash
# Session 36's last device call: main after stall11 (the shared install in one C call), svc12
# (the service's reserve and commit, the Packer's 64 KiB buffer) against a4b2bba (.gpu-base:
# main before them). 1. bench/stall.py, base and head alternated three rounds (issue 17's
# stall line); 2. pytest -m gpu on head; 3. bench/gpu.py's 64 / 16 KiB rows, no variants, base,
# head, head, base (issue 16's offload and onboard rows). Each part is skipped once its start
# would pass the call's budget (STALL_END, PYTEST_END, ROWS_END: the seconds after which each
# part is no longer started; PYTEST_S: pytest's limit); every result lands under $OUT as made.
set -u
T0=$(date +%s); el() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
left() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
H=$PWD; B=$PWD/.gpu-base
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; cat /proc/loadavg
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1
(PYTHONPATH=/tmp/site:$H python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
(cd $B && PYTHONPATH=/tmp/site:$B python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
wait; ls $H/kvtier/*/*.so $B/kvtier/*/*.so | wc -l; el setup
for r in base-r1 head-r1 head-r2 base-r2 base-r3 head-r3; do T=$B; case $r in head*) T=$H;; esac
  left ${STALL_END:-120} || { echo "stall $r skipped"; continue; }
  (cd $T && PYTHONPATH=/tmp/site:$T timeout 30 python3 bench/stall.py --json) > /tmp/s.json 2>/dev/null
  python3 - /tmp/s.json $r $OUT/stall.jsonl <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):])
d["run"] = sys.argv[2]
open(sys.argv[3], "a").write(json.dumps(d) + "\n")
print(sys.argv[2], d["worst_p99_ratio"], d["loadavg_start"],
      [(r, c["alone_p99_us"], c["beside_p99_us"], c["p99_ratio"]) for r, c in d["conditions"].items()])
PY
done
el stall
left ${PYTEST_END:-220} && PYTHONPATH=/tmp/site:$H timeout ${PYTEST_S:-120} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_gpu_plan.py --maxfail=5 > $OUT/pytest-gpu.txt 2>&1; tail -3 $OUT/pytest-gpu.txt
el pytest
for r in base-r1 head-r1 head-r2 base-r2; do T=$B; case $r in head*) T=$H;; esac
  left ${ROWS_END:-330} || { echo "rows $r skipped"; continue; }
  (cd $T && PYTHONPATH=/tmp/site:$T timeout 40 python3 bench/gpu.py --json --reps 5 \
      --cases rows64k,rows16k --variants "") > $OUT/gpu-$r.json 2> /tmp/g.err || tail -3 /tmp/g.err
  python3 - $OUT/gpu-$r.json $r <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
print(sys.argv[2], {k: d.get(k) for k in ("ratio_onboard_gbps_64k", "ratio_offload_gbps_64k",
      "ratio_onboard_gbps_16k", "ratio_offload_gbps_16k", "offload_ms_16k", "onboard_ms_16k")})
PY
  el "rows $r"
done
