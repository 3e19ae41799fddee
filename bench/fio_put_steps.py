"""Thread CPU of a `kvtier bench` lane's puts (or, --kind get, gets) by step (issue 17, fio7;
gets fio10): each step's time is inclusive (a step's inner steps are in it too), per call of
that kind, in process (kvtier.fio._Target, the NVMe tier, write_through), the calls of the
other kind in the same mix run between them untimed. For puts also a reclaim's thread CPU (its
reads, checksums, appends and checkpoint), averaged over the reclaims the puts ran.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=TREE python bench/fio_put_steps.py [CALLS] [--mix 50]
        [--kind put|get]

Prints one JSON line: load, kind, calls, cpu_ms (a call's thread CPU), reclaims,
reclaim_cpu_ms and each step's ms per call, largest first; a step the tree under test does not
have is left out. The picks come from a fixed seed, so two trees run the same calls.
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

import kvtier.coherence.flushes as flushes
import kvtier.coherence.gets as gets
import kvtier.coherence.eviction as eviction
import kvtier.coherence.journal as journal
import kvtier.coherence.leases as leases
import kvtier.coherence.persist as persist
import kvtier.coherence.puts as puts
import kvtier.coherence.space as space
import kvtier.coherence.transfers as transfers
import kvtier.tiers.aio as aio
import kvtier.tiers.host as host
import kvtier.tiers.nvme as nvme
import kvtier.tiers.slots as slots
from kvtier import fio

# This script's own bench/common.py (its directory is sys.path[0]), whatever tree PYTHONPATH
# names for kvtier: a base tree's bench/ may predate it.
from common import wrap_thread_cpu  # noqa: E402

SPENT: dict[str, float] = collections.defaultdict(float)
CALLS: dict[str, int] = collections.defaultdict(int)
PUT_STEPS = [(puts.Puts, "reserve"), (host.SlotPool, "write"), (puts.Puts, "_commit"),
             (flushes.Flushes, "_write_group"), (flushes.Flushes, "_pick"),
             (space.Space, "make_room"), (nvme.SegmentLog, "write"),
             (flushes.Flushes, "_finish_group"), (nvme.SegmentLog, "sync"),
             (journal.Journal, "put"), (flushes.Flushes, "_apply_flush"),
             (flushes.Flushes, "_unpin"), (space.Space, "compaction_due"),
             (space.Space, "compact"), (space.Space, "reclaim"),
             (persist.NvmeStore, "checkpoint")]
# A get of the lane (kvtier.fio._Target.get): the engine's get (decide, the C read, install
# and lease), the copy out of the pool (what _Target.get spends outside the steps named), the
# release and the eviction that makes the next read come from NVMe.
GET_STEPS = [(fio._Target, "get"), (gets.Gets, "get"), (gets.Gets, "_get_decide"),
             (gets.Gets, "_split_native"), (gets.Gets, "_bring_ups"),
             (transfers.Transfers, "_bring_up_from_nvme"), (persist.NvmeStore, "plan_read"),
             (nvme.SegmentLog, "pin"), (gets.Gets, "_read_step"), (gets, "record_batch"),
             (gets, "run_batch"), (gets, "verdicts"), (gets.Gets, "_finish_get"),
             (gets.Gets, "_install_read"), (gets.Gets, "_lease_get"),
             (nvme.SegmentLog, "unpin"), (leases.Holds, "release"),
             (eviction.Eviction, "evict"), (slots.SlotStack, "check_slots")]


def timed(owner, name: str, label: str) -> None:
    """Wrap owner.name so that its thread CPU adds to SPENT[label]."""
    wrap_thread_cpu(owner, name, label, SPENT, CALLS)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("calls", type=int, nargs="?", default=600)
    ap.add_argument("--mix", type=int, default=50, help="rwmixread: the share of gets")
    ap.add_argument("--kind", choices=("put", "get"), default="put", help="the calls timed")
    ap.add_argument("--size", default="64m")
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    for owner, name in PUT_STEPS if a.kind == "put" else GET_STEPS:
        if hasattr(owner, name):
            timed(owner, name, f"{getattr(owner, '__name__', '?').rsplit('.', 1)[-1]}.{name}")
    for name in ("run", "write_run"):          # the C AIO loop (write_run: fio10's)
        if hasattr(aio._native, name):
            timed(aio._native, name, "aio_c")
    job = fio.apply_option(fio.Job(name="steps", rw="randrw", bs=65536, iodepth=16,
                                   tier="nvme", direct=True, rwmixread=a.mix), "size", a.size)
    wd = tempfile.mkdtemp(dir=a.dir)
    tg = fio._Target(job.validate(), wd)
    n, cpu = 0, 0.0
    try:
        tg.fill()
        SPENT.clear()
        CALLS.clear()
        rng = np.random.default_rng(100)
        out = fio.page_aligned(job.iodepth, job.bs)   # the lane's own get buffer (fio6)
        order = fio._order(job, tg.nblocks, rng, 1 << 16)
        for c in range(a.calls):
            idx = order[(c * job.iodepth + np.arange(job.iodepth)) % order.size]
            kind = "put" if rng.random() * 100 >= job.rwmixread else "get"
            if kind == a.kind:
                t = time.thread_time()
                tg.put(idx, owner=1) if kind == "put" else tg.get(idx, owner=1, out=out)
                cpu += time.thread_time() - t
                n += 1
                continue
            saved, counts = dict(SPENT), dict(CALLS)    # untimed: its steps are not the kind's
            tg.put(idx, owner=1) if kind == "put" else tg.get(idx, owner=1, out=out)
            SPENT.clear()
            SPENT.update(saved)
            CALLS.clear()
            CALLS.update(counts)
    finally:
        tg.close()
        shutil.rmtree(wd, ignore_errors=True)
    rec = CALLS.get("Space.reclaim", 0)
    res: dict[str, object] = {
        "load": round(os.getloadavg()[0], 2), "kind": a.kind, "calls": n,
        "cpu_ms": round(1e3 * cpu / max(n, 1), 3), "reclaims": rec,
        "reclaim_cpu_ms": round(1e3 * SPENT.get("Space.reclaim", 0.0) / max(rec, 1), 3)}
    res.update({k: round(1e3 * v / max(n, 1), 3)
                for k, v in sorted(SPENT.items(), key=lambda kv: -kv[1])})
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
