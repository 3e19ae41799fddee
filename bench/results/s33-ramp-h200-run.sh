#!/bin/bash
# Lead's fourth H200 call of session 33: a chunked get's first chunks (TransferPolicy.get_ramp)
# against the default first chunk of 256 keys, same process, two runs.
set -u
T0=$(date +%s); H=$PWD/.gpu-lead
el() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1
(cd $H && PYTHONPATH=/tmp/site python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3)
el built; cat /proc/loadavg
V=chunked_gets,ramp_64_256,ramp_32_128_512,ramp_128,ramp_64
for r in 1 2 3; do
  (cd $H && PYTHONPATH=/tmp/site:$H timeout 200 python3 bench/gpu.py --json --cases rows64k,rows16k --variants $V) > $OUT/gpu4-r$r.json 2> $OUT/gpu4-r$r.err
  python3 -c "
import json,sys;d=json.load(open(sys.argv[1]))
print({k: d.get(k) for k in ('ratio_onboard_gbps_64k','ratio_onboard_gbps_16k','pinned_h2d_gbps')})
for t in ('64k','16k'):
  for v,row in d.get('variants_'+t,{}).items(): print(t, v, row)" $OUT/gpu4-r$r.json
  el run$r
done
