#!/bin/bash
# The lead's final H200 call of session 33: the merged head (.gpu-head) against the session's
# base main 04ea8db (.gpu-base), alternated where paired. Usage: bash .gpu-head/final.sh
set -u
T0=$(date +%s); H=$PWD/.gpu-head; B=$PWD/.gpu-base
el() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1
(cd $H && PYTHONPATH=/tmp/site python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
(cd $B && PYTHONPATH=/tmp/site python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
wait; ls $H/kvtier/*/*.so $B/kvtier/*/*.so | wc -l
el built; nproc; cat /proc/loadavg
py() { local t=$1; shift; (cd $t && PYTHONPATH=/tmp/site:$t python3 "$@"); }
stall() { py $1 bench/stall.py --json > $OUT/stall-$2.json 2>/dev/null; python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print(sys.argv[2], d['worst_p99_ratio'], [(r, c['alone_p99_us'], c['beside_p99_us'], c['p99_ratio']) for r, c in d['conditions'].items()])" $OUT/stall-$2.json $2 | tee -a $OUT/stall-pairs.txt; }
stall $B base-r1; stall $H head-r1; stall $H head-r2; stall $B base-r2; stall $B base-r3; stall $H head-r3
el stall
for r in 1 2; do for t in base head; do T=$B; V=""; [ $t = head ] && T=$H && V="--variants="
  py $T bench/gpu.py --json --cases rows64k,rows16k $V > /tmp/g.json 2>/dev/null
  python3 -c "import json,sys;d=json.load(open('/tmp/g.json'));print(sys.argv[1], {k: d.get(k) for k in ('ratio_onboard_gbps_64k','ratio_offload_gbps_64k','ratio_onboard_gbps_16k','ratio_offload_gbps_16k','pinned_h2d_gbps','pinned_d2h_gbps')})" $t-r$r | tee -a $OUT/gpu-pairs.txt
done; done
el pairs
timeout 200 bash -c "cd $H && PYTHONPATH=/tmp/site:$H python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu*.py" > $OUT/pytest-gpu.txt 2>&1; tail -2 $OUT/pytest-gpu.txt
el pytest
timeout 150 bash -c "cd $H && PYTHONPATH=/tmp/site:$H python3 bench/gpu.py --json" > $OUT/gpu.json 2>/dev/null
python3 -c "
import json,sys;d=json.load(open(sys.argv[1]))
for k in ('onboard_ratio_2m','offload_ratio_2m','onboard_ratio_layers','offload_ratio_layers','ratio_onboard_gbps_64k','ratio_offload_gbps_64k','ratio_onboard_gbps_16k','ratio_offload_gbps_16k','matmul_ratio_beside_onboard','onboard_ratio_beside_matmul','matmul_ratio_beside_onboard_64k','onboard_ratio_beside_matmul_64k','layerwise_overlap','single_cuda_get_p50_us','hbm_onboard_ratio_2m'): print(k, d.get(k))" $OUT/gpu.json
el gpu
for r in 1 2; do for t in conversation_first_half synthetic_trace; do
  echo "# round $r trace $t" >> $OUT/replay-cpu.txt
  (cd $H && OPENBLAS_NUM_THREADS=1 PYTHONPATH=/tmp/site:$H timeout 60 python3 -m kvtier.cli replay traces/mooncake_$t.jsonl --capacity 1e6 --policy lru,chain --metadata-only --json --no-progress) >> $OUT/replay-cpu.txt 2>&1
done; done
python3 -c "
import json,sys
for line in open(sys.argv[1]):
    if line.startswith('{'):
        d=json.loads(line); print(d['trace'].split('/')[-1][:20], [(r['policy'], r['hits'], r['cpu_s_per_million_accesses']) for r in d['results']])" $OUT/replay-cpu.txt
el replay
