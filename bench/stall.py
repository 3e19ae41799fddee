"""Stall: does one worker's disk read hold up another worker's get of a resident block?

    python bench/stall.py --json
    python bench/stall.py --cold-blocks 512 --samples 100 --json      # the CI smoke run
    python bench/stall.py --nice 10 --json       # on a machine that other work shares
    python bench/stall.py --switch-interval 1e-4 --json   # the service's GIL switch interval

Against a real `kvtier serve`: one probe client times single-block gets of a key that stays in
the host tier, first alone, then beside 1, 4 and 8 reader processes whose gets of --batch
random blocks read the NVMe tier (the cold set is --cold-blocks blocks, several times the host
tier). Each condition is measured right after an alone phase, in the same run, and reported as
the ratio of its p99 to that alone phase's p99 (target <= 2). The readers' own get latency and
the share of their blocks served from NVMe are reported beside it, so that the readers are
seen to have been reading the disk.

A get here is what a worker's get is: ``ns.get(keys, out=buf)``, one round trip, the bytes
copied out and the lease released with the next request. Until issue 17's second session the
probe and the readers used get_leased and a release that waits for its reply, two round trips
per get, and the probe timed both; --leased measures that form.

--nice N runs the service and the probe N steps above the default priority (the readers stay at
the default): on the shared 2-core dev VM other sessions' processes otherwise decide the probe's
tail (alone p50 4 ms, p99 12-34 ms in one such run) and no ratio says anything about kvtier.
With it, the probe still competes with the readers for the service's lock, GIL and threads, and
their requests are served by the same raised process; what it leaves out is the OS scheduling
the probe behind processes that are not part of the experiment. Needs root (or CAP_SYS_NICE).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header, percentiles  # noqa: E402

HOT = (1).to_bytes(16, "big")


def key(i: int) -> bytes:
    return (i + 2).to_bytes(16, "big")


def reader(sock: str, cold: int, batch: int, leased: bool, stop: "mp.Event",
           ready: "mp.Event", out: "mp.Queue") -> None:
    import kvtier
    os.setpriority(os.PRIO_PROCESS, 0, 0)     # the default, whatever the probe runs at
    rng = np.random.default_rng(os.getpid())
    lat: list[float] = []
    with kvtier.Client(sock, timeout=120, name="stall-reader") as c:
        ns = c.namespace("stall")
        buf = np.empty((batch, ns.block_bytes), dtype=np.uint8)
        ready.set()
        while not stop.is_set():
            ks = b"".join(key(int(k)) for k in rng.choice(cold, batch, replace=False))
            t0 = time.perf_counter()
            if leased:
                with ns.get_leased(ks):
                    pass
            else:
                ns.get(ks, out=buf)
            lat.append(time.perf_counter() - t0)
    out.put(lat)


def probe(ns, samples: int, leased: bool) -> list[float]:
    lat = []
    buf = np.empty((1, ns.block_bytes), dtype=np.uint8)
    for _ in range(samples):
        t0 = time.perf_counter()
        if leased:
            with ns.get_leased(HOT) as lease:
                ok = bool(lease.found[0])
        else:
            ok = bool(ns.get(HOT, out=buf)[0][0])
        lat.append(time.perf_counter() - t0)
        if not ok:
            raise SystemExit("the hot key left the host tier; raise --host-capacity")
    return lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readers", default="1,4,8")
    ap.add_argument("--batch", type=int, default=64, help="blocks per reader get")
    ap.add_argument("--block-bytes", type=int, default=64 << 10)
    ap.add_argument("--cold-blocks", type=int, default=8192)
    ap.add_argument("--host-capacity", default="64MiB")
    ap.add_argument("--samples", type=int, default=2000, help="probe gets per phase")
    ap.add_argument("--nice", type=int, default=0,
                    help="raise the service's and the probe's priority by this (see above)")
    ap.add_argument("--leased", action="store_true",
                    help="get_leased + release (two round trips) instead of get (one)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="the service's sys.setswitchinterval, seconds (default: Python's 5 ms)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = header("bench/stall.py")
    if args.switch_interval:
        # Set in `kvtier serve` by bench/stall_trace_hooks (sitecustomize), for this experiment
        # only: the loop waits for the GIL behind the I/O threads' Python (bench/stall_trace.py).
        os.environ["STALL_SWITCH_INTERVAL"] = repr(args.switch_interval)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.path.join(ROOT, "bench", "stall_trace_hooks"), ROOT,
                        os.environ.get("PYTHONPATH")) if p)
    import kvtier
    from tests.service import Service
    base = tempfile.mkdtemp(prefix="kvtier-stall-", dir=os.getcwd())
    svc = Service(Path(base) / "svc", admin=False, host_capacity=args.host_capacity,
                  nvme_capacity=f"{args.cold_blocks * args.block_bytes * 2 + (64 << 20)}",
                  segment_bytes="64MiB", write_policy="write_back").start()
    if args.nice:
        # Linux's nice is per thread: every thread of the service now (those it starts later
        # inherit it from the loop's thread), and the probe's.
        for tid in [int(t) for t in os.listdir(f"/proc/{svc.proc.pid}/task")] + [0]:
            os.setpriority(os.PRIO_PROCESS, tid, -args.nice)
    ctx = mp.get_context("spawn")
    out: dict = {"block_bytes": args.block_bytes, "batch": args.batch,
                 "cold_blocks": args.cold_blocks, "host_capacity": args.host_capacity,
                 "nice": args.nice, "leased": args.leased,
                 "switch_interval_s": args.switch_interval,
                 "loadavg_start": round(os.getloadavg()[0], 2), "conditions": {}}
    try:
        with kvtier.Client(svc.socket, timeout=120, name="stall-probe") as c:
            ns = c.namespace("stall", block_bytes=args.block_bytes)
            data = np.random.default_rng(0).integers(0, 256, (64, args.block_bytes),
                                                     dtype=np.uint8)
            for lo in range(0, args.cold_blocks, 64):
                n = min(64, args.cold_blocks - lo)
                ns.put(b"".join(key(i) for i in range(lo, lo + n)), data[:n], verify=False)
            c.flush()
            ns.put(HOT, data[:1])
            probe(ns, 200, args.leased)                     # warm the probe's path
            s0 = c.stats()["tiers"]
            for k in [int(x) for x in args.readers.split(",") if x]:
                # A lease held through the condition keeps the hot block in the host tier,
                # whatever the readers' bring-ups evict around it (one per condition: a lease
                # lives lease_timeout, and a slow machine's whole run can outlast it).
                pin = ns.get_leased(HOT)
                alone = probe(ns, args.samples, args.leased)
                stop, q = ctx.Event(), ctx.Queue()
                readys = [ctx.Event() for _ in range(k)]
                procs = [ctx.Process(target=reader, args=(str(svc.socket), args.cold_blocks,
                                                          args.batch, args.leased, stop, r, q))
                         for r in readys]
                for p in procs:
                    p.start()
                for r in readys:
                    r.wait(120)
                time.sleep(0.5)                              # the readers are in their loops
                beside = probe(ns, args.samples, args.leased)
                stop.set()
                rl = [x for _ in procs for x in q.get(timeout=300)]
                for p in procs:
                    p.join(60)
                pin.release()
                pa, pb = percentiles(alone), percentiles(beside)
                out["conditions"][str(k)] = {
                    "alone_p50_us": round(pa["p50"] * 1e6, 1),
                    "alone_p99_us": round(pa["p99"] * 1e6, 1),
                    "beside_p50_us": round(pb["p50"] * 1e6, 1),
                    "beside_p99_us": round(pb["p99"] * 1e6, 1),
                    "p99_ratio": round(pb["p99"] / pa["p99"], 3),
                    "reader_gets": len(rl),
                    "reader_p50_ms": round(percentiles(rl)["p50"] * 1e3, 2) if rl else None}
            s1 = c.stats()["tiers"]
            read = s1["nvme"]["bytes_read"] - s0["nvme"]["bytes_read"]
            out["reader_nvme_share"] = round(read / max(
                1, (s1["host"]["bytes_read"] - s0["host"]["bytes_read"])), 3)
    finally:
        svc.stop()
        shutil.rmtree(base, ignore_errors=True)
    out["loadavg_end"] = round(os.getloadavg()[0], 2)   # other work on the machine: say it
    out["worst_p99_ratio"] = max(v["p99_ratio"] for v in out["conditions"].values())
    out["machine"] = m
    emit(out, args.json)


if __name__ == "__main__":
    main()
