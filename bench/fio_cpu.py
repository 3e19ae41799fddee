"""Thread CPU of one `kvtier bench` lane's calls, by kind (issue 17, fio6): gets of iodepth NVMe
blocks and puts of iodepth, in process, one after the other as the lane issues them (kvtier.
fio._Target), with the thread CPU of the C I/O inside them (the AIO loop of a put's writes, the
C read of a get, fdatasync) taken apart; the rest is the Python steps' and numpy's.

    PYTHONPATH=TREE python bench/fio_cpu.py [CALLS] [--dir DIR] [--size 64m] [--mix 50]

Prints one JSON line: per kind, calls, wall and thread CPU ms a call, and the pieces'. The picks
come from a fixed seed, so two trees run the same calls.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from kvtier import fio
import kvtier.coherence.gets as gets_mod
import kvtier.tiers.aio as aio_mod

# This script's own bench/common.py (its directory is sys.path[0]), whatever tree PYTHONPATH
# names for kvtier: a base tree's bench/ may predate it.
from common import wrap_thread_cpu  # noqa: E402

SPENT: dict[str, float] = collections.defaultdict(float)


def timed(owner, name: str, label: str) -> None:
    """Wrap owner.name so that its thread CPU adds to SPENT[label]."""
    wrap_thread_cpu(owner, name, label, SPENT)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("calls", type=int, nargs="?", default=600)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--size", default="64m")
    ap.add_argument("--mix", type=int, default=50)
    ap.add_argument("--iodepth", type=int, default=16)
    a = ap.parse_args()
    for name in ("run", "write_run"):          # the C AIO loop (write_run: fio10's)
        if hasattr(aio_mod._native, name):
            timed(aio_mod._native, name, "aio_c")
    if hasattr(gets_mod, "run_batch"):         # the get's C read, as gets.py calls it
        timed(gets_mod, "run_batch", "read_c")
    timed(os, "fdatasync", "fdatasync")
    job = fio.apply_option(fio.Job(name="cpu", rw="randrw", bs=65536, iodepth=a.iodepth,
                                   tier="nvme", direct=True, rwmixread=a.mix), "size", a.size)
    wd = tempfile.mkdtemp(dir=a.dir)
    tg = fio._Target(job.validate(), wd)
    tot = {"get": [0, 0.0, 0.0], "put": [0, 0.0, 0.0]}
    per: dict[str, dict[str, float]] = {"get": collections.defaultdict(float),
                                        "put": collections.defaultdict(float)}
    try:
        tg.fill()
        rng = np.random.default_rng(100)
        out = fio.page_aligned(job.iodepth, job.bs)   # the lane's own get buffer (fio6)
        order = fio._order(job, tg.nblocks, rng, 1 << 16)
        for c in range(a.calls):
            idx = order[(c * job.iodepth + np.arange(job.iodepth)) % order.size]
            kind = "put" if rng.random() * 100 >= job.rwmixread else "get"
            SPENT.clear()
            t, w = time.thread_time(), time.perf_counter()
            if kind == "put":
                tg.put(idx, owner=1)
            else:
                tg.get(idx, owner=1, out=out)
            tot[kind][1] += time.thread_time() - t
            tot[kind][2] += time.perf_counter() - w
            tot[kind][0] += 1
            for k, v in SPENT.items():
                per[kind][k] += v
    finally:
        tg.close()
        shutil.rmtree(wd, ignore_errors=True)
    res: dict[str, object] = {"load": round(os.getloadavg()[0], 2)}
    for kind, (n, cpu, wall) in tot.items():
        if not n:
            continue
        d = {k: round(1e3 * v / n, 3) for k, v in per[kind].items()}
        d["cpu_ms"], d["wall_ms"] = round(1e3 * cpu / n, 3), round(1e3 * wall / n, 3)
        d["rest_ms"] = round(d["cpu_ms"] - sum(per[kind].values()) * 1e3 / n, 3)
        d["calls"] = n
        res[kind] = d
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
