"""Where a resident get's wait beside NVMe readers goes: bench/stall.py's experiment with the
service's loop traced (issue 17, stall).

    python bench/stall_trace.py --json
    python bench/stall_trace.py --readers 1 --cold-blocks 256 --batch 16 --host-capacity 8MiB \
        --samples 50 --json                                                  # the CI smoke run

The service runs with bench/stall_trace_hooks on its PYTHONPATH: each piece of the loop's work
is timed (a locked step by its function, a connection's data_received, a reply built or
written, an inline engine call, piggybacked releases) and each NVMe read on an I/O thread. The
probe records when it sent each get and when the reply came (CLOCK_MONOTONIC, as the service's
perf_counter). For the probe's slowest gets beside the readers (--tail, the top 2% by default)
it reports the wait from the send to the service's data_received of that frame, split into the
loop's traced work in that interval by kind and the rest ("untraced": the loop idle, waiting for
the GIL, or in work not traced: task steps, thread callbacks, the poll itself); and the
duration percentiles of each kind of loop work over the whole beside phase. The hooks cost a
few microseconds per event: the figures are not bench/stall.py's. Their events also set off
the garbage collector (gc:0, gc:1 in loop_work_us; tail_gc_overlap_us): nearly all of those
collections are the tracer's own (bench/stall_trace_hooks); --no-gc turns the collector off in
the traced service.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header  # noqa: E402
from bench.stall import HOT, key, reader  # noqa: E402

HOOKS = os.path.join(ROOT, "bench", "stall_trace_hooks")


def _name(e: tuple) -> str:
    kind = e[0]
    if kind in ("step", "fast", "task"):
        return f"{kind}:{e[3]}"
    if kind in ("gc", "part"):
        return f"{kind}:{e[3]}"
    if kind in ("dr", "write", "reply", "endl"):
        return f"{kind}:{'probe' if e[3] == 'stall-probe' else 'reader'}"
    return kind


def analyse(events: list[tuple], beside: np.ndarray, tail: float) -> dict:
    # Only the loop's outermost pieces of work (an inline engine call, reply or write inside a
    # data_received is part of it; the nested ones are in loop_work_us).
    # On the I/O threads, or inside a step; a collection is in whatever work set it off (its
    # share of the tail is told apart below: tail_gc_overlap_us).
    side = ("read", "pin", "unpin", "gc", "part")
    loop, end = [], -1.0
    for e in sorted((e for e in events if e[0] not in side), key=lambda e: e[1]):
        if e[1] >= end:
            loop.append(e)
            end = e[2]
    nested = sorted((e for e in events if e[0] != "read"), key=lambda e: e[1])
    cpu: dict[str, list[float]] = collections.defaultdict(list)
    switches: dict[str, list[tuple]] = collections.defaultdict(list)
    reads = sorted((e for e in events if e[0] == "read"), key=lambda e: e[1])
    gcs = [e for e in events if e[0] == "gc"]
    starts = np.array([e[1] for e in loop])
    lo_t, hi_t = beside[0, 0], beside[-1, 1]
    pdr = [e for e in loop if e[0] == "dr" and e[3] == "stall-probe"]
    pdr_t = np.array([e[1] for e in pdr])
    lat = beside[:, 1] - beside[:, 0]
    thr = np.percentile(lat, 100 - tail)
    agg: collections.Counter = collections.Counter()
    cnt: collections.Counter = collections.Counter()
    waits, ins, overl, gc_overl = [], [], [], []
    for i in np.flatnonzero(lat >= thr):
        t0, t1 = beside[i]
        j = int(np.searchsorted(pdr_t, t0))
        if j >= len(pdr_t) or pdr_t[j] > t1:
            continue
        e = pdr[j]
        waits.append(e[1] - t0)
        ins.append(e[2] - e[1])
        busy = 0.0
        for x in loop[int(np.searchsorted(starts, t0 - 0.05)):int(np.searchsorted(starts, e[1]))]:
            if x[2] <= t0:
                continue
            d = min(x[2], e[1]) - max(x[1], t0)
            agg[_name(x)] += d
            cnt[_name(x)] += 1
            busy += d
        agg["untraced"] += (e[1] - t0) - busy
        overl.append(sum(max(0.0, min(r[2], e[1]) - max(r[1], t0)) for r in reads
                         if r[1] < e[1] and r[2] > t0))
        gc_overl.append(sum(max(0.0, min(g[2], e[1]) - max(g[1], t0)) for g in gcs
                            if g[1] < e[1] and g[2] > t0))
    n = max(1, len(waits))
    durs: dict[str, list[float]] = collections.defaultdict(list)
    for e in nested:
        if lo_t <= e[1] <= hi_t:
            durs[_name(e)].append(e[2] - e[1])
            if len(e) > 4 and e[0] in ("step", "dr", "task"):
                cpu[_name(e)].append(e[4])
            if len(e) > 6 and e[0] in ("step", "dr", "task"):
                switches[_name(e)].append((e[5], e[6], e[2] - e[1] - e[4]))
    # The I/O threads' Python around each read (run_read less its GIL-free parts): the GIL
    # they hold while the loop may want it, as a share of the phase.
    held = [e[4] for e in reads if len(e) > 4 and lo_t <= e[1] <= hi_t]
    return {
        "io_python_per_read_us": ({"n": len(held),
                                   "p50": round(float(np.percentile(held, 50)) * 1e6, 1),
                                   "p99": round(float(np.percentile(held, 99)) * 1e6, 1),
                                   "share_of_phase": round(sum(held) / (hi_t - lo_t), 3)}
                                  if held else None),
        # Per kind of loop work: how often the loop thread blocked in it (voluntary context
        # switches: the GIL or a lock) or was preempted (involuntary: a core shared), and
        # the wall time beyond its CPU time.
        "loop_switches": {k: {"blocked_share": round(float(np.mean([x[0] > 0 for x in v])), 3),
                              "preempted_share": round(float(np.mean([x[1] > 0 for x in v])), 3),
                              "waiting_p50_us": round(float(np.percentile(
                                  [x[2] for x in v], 50)) * 1e6, 1),
                              "waiting_p99_us": round(float(np.percentile(
                                  [x[2] for x in v], 99)) * 1e6, 1)}
                          for k, v in sorted(switches.items())},
        "tail_gets": len(waits), "tail_threshold_us": round(thr * 1e6, 1),
        "tail_wait_to_data_received_us": round(float(np.mean(waits)) * 1e6, 1) if waits else None,
        "tail_in_data_received_us": round(float(np.mean(ins)) * 1e6, 1) if ins else None,
        "tail_nvme_read_overlap_us": round(float(np.mean(overl)) * 1e6, 1) if overl else None,
        # The garbage collector's runs inside the tail's waits (in any kind of work above), and
        # the share of the tail gets that waited through one.
        "tail_gc_overlap_us": round(float(np.mean(gc_overl)) * 1e6, 1) if gc_overl else None,
        "tail_gets_with_gc": (round(float(np.mean([x > 0 for x in gc_overl])), 3)
                              if gc_overl else None),
        "tail_wait_by_kind_us": {k: {"us": round(v / n * 1e6, 1), "events": round(cnt[k] / n, 2)}
                                 for k, v in agg.most_common()},
        "loop_work_us": {k: {"n": len(v), "p50": round(float(np.percentile(v, 50)) * 1e6, 1),
                             "p90": round(float(np.percentile(v, 90)) * 1e6, 1),
                             "p99": round(float(np.percentile(v, 99)) * 1e6, 1),
                             "share_of_phase": round(sum(v) / (hi_t - lo_t), 3),
                             **({"cpu_p50": round(float(np.percentile(cpu[k], 50)) * 1e6, 1),
                                 "cpu_p99": round(float(np.percentile(cpu[k], 99)) * 1e6, 1)}
                                if cpu.get(k) else {})}
                         for k, v in sorted(durs.items())},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readers", default="1,4,8")
    ap.add_argument("--cold-blocks", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=64, help="blocks per reader get")
    ap.add_argument("--host-capacity", default="64MiB")
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--tail", type=float, default=2.0, help="percent of slowest probe gets")
    ap.add_argument("--no-gc", action="store_true",
                    help="the garbage collector off in the traced service (its runs there are "
                         "mostly the tracer's own)")
    ap.add_argument("--parts", default="",
                    help="functions to time inside the steps, module:Class.method,... (each "
                         "a part:<method> entry of loop_work_us)")
    ap.add_argument("--task-steps", action="store_true",
                    help="the reply tasks' steps timed as loop work too (task:start, task:mid, "
                         "task:end; the service's tasks then pure-Python ones)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = header("bench/stall_trace.py")
    import kvtier
    from tests.service import Service
    bb = 64 << 10
    base = tempfile.mkdtemp(prefix="kvtier-stall-trace-", dir=os.getcwd())
    trace = os.path.join(base, "events.pkl")
    env = {k: os.environ.get(k) for k in ("STALL_TRACE", "STALL_TRACE_ROLE", "PYTHONPATH",
                                          "STALL_TRACE_GC", "STALL_TRACE_PARTS",
                                          "STALL_TRACE_TASKS")}
    os.environ.update(STALL_TRACE=trace, STALL_TRACE_ROLE="serve",
                      STALL_TRACE_GC="off" if args.no_gc else "on", STALL_TRACE_PARTS=args.parts,
                      STALL_TRACE_TASKS="1" if args.task_steps else "0",
                      PYTHONPATH=os.pathsep.join(p for p in (HOOKS, ROOT, env["PYTHONPATH"])
                                                 if p))
    svc = Service(Path(base) / "svc", admin=False, host_capacity=args.host_capacity,
                  nvme_capacity=f"{args.cold_blocks * bb * 2 + (64 << 20)}",
                  segment_bytes="64MiB", write_policy="write_back").start()
    for k, v in env.items():                  # the readers and the probe run untraced
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    ctx = mp.get_context("spawn")
    phases: dict[int, dict] = {}
    try:
        with kvtier.Client(svc.socket, timeout=120, name="stall-probe") as c:
            ns = c.namespace("stall", block_bytes=bb)
            data = np.random.default_rng(0).integers(0, 256, (64, bb), dtype=np.uint8)
            for lo in range(0, args.cold_blocks, 64):
                n = min(64, args.cold_blocks - lo)
                ns.put(b"".join(key(i) for i in range(lo, lo + n)), data[:n], verify=False)
            c.flush()
            ns.put(HOT, data[:1])
            buf = np.empty((1, bb), dtype=np.uint8)

            def probe(n: int) -> np.ndarray:
                out = np.empty((n, 2))
                for i in range(n):
                    out[i, 0] = time.perf_counter()
                    ns.get(HOT, out=buf)
                    out[i, 1] = time.perf_counter()
                return out

            probe(200)
            for k in [int(x) for x in args.readers.split(",") if x]:
                pin = ns.get_leased(HOT)
                alone = probe(args.samples)
                stop, q = ctx.Event(), ctx.Queue()
                readys = [ctx.Event() for _ in range(k)]
                procs = [ctx.Process(target=reader, args=(str(svc.socket), args.cold_blocks,
                                                          args.batch, False, stop, r, q))
                         for r in readys]
                for p in procs:
                    p.start()
                for r in readys:
                    r.wait(120)
                time.sleep(0.5)
                beside = probe(args.samples)
                stop.set()
                rl = [x for _ in procs for x in q.get(timeout=300)]
                for p in procs:
                    p.join(60)
                pin.release()
                phases[k] = {"alone": alone, "beside": beside, "reader_gets": len(rl)}
    finally:
        svc.stop()
    try:
        with open(trace, "rb") as fh:
            events = pickle.load(fh)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out: dict = {"cold_blocks": args.cold_blocks, "batch": args.batch, "gc": not args.no_gc,
                 "host_capacity": args.host_capacity, "samples": args.samples,
                 "tail_pct": args.tail, "conditions": {}}
    for k, ph in phases.items():
        a = np.diff(ph["alone"], axis=1).ravel()
        b = np.diff(ph["beside"], axis=1).ravel()
        out["conditions"][str(k)] = {
            "alone_p99_us": round(float(np.percentile(a, 99)) * 1e6, 1),
            "beside_p50_us": round(float(np.percentile(b, 50)) * 1e6, 1),
            "beside_p99_us": round(float(np.percentile(b, 99)) * 1e6, 1),
            "reader_gets": ph["reader_gets"], **analyse(events, ph["beside"], args.tail)}
    out["machine"] = m
    emit(out, args.json)


if __name__ == "__main__":
    main()
