#!/bin/bash
# Session 37's first device call: main b3d888e (session 36's merges: stall11, svc12 and the
# Packer's 64 KiB buffer, none of them measured on a GPU yet) against a4b2bba (.gpu-base: main
# before stall11 and svc12). 1. bench/stall.py, base and head alternated three rounds (issue
# 17's stall line); 2. pytest -m gpu on head; 3. bench/gpu.py's 64 / 16 KiB rows, base, head,
# head, base (issue 16's offload and onboard rows); 4. bench/gpu.py --json in full on head,
# twice (all 13 fields). Each part is skipped once its start would pass its END (seconds from
# the start); every result lands under $OUT as it is made.
set -u
T0=$(date +%s); el() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
left() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
H=$PWD; B=$PWD/.gpu-base
STALL_END=${STALL_END:-150} PYTEST_END=${PYTEST_END:-250} ROWS_END=${ROWS_END:-360} \
  PYTEST_S=${PYTEST_S:-120} bash bench/results/s36-c-run.sh
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1
for r in full-r1 full-r2; do
  left $(( ${FULL_END:-480} - 30 )) || { echo "gpu $r skipped"; continue; }
  PYTHONPATH=/tmp/site:$H timeout 130 python3 bench/gpu.py --json > $OUT/gpu-$r.json 2>/tmp/f.err || tail -3 /tmp/f.err
  python3 - $OUT/gpu-$r.json $r <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
print(sys.argv[2], {k: d.get(k) for k in ("onboard_ratio_2m", "offload_ratio_2m", "onboard_ratio_layers",
      "offload_ratio_layers", "ratio_onboard_gbps_64k", "ratio_onboard_gbps_16k", "ratio_offload_gbps_64k",
      "ratio_offload_gbps_16k", "matmul_ratio_beside_onboard", "onboard_ratio_beside_matmul",
      "layerwise_overlap", "single_cuda_get_p50_us", "hbm_onboard_ratio_2m")})
PY
  el "gpu $r"
done
