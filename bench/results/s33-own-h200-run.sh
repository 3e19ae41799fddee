#!/bin/bash
# The lead's last H200 call of session 33: the deferral fix (head) against main just before it
# (base), rows64k/rows16k alternated twice, then pytest -m gpu of test_gpu.py on the head.
set -u
T0=$(date +%s); H=$PWD/.gpu-head; B=$PWD/.gpu-base
el() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1
(cd $H && PYTHONPATH=/tmp/site python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
(cd $B && PYTHONPATH=/tmp/site python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
wait; el built
py() { local t=$1; shift; (cd $t && PYTHONPATH=/tmp/site:$t python3 "$@"); }
for p in "base-r1 $B" "head-r1 $H" "head-r2 $H" "base-r2 $B"; do set -- $p
  py $2 bench/gpu.py --json --cases rows64k,rows16k --variants= > $OUT/gpu-$1.json 2>/dev/null
  python3 -c "import json,sys;d=json.load(open(sys.argv[2]));print(sys.argv[1], {k: d.get(k) for k in ('ratio_onboard_gbps_64k','ratio_offload_gbps_64k','ratio_onboard_gbps_16k','ratio_offload_gbps_16k','onboard_timeline_64k')})" $1 $OUT/gpu-$1.json | cut -c1-400
done
el pairs
timeout 130 bash -c "cd $H && PYTHONPATH=/tmp/site:$H python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py" > $OUT/pytest-gpu.txt 2>&1; tail -2 $OUT/pytest-gpu.txt
el pytest
