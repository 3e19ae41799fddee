"""The service's C reader threads (kvtier/tiers/_reads.c's Reader, api/steps.py's ReadThreads)
in isolation (issue 17, fio11): CONCURRENT batches of 16 x 64 KiB NVMe records in flight on 4
threads, reaped through the eventfd as the service's loop reaps them (poll, then reap).

    PYTHONPATH=TREE python bench/fio_reader.py [BATCHES] [--concurrent 4] [--dir DIR]

Prints one JSON line: wall and process CPU per batch (the threads' and the reaping loop's),
and reaps (eventfd wakes) per batch.
"""
from __future__ import annotations

import argparse
import json
import mmap
import select
import shutil
import sys
import tempfile
import time

import numpy as np

from kvtier.checksums import block_checksums
from kvtier.tiers import reads
from kvtier.tiers.nvme import SegmentLog

BB = 65536


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("batches", type=int, nargs="?", default=2000)
    ap.add_argument("--concurrent", type=int, default=4)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--xxh3", choices=("read", "checksums"), default="read",
                    help="the threads' hash: reads.XXH3_READ (the service's since fio11) or "
                    "checksums' baseline XXH3_64bits (before)")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="fio-reader-", dir=a.dir)
    log = SegmentLog(work, 1, BB, 64 << 20)
    n = 256
    data = np.random.default_rng(1).integers(0, 256, (n, BB), dtype=np.uint8)
    segs, offs = (np.asarray(x) for x in log.append(data))
    sums = block_checksums(data)
    conc = a.concurrent
    pool = np.frombuffer(mmap.mmap(-1, conc * 16 * BB), dtype=np.uint8).reshape(-1, BB)
    held = log.pin(segs)
    fn = (getattr(reads, "XXH3_READ", None) if a.xxh3 == "read" else None) or reads.checksums._fn
    r = reads.native.Reader(4, 128, fn)
    rng = np.random.default_rng(2)
    picks = [rng.choice(n, 16, replace=False) for _ in range(64)]
    batches = [reads.record_batch(log, pool, np.arange(c * 16, c * 16 + 16),
                                  segs[picks[c]], offs[picks[c]], sums[picks[c]], held)
               for c in range(conc)]
    poll = select.poll()
    poll.register(r.fd, select.POLLIN)
    done = reaps = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for c, b in enumerate(batches):
        r.submit(b, c)
    submitted = conc
    while done < a.batches:
        poll.poll(10_000)
        got = r.reap()
        reaps += 1
        for c, err in got:
            assert err == 0
            done += 1
            if submitted < a.batches:
                r.submit(batches[c], c)
                submitted += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    r.close()
    log.unpin(held)
    log.close()
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"tree": reads.__file__.rsplit("/kvtier/", 1)[0], "xxh3": a.xxh3,
                      "batches": done,
                      "wall_ms": round(1e3 * wall / done, 4),
                      "cpu_ms": round(1e3 * cpu / done, 4),
                      "reaps_per_batch": round(reaps / done, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
