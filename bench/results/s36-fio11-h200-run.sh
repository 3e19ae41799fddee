#!/bin/bash
# issue 17, fio11: the base tree against fio11's on the H200 host (< 4 min). First fio10's
# script, unchanged but for RT=3 (so that its 2 rounds x 2 trees of the four jobs and its
# fio_cpu.py base / head / head / base fit): `kvtier bench bench/jobs/randrw.fio --compare`
# through bench/fio_ab.py, each kvtier run with its own fio; its outputs renamed s36-fio11-*.
# Then fio11's own change, the service's C reader threads' hash (api/steps.py now passes
# reads.XXH3_READ): bench/fio_reader.py, the baseline and the dispatching XXH3 alternated,
# 4 rounds; and the reader threads' eventfd wake out of their mutex, base against head, 2 rounds.
# The in-process jobs do not use those threads: base and head should match there.
# fio must be on PATH. Both trees are built in place: BASE must be a copy of main's tree.
#   BASE=/path/to/base-copy HEAD=/path/to/fio11 bash bench/results/s36-fio11-h200-run.sh
set -u
H=${HEAD:-$PWD}; D=${DIR:-/tmp/x}; OUT=${OUT:-/tmp/out}; SITE=/tmp/site
export RT=${RT:-3} HEAD=$H DIR=$D OUT
bash $H/bench/results/s35-fio10-h200-run.sh
for f in $OUT/s35-fio10-h200-*; do [ -e "$f" ] && mv "$f" "${f/s35-fio10/s36-fio11}"; done
for r in 1 2 3 4; do for x in checksums read; do
  (cd $H && PYTHONPATH=$H:$SITE OPENBLAS_NUM_THREADS=1 timeout 20 python3 \
     $H/bench/fio_reader.py 2000 --dir $D --xxh3 $x) 2>&1 | tee -a $OUT/s36-fio11-h200-reader.jsonl
done; done
# The reader threads' wake out of the mutex (_reads.c): base against head, alternated.
B=${BASE:-$H/.gpu-base}
for r in 1 2; do for T in $B $H $H $B; do
  (cd $T && PYTHONPATH=$T:$SITE OPENBLAS_NUM_THREADS=1 timeout 20 python3 \
     $H/bench/fio_reader.py 2000 --dir $D) 2>&1 | tee -a $OUT/s36-fio11-h200-reader-ab.jsonl
done; done
echo "== done"; ls $OUT
