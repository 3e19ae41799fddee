"""Where a GPU put's time goes, chunk by chunk (issue 16's offload rows; off7): bench/gpu.py's
rows put (4,096 rewrites of existing keys in a random key order, from random rows of a CUDA
tensor, on a side stream) with the client's steps timed from outside, so the same script
times any tree: each reserve and commit sent, each reply read, each chunk's move enqueued on
the host and completed on the GPU (a timing event after it, against one recorded at entry),
whether the GPU hash had ended at put_async's return, its return and wait()'s. Then a
cProfile of the same puts, and other cuts into chunks timed beside the default.

    python bench/put_timeline.py [--cases 16k,64k] [--reps 15] [--json]

Needs CUDA (torch, cupy) and starts its own `kvtier serve` as bench/gpu.py does. Median put
by its total, ms from put_async's entry.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header  # noqa: E402
from bench.gpu import scattered_rows  # noqa: E402


class Tracer:
    """Wraps Client._send/_reply and Mover.move for the duration of a put."""

    def __init__(self) -> None:
        from kvtier.api.client import Client
        from kvtier.gpu.device import Mover
        self.C, self.M = Client, Mover
        self.saved = [(Client, "_send", Client._send), (Client, "_reply", Client._reply),
                      (Mover, "move", Mover.move)]
        self.ev: list = []
        pc = time.perf_counter
        send, reply, move = Client._send, Client._reply, Mover.move
        tr = self

        def _send(c, op, args, piggyback=True):
            rid = send(c, op, args, piggyback)
            tr.ev.append((op, "sent", pc(), rid))
            return rid

        def _reply(c, req_id):
            t = pc()
            r = reply(c, req_id)
            tr.ev.append(("reply", "read", pc(), (req_id, round((pc() - t) * 1e3, 4))))
            return r

        def _move(m, slots, rows, lo, hi, to_seg):
            t = pc()
            move(m, slots, rows, lo, hi, to_seg)
            tr.ev.append(("move", "enq", pc(), (t, m.mark()[0])))
        self.patched = [(Client, "_send", _send), (Client, "_reply", _reply), (Mover, "move", _move)]

    def __enter__(self) -> "Tracer":
        self.ev = []
        for cls, name, f in self.patched:
            setattr(cls, name, f)
        return self

    def __exit__(self, *exc) -> None:
        for cls, name, f in self.saved:
            setattr(cls, name, f)


def timeline(ns, kb, src, rows, stream, reps: int) -> dict:
    import cupy
    import torch
    cs = cupy.cuda.ExternalStream(stream.cuda_stream)
    puts = []
    tracer = Tracer()
    for _ in range(reps):
        torch.cuda.synchronize()
        ev0 = cupy.cuda.Event()
        with tracer:
            ev0.record(cs)
            t0 = time.perf_counter()
            h = ns.put_async(kb, src, rows=rows, stream=stream)
            t_ret = time.perf_counter()
            hashed = getattr(h, "_hashed", None)
            hash_done = None if hashed is None else bool(hashed.done)
            h.wait()
            t_done = time.perf_counter()
        ms = lambda t: round((t - t0) * 1e3, 4)        # noqa: E731
        gpu = lambda e: round(float(cupy.cuda.get_elapsed_time(ev0, e)), 4)   # noqa: E731
        p = {"total_ms": ms(t_done), "ret_ms": ms(t_ret), "hash_done_at_ret": hash_done,
             "reserve_sent": [], "reserve_read": [], "commit_sent": [], "commit_read": [],
             "move_enq": [], "move_host_ms": [], "move_end_gpu": [], "reply_wait_ms": []}
        kinds: dict = {}
        for op, what, t, x in tracer.ev:
            if what == "sent" and op in ("reserve", "commit"):
                kinds[x] = op
                p[f"{op}_sent"].append(ms(t))
            elif op == "reply":
                k = kinds.get(x[0], "other")
                if k in ("reserve", "commit"):
                    p[f"{k}_read"].append(ms(t))
                    p["reply_wait_ms"].append(x[1])
            elif op == "move":
                p["move_enq"].append(ms(t))
                p["move_host_ms"].append(round((t - x[0]) * 1e3, 4))
                p["move_end_gpu"].append(gpu(x[1]))
        puts.append(p)
    puts.sort(key=lambda p: p["total_ms"])
    return puts[len(puts) // 2]


def profile(put, reps: int) -> list:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(reps):
        put()
    pr.disable()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    out = []
    for (fn, line, name), (cc, nc, tt, ct, _callers) in sorted(
            st.stats.items(), key=lambda kv: -kv[1][2])[:14]:
        out.append(f"{name} ({os.path.basename(fn)}:{line}): {tt / reps * 1e6:.1f} us own, "
                   f"{ct / reps * 1e6:.1f} us cumulative, {nc / reps:.1f} calls")
    return out


# Other cuts of the same put into chunks (keys per chunk), timed beside the default in the same
# process, alternated: fewer chunks (fewer requests in the service's chain), a smaller first
# chunk (copies start sooner), a short last one (less commit after the last copy).
VARIANTS = {
    "16k": {"c4": [256, 1280, 1280, 1280], "c3": [512, 1792, 1792],
            "first128": [128, 1024, 1024, 1024, 896], "last256": [256, 1024, 1024, 1024, 512, 256]},
    "64k": {"first64": [64, 1024, 1024, 1024, 960], "first128": [128, 1024, 1024, 1024, 896],
            "last256": [256, 1024, 1024, 1024, 512, 256], "c4": [256, 1280, 1280, 1280]},
}


def variants(put, cuts: dict, reps: int) -> dict:
    """put_ms of each cut against the default's, three rounds alternated, medians."""
    import torch
    from kvtier.api import pipeline
    default = pipeline.cuda_put_chunks
    times: dict = {"default": []}
    for _ in range(3):
        for name, sizes in [("default", None)] + list(cuts.items()):
            if sizes is not None:
                bounds = np.cumsum([0] + sizes).tolist()
                pipeline.cuda_put_chunks = lambda n, bb, b=bounds: list(zip(b[:-1], b[1:]))
            try:
                for _ in range(reps):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    put()
                    times.setdefault(name, []).append(time.perf_counter() - t)
            finally:
                pipeline.cuda_put_chunks = default
    return {k: round(float(np.median(v)) * 1e3, 4) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="16k,64k")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch
    from kvtier import Client
    from tests.service import Service
    m = header("bench/put_timeline.py")
    work = tempfile.mkdtemp(prefix="kvtier-putline-")
    svc = Service(os.path.join(work, "svc"), admin=False, host_capacity="6GiB",
                  nvme_capacity="0").start()
    res: dict = {"machine": m}
    try:
        c = Client(svc.socket)
        for tag in args.cases.split(","):
            bb = {"16k": 16384, "64k": 65536}[tag]
            n = args.n
            ns = c.namespace(f"rows{tag}", block_bytes=bb)
            src, _order, kb, rows = scattered_rows(ns, bb, n)      # the same case as bench/gpu.py's
            stream = torch.cuda.Stream()
            torch.cuda.synchronize()
            put = lambda: ns.put_async(kb, src, rows=rows, stream=stream).wait()  # noqa: E731
            for _ in range(5):
                put()
            res[f"timeline_{tag}"] = timeline(ns, kb, src, rows, stream, args.reps)
            ts = []
            for _ in range(args.reps):
                torch.cuda.synchronize()
                t = time.perf_counter()
                put()
                ts.append(time.perf_counter() - t)
            res[f"put_ms_{tag}"] = round(float(np.median(ts)) * 1e3, 4)
            res[f"profile_{tag}"] = profile(put, args.reps)
            res[f"variants_{tag}"] = variants(put, VARIANTS[tag], args.reps)
        c.close()
    finally:
        svc.stop()
    emit(res, args.json)


if __name__ == "__main__":
    main()
