#!/bin/bash
# issue 16's offload rows, svc12 (< 3 min): bench/gpu.py --json --cases rows64k,rows16k (no transfer
# policy variants, 5 repetitions, 45 s at most a run) on the base
# tree (main, in .gpu-base as in s36-b-run.sh) and on svc12's head, alternated: base, head,
# head+pack, then head+pack, head, base while time is left. head+pack is head with
# bench/put_control_hooks as sitecustomize and PUT_CONTROL_PACK_BUF=65536: measurement only,
# the service's protocol.pack with a 64 KiB Packer buffer, as bench/results/s36-svc12-pack.patch
# would make it (`kvtier serve` pins the mmap threshold at 128 KiB and msgpack's default 256 KiB
# buffer is mapped and unmapped on every reply). Then, on the host's CPU alone if time is left,
# bench/put_pairs.py: each put request's time in the service, base / head / head+pack.
#   BASE=.gpu-base bash bench/results/s36-svc12-h200-run.sh      (writes under $OUT)
set -u
T0=$(date +%s); el() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
H=$PWD; B=${BASE:-$PWD/.gpu-base}; OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; cat /proc/loadavg
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1
(PYTHONPATH=/tmp/site:$H python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
(cd $B && PYTHONPATH=/tmp/site:$B python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
wait; el setup
run() {   # $1 name, $2 tree, $3 extra PYTHONPATH (the hooks) or ""
  [ $(( $(date +%s) - T0 )) -lt ${4:-135} ] || { echo "$1 skipped"; return; }
  (cd $2 && PYTHONPATH=$3/tmp/site:$2 timeout 45 python3 bench/gpu.py --json --reps 5 \
      --cases rows64k,rows16k --variants "") > $OUT/gpu-$1.json 2> $OUT/gpu-$1-err.txt || tail -3 $OUT/gpu-$1-err.txt
  python3 - $OUT/gpu-$1.json $1 <<'PY' | tee -a $OUT/rows.txt
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
print(sys.argv[2], {k: d.get(k) for k in (
    "ratio_offload_gbps_64k", "ratio_offload_gbps_16k", "ratio_onboard_gbps_64k",
    "ratio_onboard_gbps_16k", "offload_ms_64k", "offload_ms_16k", "offload_commit_ms_64k",
    "offload_commit_ms_16k", "offload_reserve_ms_16k", "offload_ratio_16k_chunks_512",
    "offload_ratio_64k_chunks_256")})
PY
  el "$1"
}
HOOKS=$H/bench/put_control_hooks:
export PUT_CONTROL_PACK_BUF=0
run base-r1 $B ""; run head-r1 $H ""
PUT_CONTROL_PACK_BUF=65536 run pack-r1 $H $HOOKS
PUT_CONTROL_PACK_BUF=65536 run pack-r2 $H $HOOKS; run head-r2 $H ""; run base-r2 $B ""
if [ $(( $(date +%s) - T0 )) -lt 150 ]; then
  PYTHONPATH=/tmp/site:$H timeout 40 python3 bench/put_pairs.py --variant base=$B --variant head=$H \
      --variant head+pack=$H:65536 --rounds 2 --puts 30 --blocks 16384 --out $OUT/put-pairs.jsonl \
      > $OUT/put-pairs.txt 2> $OUT/put-pairs-err.txt; tail -4 $OUT/put-pairs-err.txt
fi
el done
