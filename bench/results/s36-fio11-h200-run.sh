#!/bin/bash
# issue 17, fio11: the base tree against fio11's on the H200 host (< 4 min), each kvtier run
# paired with its own fio run: `kvtier bench bench/jobs/randrw.fio --compare` through
# bench/fio_ab.py, the trees alternated (round 1 base then head, round 2 head then base), the
# four jobs at runtime=$RT (10 in the job file; 3 here so that 2 rounds x 2 trees fit); then in
# process, bench/fio_cpu.py's thread CPU per get and per put, base / head / head / base; then
# fio11's own change, the service's C reader threads' hash (api/steps.py now passes
# reads.XXH3_READ): bench/fio_reader.py with the baseline and the dispatching XXH3 alternated,
# 4 rounds (the in-process jobs above do not use those threads: base and head should match).
# fio must be on PATH (the lead carries it). Every result lands under $OUT as it is made.
#   BASE=/path/to/base HEAD=/path/to/fio11 bash bench/results/s36-fio11-h200-run.sh
# (defaults: HEAD the current directory, BASE $PWD/.gpu-base; LOCAL=1 skips the wheels)
set -u
T0=$(date +%s); H=${HEAD:-$PWD}; B=${BASE:-$PWD/.gpu-base}
RT=${RT:-3}; ROUNDS=${ROUNDS:-2}; K=${K:-400}; D=${DIR:-/tmp/x}; OUT=${OUT:-/tmp/out}
el() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
mkdir -p $D $OUT
echo "head $H base $B"; date -u; nproc; uname -r; python3 --version; df -T $D | tail -1
cat /proc/loadavg; fio --version || { echo "no fio on PATH"; exit 2; }
if [ -z "${LOCAL:-}" ] && ls $H/.whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $H/.whl/*.whl 2>&1 | tail -2
fi
SITE=/tmp/site; export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1
(cd $H && PYTHONPATH=$SITE python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
(cd $B && PYTHONPATH=$SITE python3 setup.py -q build_ext --inplace 2>&1 | grep -i error | tail -3) &
wait; ls $H/kvtier/*/*.so $B/kvtier/*/*.so | wc -l
(cd $H && PYTHONPATH=$H:$SITE python3 -c 'import kvtier.checksums as c, kvtier.tiers.reads as r
print("C read:", r.available(), "xxh3 dispatching:", r.XXH3_READ != c._fn)')
el built
sed 's/^runtime=.*/runtime='"$RT"'/' $H/bench/jobs/randrw.fio > /tmp/randrw-$RT.fio
FIO_AB_SITE=$SITE timeout 170 python3 $H/bench/fio_ab.py $B $H $ROUNDS /tmp/randrw-$RT.fio $D \
  > $OUT/s36-fio11-h200-ab.json 2> $OUT/s36-fio11-h200-ab.txt
echo "fio_ab rc $?"; cat $OUT/s36-fio11-h200-ab.txt
el paired
for t in base head head base; do T=$B; [ $t = head ] && T=$H
  (cd $T && PYTHONPATH=$T:$SITE timeout 30 python3 $H/bench/fio_cpu.py $K --dir $D --size 64m) \
    > /tmp/c.json 2> /tmp/c.err
  echo "{\"tree\": \"$t\", \"cpu\": $(cat /tmp/c.json 2>/dev/null || echo null)}" \
    | tee -a $OUT/s36-fio11-h200-cpu.jsonl
  [ -s /tmp/c.err ] && tail -3 /tmp/c.err
done
el cpu
for r in 1 2 3 4; do for x in checksums read; do
  (cd $H && PYTHONPATH=$H:$SITE timeout 20 python3 $H/bench/fio_reader.py 2000 --dir $D --xxh3 $x) \
    2>&1 | tee -a $OUT/s36-fio11-h200-reader.jsonl
done; done
el done
