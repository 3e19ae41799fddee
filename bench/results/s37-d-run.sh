#!/bin/bash
# Session 37's last device call: main after the session's merges and the lead's GPU changes
# (busy_poll_us auto, a chunked get's requests before its device side, the put's hash after its
# first copies) against b3d888e (.gpu-base: main at the session's start).
# 1. pytest -m gpu on head (test_gpu.py, test_gpu_plan.py, test_rev12_gpu.py);
# 2. bench/gpu.py's 64 / 16 KiB rows, base, head, head, base;
# 3. bench/stall.py, base, head and head without stall12's room split (.gpu-nosplit) alternated
#    three rounds;
# 4. bench/gpu.py --json in full on head, once (before 3 with FULL_FIRST); then EXTRA (a
#    command) if set. STALL_RUNS: the stall runs, in order.
# Each part is skipped once its start would pass its END (seconds from the start).
set -u
T0=$(date +%s); el() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
left() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
H=$PWD; B=$PWD/.gpu-base
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; cat /proc/loadavg
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1
(PYTHONPATH=/tmp/site:$H python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
(cd $B && PYTHONPATH=/tmp/site:$B python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
(cd $PWD/.gpu-nosplit && PYTHONPATH=/tmp/site:$PWD python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
wait; ls $H/kvtier/*/*.so $B/kvtier/*/*.so | wc -l; el setup
PYTHONPATH=/tmp/site:$H timeout ${PYTEST_S:-150} python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_gpu.py tests/test_gpu_plan.py tests/test_rev12_gpu.py --maxfail=5 > $OUT/pytest-gpu.txt 2>&1
tail -3 $OUT/pytest-gpu.txt; el pytest
for r in base-r1 head-r1 head-r2 base-r2; do T=$B; case $r in head*) T=$H;; esac
  left ${ROWS_END:-300} || { echo "rows $r skipped"; continue; }
  (cd $T && PYTHONPATH=/tmp/site:$T timeout 40 python3 bench/gpu.py --json --reps 7 \
      --cases rows64k,rows16k --variants "") > /tmp/g.json 2> /tmp/g.err || tail -3 /tmp/g.err
  python3 - /tmp/g.json $r $OUT/rows.jsonl <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
d["run"] = sys.argv[2]
open(sys.argv[3], "a").write(json.dumps(d) + "\n")
print(sys.argv[2], {k: d.get(k) for k in ("ratio_onboard_gbps_64k", "ratio_offload_gbps_64k",
      "ratio_onboard_gbps_16k", "ratio_offload_gbps_16k")})
PY
  el "rows $r"
done
stall() {
N=$PWD/.gpu-nosplit     # head with stall12's room split out of reach (ROOM_SPLIT_MIN)
for r in ${STALL_RUNS:-base-r1 head-r1 nosplit-r1 nosplit-r2 head-r2 base-r2 base-r3 head-r3 nosplit-r3}; do
  T=$B; case $r in head*) T=$H;; nosplit*) T=$N;; esac
  left ${STALL_END:-400} || { echo "stall $r skipped"; continue; }
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
}
full() {
if left ${FULL_END:-460}; then
  PYTHONPATH=/tmp/site:$H timeout 100 python3 bench/gpu.py --json > $OUT/gpu-full.json 2>/tmp/f.err || tail -3 /tmp/f.err
  python3 - $OUT/gpu-full.json <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
print({k: d.get(k) for k in ("onboard_ratio_2m", "offload_ratio_2m", "onboard_ratio_layers",
      "offload_ratio_layers", "ratio_onboard_gbps_64k", "ratio_onboard_gbps_16k", "ratio_offload_gbps_64k",
      "ratio_offload_gbps_16k", "matmul_ratio_beside_onboard", "onboard_ratio_beside_matmul",
      "layerwise_overlap", "single_cuda_get_p50_us", "hbm_onboard_ratio_2m")})
PY
  el "gpu full"
fi
}
if [ -n "${FULL_FIRST:-}" ]; then full; stall; else stall; full; fi
[ -n "${EXTRA:-}" ] && left ${EXTRA_END:-500} && { bash -c "$EXTRA"; el extra; }
