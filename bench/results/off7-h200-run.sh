#!/bin/bash
# off7's one H200 call (issue 16's offload rows): main's tree (.gpu-off7-base, git archive
# main) and the branch's (.gpu-off7) alternated base, head, head, base on bench/gpu.py --json
# --cases rows64k,rows16k --variants '' (the rows alone); then bench/put_control.py (the GPU
# put's control path against a real kvtier serve, copies simulated; no GPU) for each tree and
# traced on the branch; then bench/put_timeline.py (the real put, chunk by chunk, profiled, and
# other chunk cuts) for each tree; then pytest -m gpu tests/test_gpu*.py on the branch with
# what time is left. Every piece has its own timeout and writes under $OUT as it goes.
#   run: bash .gpu-off7/bench/results/off7-h200-run.sh   (carry .gpu-off7, .gpu-off7-base, .whl)
set -u
T0=$(date +%s); H=$PWD/.gpu-off7; B=$PWD/.gpu-off7-base
OUT=${OUT:-/tmp/off7-out}; mkdir -p $OUT
el() { echo "== $1 at $(( $(date +%s) - T0 )) s, load $(cut -d' ' -f1 /proc/loadavg)"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 SITE=/tmp/site
(cd $H && PYTHONPATH=$SITE python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
(cd $B && PYTHONPATH=$SITE python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
wait; ls $H/kvtier/*/*.so $B/kvtier/*/*.so | wc -l
cp $H/bench/put_control.py $H/bench/put_timeline.py $B/bench/     # the probes: the branch's
el built; nproc; nvidia-smi -L
py() { local t=$1 lim=$2; shift 2; (cd $t && PYTHONPATH=$SITE:$t timeout $lim python3 "$@"); }
pair() {   # pair NAME TREE
  echo "# $1 $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)" >> $OUT/off7-pairs-h200.txt
  py $2 60 bench/gpu.py --json --cases rows64k,rows16k --variants '' > /tmp/g.json 2>/tmp/g.err
  echo "rc $?" >> $OUT/off7-pairs-h200.txt; cat /tmp/g.json >> $OUT/off7-pairs-h200.txt
  tail -2 /tmp/g.err
  python3 - /tmp/g.json $1 <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as exc:
    sys.exit(f"{sys.argv[2]}: no json ({exc})")
ks = ["ratio_offload_gbps_64k", "ratio_offload_gbps_16k", "offload_ms_64k", "offload_ms_16k",
      "offload_reserve_ms_64k", "offload_copy_ms_64k", "offload_commit_ms_64k",
      "offload_reserve_ms_16k", "offload_copy_ms_16k", "offload_commit_ms_16k",
      "ratio_onboard_gbps_64k", "ratio_onboard_gbps_16k", "pinned_d2h_gbps"]
print(sys.argv[2], {k: d.get(k) for k in ks})
PY
}
pair base $B; pair head $H; pair head $H; pair base $B
el pairs
ctl() {   # ctl NAME TREE ARGS
  local name=$1 t=$2; shift 2
  echo "# $name $*" >> $OUT/off7-control-h200.txt
  py $t 30 bench/put_control.py --json "$@" >> $OUT/off7-control-h200.txt 2>/dev/null
  tail -1 $OUT/off7-control-h200.txt | python3 -c "
import json, sys
d = json.loads(sys.stdin.read()); print('$name', {k: v for k, v in d.items() if k != 'machine'})" 2>&1 | cut -c1-900
}
ctl base $B --block 16384; ctl head $H --block 16384; ctl head-traced $H --block 16384 --trace
ctl base-nocopy $B --block 16384 --copy-gbps 0; ctl head-nocopy $H --block 16384 --copy-gbps 0
el control
for t in head base; do T=$H; [ $t = base ] && T=$B
  py $T 45 bench/put_timeline.py --json > $OUT/off7-timeline-$t-h200.json 2>/tmp/t.err
  tail -2 /tmp/t.err
  python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
for tag in ('16k', '64k'):
    print(sys.argv[2], tag, d.get('put_ms_' + tag), d.get('variants_' + tag))
    tl = d.get('timeline_' + tag) or {}
    print('  ', {k: v for k, v in tl.items()})
    print('  ', (d.get('profile_' + tag) or [])[:6])" $OUT/off7-timeline-$t-h200.json $t 2>&1 | cut -c1-1500
done
el timeline
left=$(( 175 - ($(date +%s) - T0) )); [ $left -lt 20 ] && left=20
(cd $H && PYTHONPATH=$SITE:$H timeout $left python3 -m pytest -q -p no:cacheprovider -m gpu \
   tests/test_gpu*.py > $OUT/off7-pytest-gpu-h200.txt 2>&1; echo "rc $? (timeout $left s)" >> $OUT/off7-pytest-gpu-h200.txt)
tail -3 $OUT/off7-pytest-gpu-h200.txt
el done
# Ran once, 2026-12-04 20:06-20:10 UTC, with timeout_s 200: the pairs, the control probes and
# the branch's timeline came back; the call was cut during the base tree's timeline (its JSON
# is empty, not committed), so pytest -m gpu was not reached.
