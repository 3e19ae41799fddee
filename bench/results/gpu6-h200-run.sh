#!/bin/bash
# issue 16's small-page rows, gpu6's one H200 call: main's tree (.gpu-gpu6-base) and the
# branch's (.gpu-gpu6) alternated twice on bench/gpu.py --json --cases rows64k,rows16k; then
# bench/get_control.py (no GPU: a chunked get's control path against a real kvtier serve, both
# sides timed) on this host's 16 cores, each tree; then pytest -m gpu of the GPU tests of the
# get paths. Every piece has its own timeout and writes under $OUT as it goes, so a cut-off
# call keeps what ran. LOCAL=1: a dry run on a machine without a GPU (the bench's cases and the
# GPU tests then fail or skip; the probe runs).
set -u
S=$PWD/.gpu-gpu6; B=$PWD/.gpu-gpu6-base
OUT=${OUT:-/tmp/gpu6-out}; mkdir -p $OUT
echo "== system"; date -u; nproc; cat /proc/loadavg; nvidia-smi -L 2>/dev/null
if [ -z "${LOCAL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site
  PY=python3
else
  PY=${PY:-python3}
fi
SITE=${PYTHONPATH:-}
(cd $S && PYTHONPATH=$SITE:$S $PY setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
(cd $B && PYTHONPATH=$SITE:$B $PY setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
wait
ls $S/kvtier/*.so $B/kvtier/*.so | wc -l
# The probe is the branch's; main's tree runs the same file (copied: it imports its own tree).
cp -r $S/bench/get_control.py $S/bench/get_control_hooks $B/bench/
bench() {   # bench NAME TREE
  echo "# $(date -u +%T) tree $1 load $(cut -d' ' -f1 /proc/loadavg)" | tee -a $OUT/gpu6-pairs-h200.txt
  (cd $2 && PYTHONUNBUFFERED=1 PYTHONPATH=$SITE:$2 timeout 80 $PY bench/gpu.py --json \
     --cases rows64k,rows16k > /tmp/b.json 2> /tmp/b.err)
  echo "rc $?" >> $OUT/gpu6-pairs-h200.txt
  cat /tmp/b.json >> $OUT/gpu6-pairs-h200.txt
  tail -5 /tmp/b.err
  $PY - /tmp/b.json <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as exc:
    print("no json:", exc); sys.exit()
keys = ["ratio_onboard_gbps_64k", "ratio_offload_gbps_64k", "ratio_onboard_gbps_16k",
        "ratio_offload_gbps_16k", "onboard_ms_16k", "onboard_control_ms_16k",
        "onboard_control_ms_64k", "onboard_control_ms_16k_chunk_4096"]
print({k: d.get(k) for k in keys})
for tag in ("16k", "64k"):
    t = d.get(f"onboard_timeline_{tag}") or {}
    print(tag, "timeline", [c[:2] for c in t.get("chunks", [])], "done", t.get("done_ms"))
    print(tag, "prepared", (d.get(f"variants_{tag}") or {}).get("prepared"))
PY
}
probe() {   # probe NAME TREE ARGS...
  local name=$1 tree=$2; shift 2
  echo "# $(date -u +%T) probe $name $* load $(cut -d' ' -f1 /proc/loadavg)" | tee -a $OUT/gpu6-control-h200.txt
  (cd $tree && PYTHONPATH=$SITE:$tree timeout 40 $PY bench/get_control.py --json "$@" > /tmp/p.json 2> /tmp/p.err)
  echo "rc $?" >> $OUT/gpu6-control-h200.txt
  cat /tmp/p.json >> $OUT/gpu6-control-h200.txt
  tail -3 /tmp/p.err
  $PY -c "
import json, sys
d = json.load(open('/tmp/p.json'))
print({k: v for k, v in d.items() if k.startswith(('client_unpack[', 'serve_dispatch[', 'serve_dr[0]', 'total', 'client_send[4]_at')) and not k.endswith('_ms]')})
" 2>&1 | tail -2
}
echo "== bench pairs $(date -u +%T)"
bench base $B; bench branch $S; bench base $B; bench branch $S
echo "== control probe $(date -u +%T)"
probe base $B --block 16384 --gets 40 --gap-ms 1.5
probe branch $S --block 16384 --gets 40 --gap-ms 1.5
probe branch-traced $S --block 16384 --gets 40 --gap-ms 1.5 --trace
probe branch-traced-nogap $S --block 16384 --gets 40 --trace
probe base $B --block 65536 --gets 20 --gap-ms 4.5
probe branch $S --block 65536 --gets 20 --gap-ms 4.5
echo "== pytest -m gpu $(date -u +%T)"
(cd $S && PYTHONPATH=$SITE:$S timeout 50 $PY -m pytest -q -p no:cacheprovider -m gpu \
   tests/test_gpu.py -k "chunked_get or async_get_holds or host_tier or pipelined or single_block or 64k_row" \
   > $OUT/gpu6-pytest-h200.txt 2>&1; echo "rc $?" >> $OUT/gpu6-pytest-h200.txt)
tail -3 $OUT/gpu6-pytest-h200.txt
date -u
