"""A fixed number of `kvtier bench` randrw calls in process, for instruction counts (issue 17):
callgrind's total for K calls minus its total for 0 calls is what K calls cost, steady on a
shared VM where wall and CPU time are not.

    valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.%p \\
        python bench/fio_calls.py K [--mix 50] [--size 32m] [--iodepth 16] [--dir DIR]

Each call is a get or a put of iodepth 64 KiB blocks on the NVMe tier (write_through), as
kvtier bench's worker issues them (kvtier.fio._Target), the picks from a fixed seed, so that
both trees run the same calls. Prints one JSON line: calls by kind.
"""
import argparse, json, shutil, sys, tempfile

import numpy as np

from kvtier import fio


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("calls", type=int)
    ap.add_argument("--mix", type=int, default=50)
    ap.add_argument("--size", default="32m")
    ap.add_argument("--iodepth", type=int, default=16)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    job = fio.apply_option(fio.Job(name="calls", rw="randrw", bs=65536, iodepth=a.iodepth,
                                   tier="nvme", direct=True, rwmixread=a.mix), "size", a.size)
    wd = tempfile.mkdtemp(dir=a.dir)
    tg = fio._Target(job.validate(), wd)
    try:
        tg.fill()
        rng = np.random.default_rng(100)
        out = fio.page_aligned(job.iodepth, job.bs)   # the lane's own get buffer (fio6)
        order = fio._order(job, tg.nblocks, rng, 1 << 16)
        done = {"get": 0, "put": 0}
        for c in range(a.calls):
            idx = order[(c * job.iodepth + np.arange(job.iodepth)) % order.size]
            if rng.random() * 100 >= job.rwmixread:
                tg.put(idx, owner=1)
                done["put"] += 1
            else:
                tg.get(idx, owner=1, out=out)
                done["get"] += 1
    finally:
        tg.close()
        shutil.rmtree(wd, ignore_errors=True)
    print(json.dumps(done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
