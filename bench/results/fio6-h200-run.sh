#!/bin/bash
# issue 17, fio6: main against the branch on the H200 host, each kvtier run paired with its own
# fio run (kvtier bench --compare), the four jobs of bench/jobs/randrw.fio at runtime=$RT (10
# in the job file; 6 here to fit 8 paired runs and the in-process ones in one call of 280 s),
# the trees' order alternated per job; then, in process, bench/fio_cpu.py (a lane's thread CPU
# per get and per put, the C I/O taken apart) for both trees, and the branch at calls=2.
# fio 3.33 and libxxhash carried from the dev VM (fio6-bin.tar.xz: /usr/bin/fio and the shared
# libraries ldd names less glibc's, rebuilt as fio4 did, not in the repo).
# Every run appends one JSON line to $OUT/fio6-h200-runs.jsonl, so a cut-off call keeps what ran.
set -u
S=$PWD/.gpu-fio6; B=$PWD/.gpu-fio6-base
echo "== system"; date -u; nproc; uname -r; python3 --version; df -T /tmp | tail -1; cat /proc/loadavg
if [ -z "${LOCAL:-}" ]; then      # LOCAL=1: a dry run here, with this machine's fio and packages
mkdir -p /tmp/fiobin && tar xJf $S/fio-bin/fio6-bin.tar.xz -C /tmp/fiobin
printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/fiobin/fio6-libs exec /tmp/fiobin/fio6-libs/fio.real "$@"\n' > /tmp/fiobin/fio; chmod +x /tmp/fiobin/fio
export PATH=/tmp/fiobin:$PATH
fio --version
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/lmdb*.whl 2>&1 | tail -2
if ! python3 -c 'import ctypes.util, sys; sys.exit(0 if ctypes.util.find_library("xxhash") else 1)'; then
  cp /tmp/fiobin/fio6-libs/libxxhash.so.0 /usr/local/lib/ && ldconfig; echo "libxxhash: carried"
fi
fi
(cd $S && PYTHONPATH=/tmp/site:$S python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
(cd $B && PYTHONPATH=/tmp/site:$B python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
wait
ls $S/kvtier/*/*.so $B/kvtier/*/*.so | wc -l
(cd $S && PYTHONPATH=/tmp/site:$S python3 -c 'import kvtier.checksums as c, kvtier.tiers.reads as r; print("C read:", r.available(), "xxh3:", c._fn is not None)')
D=/tmp/x; mkdir -p $D /tmp/jobs; echo "directory $D: $(stat -f -c %T $D)"
RT=${RT:-6}; RT2=${RT2:-4}; K=${K:-600}     # runtime= of the paired and the in-process runs
python3 - $S/bench/jobs/randrw.fio $RT $RT2 <<'PY'
import sys, configparser
cp = configparser.ConfigParser(allow_no_value=True, interpolation=None, strict=False, default_section="__none__")
cp.read_string(open(sys.argv[1]).read())
g = dict(cp.items("global"))
for name in [s for s in cp.sections() if s != "global"]:
    for rt in sorted(set(sys.argv[2:])):
        opts = dict(g, runtime=str(rt), **dict(cp.items(name)))
        with open(f"/tmp/jobs/{name}-{rt}.fio", "w") as fh:
            fh.write(f"[{name}]\n" + "".join(f"{k}\n" if v is None else f"{k}={v}\n" for k, v in opts.items()))
PY
run() {   # run NAME TREE JOB RUNTIME EXTRA...
  local name=$1 tree=$2 job=$3 rt=$4; shift 4
  local t0=$(date +%s.%N) load=$(cut -d' ' -f1 /proc/loadavg)
  (cd $tree && PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$tree timeout 45 python3 -m kvtier.fio /tmp/jobs/$job-$rt.fio --directory $D --output-format json "$@" > /tmp/r.json 2> /tmp/r.err)
  local rc=$?
  python3 - "$name" "$job" "$t0" "$load" "$rc" "$*" <<'PY' >> $OUT/fio6-h200-runs.jsonl
import json, sys
name, job, t0, load, rc, extra = sys.argv[1:]
try:
    res = json.load(open("/tmp/r.json"))
except Exception as exc:
    res = {"error": repr(exc), "stderr": open("/tmp/r.err").read()[-2000:]}
print(json.dumps({"tree": name, "job": job, "start": float(t0), "load": float(load), "rc": int(rc), "args": extra, "result": res}))
PY
  python3 - <<'PY' $OUT/fio6-h200-runs.jsonl
import json, sys
r = json.loads(open(sys.argv[1]).read().splitlines()[-1])
for j in r["result"].get("jobs", []):
    b = (j["kvtier"].get("baseline") or {}).get("result") or {}
    print(f"{r['tree']:7} {r['job']:13} {r['args']:12} kvtier {j['read']['bw_bytes']/2**20:6.1f} / {j['write']['bw_bytes']/2**20:6.1f}",
          f"fio {b.get('read',{}).get('bw_bytes',0)/2**20:6.1f} / {b.get('write',{}).get('bw_bytes',0)/2**20:6.1f}",
          f"ratio {j['kvtier'].get('ratio_read')} / {j['kvtier'].get('ratio_write')} clat ms {j['read']['clat_ns']['mean']/1e6:.2f} / {j['write']['clat_ns']['mean']/1e6:.2f}",
          f"cpu {j['kvtier'].get('cpu_s')} load {r['load']}", flush=True)
if not r["result"].get("jobs"):
    print(r["tree"], r["job"], "rc", r["rc"], str(r["result"])[-600:])
PY
}
cpu() {   # cpu NAME TREE: bench/fio_cpu.py (from the branch's tree) run on TREE's kvtier
  (cd $2 && PYTHONPATH=/tmp/site:$2 timeout 60 python3 $S/bench/fio_cpu.py $K --dir $D > /tmp/c.json 2> /tmp/c.err)
  echo "{\"tree\": \"$1\", \"rc\": $?, \"cpu\": $(cat /tmp/c.json 2>/dev/null || echo null)}" | tee -a $OUT/fio6-h200-cpu.jsonl
  [ -s /tmp/c.err ] && tail -3 /tmp/c.err
}
echo "== paired with fio $(date -u +%T)"
i=0
for j in rw70-zipf rw50-uniform rw70-uniform rw50-zipf; do
  if [ $((i % 2)) = 0 ]; then run main $B $j $RT --compare; run branch $S $j $RT --compare
  else run branch $S $j $RT --compare; run main $B $j $RT --compare; fi
  i=$((i + 1))
done
echo "== a lane's CPU per call, in process $(date -u +%T)"
cpu main $B; cpu branch $S; cpu main $B; cpu branch $S
echo "== in process, the branch at calls=2 $(date -u +%T)"
for j in rw50-uniform rw70-zipf; do run k2 $S $j $RT2 --calls 2; done
date -u
