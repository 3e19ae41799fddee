#!/bin/bash
# lease13's device check (issue 16's small-page onboards; < 3 min on a 16-core H100 host):
# bench/gpu.py's 64 and 16 KiB rows with the chunked get (the default) and the sorted get
# (variant whole_gets: pieces of 1,024 keys in the service's slot order; sorted_2048: pieces of
# 2,048) in one process, 5 repetitions, on main (BASE) and on lease13's head (this tree),
# alternated base, head, head, base. Each run prints its four onboard ratios (chunked and
# sorted, 64 and 16 KiB) and the sorted get's piece-by-piece timeline (reply read, move
# enqueued, GPU start and end, ms from get_async's entry); then, if time is left, the GPU tests
# of the sorted get on head.
#   bash bench/results/s37-lease13-run.sh BASE      (BASE: main's tree; writes under $OUT)
# What lease13 changed is on the service's side only (kvtier/api/sortedgets.py, the order in
# one C call kvtier/coherence/_fast.c slot_order): each tree's C is built here first.
set -u
B=$(cd "${1:?usage: s37-lease13-run.sh BASE, the tree of main}" && pwd); H=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
left() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; cat /proc/loadavg
git -C "$B" log --oneline -1; git -C "$H" log --oneline -1
if ls .whl/*.whl >/dev/null 2>&1; then   # msgpack >= 1.1 and the like, as the lead's calls carry
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1
(PYTHONPATH=/tmp/site:$H python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
(cd "$B" && PYTHONPATH=/tmp/site:$B python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
wait
PYTHONPATH=/tmp/site:$H python3 -c "from kvtier.coherence import _fast; _fast.slot_order" \
    || echo "head's _fast has no slot_order: its numpy order runs"
el setup
V=whole_gets,sorted_2048
for r in base-r1 head-r1 head-r2 base-r2; do T=$B; case $r in head*) T=$H;; esac
  left ${ROWS_END:-120} || { echo "rows $r skipped"; continue; }
  (cd "$T" && PYTHONPATH=/tmp/site:$T timeout 40 python3 bench/gpu.py --json --reps 5 \
      --cases rows64k,rows16k --variants $V) > "$OUT/gpu-$r.json" 2> "$OUT/gpu-$r-err.txt" \
      || tail -3 "$OUT/gpu-$r-err.txt"
  python3 - "$OUT/gpu-$r.json" $r <<'PY' | tee -a "$OUT/rows.txt"
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
row = {"h2d": d.get("pinned_h2d_gbps")}
for t in ("64k", "16k"):
    v = d.get(f"variants_{t}", {})
    row[f"chunked_{t}"] = d.get(f"ratio_onboard_gbps_{t}")
    row[f"sorted_{t}"] = v.get("whole_gets", {}).get("onboard_ratio")
    row[f"sorted2048_{t}"] = v.get("sorted_2048", {}).get("onboard_ratio")
print(sys.argv[2], row)
for t in ("64k", "16k"):
    for k in ("", "_sorted"):
        tl = d.get(f"onboard_timeline_{t}{k}") or {}
        print(f"  {t} timeline{k or '_chunked'}: done {tl.get('done_ms')} busy "
              f"{tl.get('gpu_busy_ms')} idle {tl.get('gpu_idle_ms')} rows {tl.get('chunks')}")
PY
  el "$r"
done
if left ${PYTEST_END:-150}; then
  PYTHONPATH=/tmp/site:$H timeout 25 python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/test_gpu.py -k "whole or sorted or slot_order" > "$OUT/pytest-gpu-sorted.txt" 2>&1
  tail -3 "$OUT/pytest-gpu-sorted.txt"
fi
el done
