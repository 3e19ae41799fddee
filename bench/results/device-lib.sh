# Shared steps of the session device scripts from session 40 on (source it from the tree's
# root on the device): elapsed-time marks, the wheels installed into /tmp/site, the C
# extensions built in place (in each tree named, in parallel), and a summary of a
# bench/gpu.py --json output. The older s3x scripts repeat these steps inline.
T0=$(date +%s)
el() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
left() { [ $(( $(date +%s) - T0 )) -lt "$1" ]; }
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1

setup_trees() {     # setup_trees TREE...: the wheels once, each tree's extensions in place
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; cat /proc/loadavg
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl 2>&1 | tail -2
  for t in "$@"; do
    (cd "$t" && PYTHONPATH=/tmp/site:$t python3 setup.py -q build_ext --inplace 2>&1 \
        | grep -i error | tail -3) &
  done
  wait
  el setup
}

gpu_summary() {     # gpu_summary FILE [LABEL]: the issue's fields of a bench/gpu.py --json run
  python3 - "$1" "${2:-}" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.find("{"):]) if "{" in text else {}
print(sys.argv[2], {k: d.get(k) for k in (
    "onboard_ratio_2m", "offload_ratio_2m", "onboard_ratio_layers", "offload_ratio_layers",
    "ratio_onboard_gbps_64k", "ratio_onboard_gbps_16k", "ratio_offload_gbps_64k",
    "ratio_offload_gbps_16k", "matmul_ratio_beside_onboard", "onboard_ratio_beside_matmul",
    "layerwise_overlap", "single_cuda_get_p50_us", "small_cuda_get_p50_us",
    "small_host_get_p50_us", "hbm_onboard_ratio_2m", "mapped_read_probe", "methods_16k")
    if k in d})
for name in ("whole_gets", "chunked_gets"):
    if name in d.get("variants_16k", {}):
        print("variants_16k", name, d["variants_16k"][name])
PY
}
