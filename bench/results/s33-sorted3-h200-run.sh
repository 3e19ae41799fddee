#!/bin/bash
# Lead's third H200 call of session 33: sorted gets with piece 0 in key order (the rest
# ordered at piece 1), against chunked gets, same process; two runs; timelines.
set -u
T0=$(date +%s); H=$PWD/.gpu-lead
el() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1
(cd $H && PYTHONPATH=/tmp/site python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3)
el built; cat /proc/loadavg
V=whole_gets,chunked_gets,sorted_64m,sorted_512,sorted_2048,sorted_2048_64m
for r in 1 2; do
  (cd $H && PYTHONPATH=/tmp/site:$H timeout 200 python3 bench/gpu.py --json --cases rows64k,rows16k --variants $V) > $OUT/gpu3-r$r.json 2> $OUT/gpu3-r$r.err
  python3 -c "
import json,sys;d=json.load(open(sys.argv[1]))
print({k: d.get(k) for k in ('ratio_onboard_gbps_64k','ratio_onboard_gbps_16k','pinned_h2d_gbps')})
for t in ('64k','16k'):
  for v,row in d.get('variants_'+t,{}).items(): print(t, v, row)
  for k in ('', '_sorted', '_sorted_64m'):
    print(t, 'timeline'+k, d.get('onboard_timeline_'+t+k))" $OUT/gpu3-r$r.json
  el run$r
done
timeout 100 bash -c "cd $H && PYTHONPATH=/tmp/site:$H python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k 'slot_order or sparse_whole'" > $OUT/pytest-gpu3.txt 2>&1; tail -3 $OUT/pytest-gpu3.txt
