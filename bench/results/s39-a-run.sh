#!/bin/bash
# Session 39's device call: the mapped-read probe (kvtier.gpu.probe) in three processes,
# pytest -m gpu on the tree (sorted_gets = auto, the staged layers' late-placement test), then
# bench/gpu.py --json in full, and, time allowing, the 16 KiB rows again in a second process
# (default = auto, whole_gets = on, chunked_gets = off) and the layers case. Each part is
# skipped once its start would pass its END (seconds from the start).
set -u
T0=$(date +%s); el() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
left() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
H=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; cat /proc/loadavg
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1
PYTHONPATH=/tmp/site:$H python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3
el setup
for i in 1 2 3; do
  PYTHONPATH=/tmp/site:$H timeout 60 python3 -c "
from kvtier.gpu import probe, warm
warm(0); print(probe.results())" >> $OUT/probe.txt 2>&1
done
cat $OUT/probe.txt; el probe
PYTHONPATH=/tmp/site:$H timeout 230 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_gpu.py tests/test_gpu_plan.py tests/test_rev12_gpu.py --maxfail=8 > $OUT/pytest-gpu.txt 2>&1
tail -3 $OUT/pytest-gpu.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest-gpu.txt | head; el pytest
summary() {
  python3 - "$1" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
print({k: d.get(k) for k in ("onboard_ratio_2m", "offload_ratio_2m", "onboard_ratio_layers",
      "offload_ratio_layers", "ratio_onboard_gbps_64k", "ratio_onboard_gbps_16k", "ratio_offload_gbps_64k",
      "ratio_offload_gbps_16k", "matmul_ratio_beside_onboard", "onboard_ratio_beside_matmul",
      "layerwise_overlap", "single_cuda_get_p50_us", "hbm_onboard_ratio_2m", "mapped_read_probe",
      "methods_16k") if k in d})
for v in ("variants_16k",):
    for name in ("whole_gets", "chunked_gets"):
        if name in d.get(v, {}):
            print(v, name, d[v][name])
PY
}
if left 330; then
  PYTHONPATH=/tmp/site:$H timeout 170 python3 bench/gpu.py --json > $OUT/gpu-full.json 2>$OUT/gpu-full.err || tail -3 $OUT/gpu-full.err
  summary $OUT/gpu-full.json; el "gpu full"
fi
if left 500; then
  PYTHONPATH=/tmp/site:$H timeout 80 python3 bench/gpu.py --json --cases rows16k \
      --variants whole_gets,chunked_gets > $OUT/rows16k-r2.json 2>$OUT/rows16k-r2.err || tail -3 $OUT/rows16k-r2.err
  summary $OUT/rows16k-r2.json; el "rows16k r2"
fi
if left 540; then
  PYTHONPATH=/tmp/site:$H timeout 50 python3 bench/gpu.py --json --reps 5 --cases layers \
      > $OUT/layers-r2.json 2>$OUT/layers-r2.err || tail -3 $OUT/layers-r2.err
  python3 bench/results/s38-layers-summary.py $OUT/layers-r2.json; el "layers r2"
fi
