"""Where a chunked get's control path goes, reply by reply, between a real `kvtier serve` and
the client (issue 16's small-page rows; gpu6). No GPU: the get leases and releases its chunks
as bench/gpu.py's rows do (4,096 keys in another order than the put's, chunks of
pipeline.CHUNK), nothing moved.

    python bench/get_control.py [--block 16384] [--n 4096] [--gets 60] [--gap-ms 1.5]
                                [--trace] [--json]

The service runs with bench/get_control_hooks on its PYTHONPATH when --trace is given (each
data_received, dispatch, decode, engine call, reply build, pack and write timed); the client
times its sends, its waits, each frame's decode and GetReply.decode. All on CLOCK_MONOTONIC,
relative to the get's entry; medians over the gets. The hooks cost a few us an event: compare
--trace runs with each other, and the untraced run's reply times with the traced ones.
"""

from __future__ import annotations

import argparse
import collections
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header  # noqa: E402


def run(block: int, n: int, gets: int, trace: bool, chunk: int | None, gap_ms: float,
        nvme: str) -> dict:
    from kvtier import Client
    from kvtier.api import pipeline
    from kvtier.api import protocol as P
    from kvtier.api.client import Client as C
    from kvtier.api.handles import GetReply
    from tests.service import Service
    work = tempfile.mkdtemp(prefix="kvtier-getctl-")
    tpath = os.path.join(work, "serve.trace")
    env_saved = dict(os.environ)
    # The service runs this tree's kvtier (and, traced, the hooks as its sitecustomize).
    os.environ["PYTHONPATH"] = os.pathsep.join(
        ([os.path.join(ROOT, "bench", "get_control_hooks")] if trace else []) + [ROOT]
        + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if trace:
        os.environ["GET_CONTROL_TRACE"] = tpath
    cap = max(64 << 20, 8 * n * block)       # room for a get's leases beside the last one's
    try:
        svc = Service(Path(work) / "d", admin=False, host_capacity=str(cap),
                      nvme_capacity=nvme).start()
    finally:
        os.environ.clear()
        os.environ.update(env_saved)
    ev: list = []
    pc = time.perf_counter
    try:
        c = Client(svc.socket)
        ns = c.namespace("rows", block_bytes=block)
        keys = b"".join((i + 1).to_bytes(16, "big") for i in range(n))
        data = np.random.default_rng(0).integers(0, 255, (n, block), dtype=np.uint8)
        ns.put(keys, data)
        order = np.random.default_rng(block).permutation(n)
        kb = b"".join(keys[16 * i:16 * i + 16] for i in order)

        def hook(obj, name, kind):
            orig = getattr(obj, name)

            def f(*a, **k):
                t0 = pc()
                r = orig(*a, **k)
                ev.append((kind, t0, pc()))
                return r
            setattr(obj, name, f)
            return orig
        saved = [(C, "_send", hook(C, "_send", "send")), (C, "_wait", hook(C, "_wait", "wait")),
                 (P, "unpack", hook(P, "unpack", "unpack")),
                 (GetReply, "decode", GetReply.__dict__["decode"])]
        dec = GetReply.decode

        def decode(r):
            t0 = pc()
            out = dec(r)
            ev.append(("decode", t0, pc()))
            return out
        GetReply.decode = staticmethod(decode)
        size = chunk or pipeline.CHUNK
        for _ in range(gets + 5):
            ev.append(("entry", pc(), pc()))
            found, leases, error, _m = pipeline.lease(ns, kb, n, lambda rep, lo: None, size=size)
            ev.append(("exit", pc(), pc()))
            if error is not None or not found.all():
                raise RuntimeError(f"get failed: {error} found {int(found.sum())}")
            for lease in leases:
                c._release_later(lease)
            if gap_ms:
                # The client's GPU wait between two gets of bench/gpu.py (the service's loop
                # may sleep meanwhile: busy_poll_us): spun, as torch's synchronize is.
                end = pc() + gap_ms * 1e-3
                while pc() < end:
                    pass
        for obj, name, orig in saved:
            setattr(obj, name, orig)
        c.close()
    finally:
        svc.stop()
    sev = []
    if trace:
        with open(tpath, "rb") as f:
            sev = pickle.load(f)
    return summarize(ev, sev, gets, len(pipeline.chunks(n, size)))


def summarize(ev: list, sev: list, gets: int, parts: int) -> dict:
    """Per get (the last `gets`), each event's offsets from its entry: the client's sends,
    waits, decodes, the service's data_received, dispatches, packs and writes in that window."""
    windows = []
    i = 0
    while i < len(ev):
        if ev[i][0] == "entry":
            j = i
            while ev[j][0] != "exit":
                j += 1
            windows.append((ev[i][1], ev[j][2], ev[i:j + 1]))
            i = j
        i += 1
    windows = windows[-gets:]
    sev = sorted(sev, key=lambda e: e[2])
    ends = np.array([e[2] for e in sev]) if sev else np.zeros(0)
    per: dict = collections.defaultdict(list)
    for t_in, t_out, cev in windows:
        kinds: dict = collections.defaultdict(list)
        for kind, t0, t1 in cev:
            if kind not in ("entry", "exit"):
                kinds[f"client_{kind}"].append(((t0 - t_in) * 1e3, (t1 - t0) * 1e3))
        lo, hi = np.searchsorted(ends, [t_in, t_out]) if sev else (0, 0)
        for e in sorted(sev[lo:hi], key=lambda e: e[1]):     # every event ending in the get
            kinds[f"serve_{e[0]}"].append(((e[1] - t_in) * 1e3, (e[2] - e[1]) * 1e3))
        per["total_ms"].append((t_out - t_in) * 1e3)
        for k, v in kinds.items():
            per[k + "_count"].append(len(v))
            per[k + "_sum_ms"].append(sum(d for _s, d in v))
            for idx, (s, d) in enumerate(v[:2 * parts + 2]):
                per[f"{k}[{idx}]_at_ms"].append(s)
                per[f"{k}[{idx}]_ms"].append(d)
    return {"gets": len(windows), "chunks": parts,
            **{k: round(float(np.median(v)), 4) for k, v in sorted(per.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block", type=int, default=16384)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--gets", type=int, default=60)
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="spin this long between gets (bench/gpu.py's GPU wait)")
    ap.add_argument("--nvme", default="0", help="the service's nvme_capacity (bench/gpu.py: 0)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = header("bench/get_control.py")
    res = run(args.block, args.n, args.gets, args.trace, args.chunk, args.gap_ms, args.nvme)
    res["loadavg"] = os.getloadavg()[0]
    res["machine"] = m
    emit(res, args.json)


if __name__ == "__main__":
    main()
