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

    python bench/get_control.py --serve [--blocks 16384,65536] [--n 4096] [--gets 40]
                                [--gap-ms 1.5] [--tree TREE] [--sim NAME] [--json]

--serve (lease13, issue 16's small-page onboards): a GPU get's requests, both ways, against a
real `kvtier serve` (bench/gpu.py's: host tier 6 GiB, no NVMe) that runs with
bench/put_control_hooks (PUT_CONTROL_SERVE: each request's frame arrival, dispatch and reply
write). Per block size, 4,096 blocks put in one put, then gets of them in a shuffled key order
(bench/gpu.py's: rng(block).permutation), chunked and sorted alternated get by get: (a)
pipeline.lease with a CUDA get's arguments (tier host, chunks(n), no ramp), (b)
pipeline.lease_sorted with TransferPolicy's sorted_piece_keys. Nothing is moved; each get's
leases ride on the next get's last request, as GetTransfer's do, and --gap-ms is slept between
gets (the GPU's wait). Medians over the gets of: each reply's arrival in the client from the
get's entry (its first send), the total, and per request in the service its time from its
frame's arrival to its reply written, the wait before its dispatch, the dispatch, and when the
reply was written from the get's entry; and each reply's slots' span (dense: its size). --tree
runs another tree's client and service (pairs: bench/get_pairs.py). --sim NAME: each reply's
launch and move on a GPU simulated from an H100's timelines (SIMS); the total is then the later
of the last reply's launch and the simulated stream's end.
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


HOWS = ("chunked", "sorted")


def start_serve(tree: str, work: str, spath: str):
    """bench/gpu.py's service, from tree, with bench/put_control_hooks' request times."""
    from tests.service import Service
    env_saved = dict(os.environ)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, "bench", "put_control_hooks"), tree]
        + [p for p in [os.environ.get("PYTHONPATH")] if p])
    os.environ["PUT_CONTROL_SERVE"] = spath
    cwd = os.getcwd()
    os.chdir(tree)            # `python -m kvtier.cli` puts its cwd first on sys.path
    try:
        return Service(Path(work) / "d", admin=False, host_capacity="6GiB",
                       nvme_capacity="0").start()
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env_saved)


# --sim: a GPU simulated from an H100's timelines (bench/gpu.py onboard_timeline_16k / _64k and
# their _sorted variants): per reply, the client's launch (host ms: the first reply's, then
# per 1,024 keys of a later one; spun, so the client reads the next reply no sooner than the
# real one did) and the GPU's move (ms per 1,024 keys, one stream, starting when both the
# launch and the move before it are done). A chunk, and a sorted get's piece 0, is moved as
# the chunked get moves a sparse chunk (16 KiB: the mapped-memory kernel; 64 KiB: batched
# copies at ~54 GB/s); a later piece, dense, by stage_sorted (one copy and a placement). An
# approximation for choosing between the two gets, not a GPU figure: the copies of a 64 KiB
# chunk start during its launch there, and here after it.
#   h100-s36: session 36's H100 (bench/results/s36-h100/gpu.json), whose 16 KiB chunk kernel
#             read at ~34 GB/s and the staged pieces at ~51;
#   h100-s37: session 37's (bench/results/s37-h100/gpu-full-r1.json): the chunk kernel ~46,
#             the staged pieces ~52, the sorted piece's launch 0.16-0.26 ms against a chunk's
#             0.08-0.09.
SIMS = {  # name: {block: {kind: (first launch ms, later launch per 1,024 keys, move per 1,024)}}
    "h100-s36": {16384: {"chunk": (0.14, 0.06, 0.49), "piece": (0.15, 0.18, 0.326)},
                 65536: {"chunk": (0.20, 0.55, 1.24), "piece": (0.23, 0.27, 1.30)}},
    "h100-s37": {16384: {"chunk": (0.22, 0.085, 0.36), "piece": (0.15, 0.19, 0.32)},
                 65536: {"chunk": (0.20, 0.57, 1.237), "piece": (0.21, 0.25, 1.30)}},
}


def one_get(ns, how: str, kb: bytes, n: int, piece_keys: int, sent: list,
            sim: dict | None = None) -> dict:
    """One get's requests as a CUDA get sends them (kvtier.gpu.transfer.get_async), nothing
    moved (or a simulated GPU's moves: sim, a SIMS entry's of the block); its event times
    (s, from its entry) and request ids."""
    from kvtier.api import pipeline
    pc = time.perf_counter
    c = ns._client
    replies: list = []
    spans: list = []
    gpu = [0.0]                 # the simulated stream's end (s, from t0)
    extra = {"tier": "host", "device": None}
    del sent[:]
    t0 = pc()

    def on_reply(rep, at) -> None:
        replies.append(pc() - t0)
        s = rep.slots[rep.found]
        spans.append(int(s.max()) - int(s.min()) + 1 if s.size else 0)
        if sim is not None:
            first = len(replies) == 1
            launch, per_launch, per_move = sim["piece" if how == "sorted" and not first
                                              else "chunk"]
            k = rep.slots.size / 1024
            end = pc() + (launch if first else per_launch * k) * 1e-3
            while pc() < end:
                pass
            gpu[0] = max(gpu[0], end - t0) + per_move * k * 1e-3
    if how == "sorted":
        found, leases, error, _m = pipeline.lease_sorted(ns, kb, n, on_reply, extra, piece_keys)
    else:
        found, leases, error, _m = pipeline.lease(ns, kb, n, on_reply, extra, None, None, ())
    total = max(pc() - t0, gpu[0])
    if error is not None or not found.all():
        raise RuntimeError(f"{how} get failed: {error!r}, found {int(found.sum())} of {n}")
    for lease in leases:
        c._release_later(lease)
    return {"t0": t0, "total": total, "reply": replies, "span": spans, "ids": list(sent)}


def run_serve(blocks: list[int], n: int, gets: int, gap_ms: float, tree: str,
              sim: str = "") -> dict:
    """--serve: chunked and sorted gets alternated on one connection (see the docstring)."""
    from kvtier import Client
    from kvtier.gpu.plan import TransferPolicy
    work = tempfile.mkdtemp(prefix="kvtier-getserve-")
    spath = os.path.join(work, "serve.times")
    svc = start_serve(tree, work, spath)
    piece_keys = TransferPolicy().sorted_piece_keys
    evs: dict = {}
    try:
        c = Client(svc.socket)
        sent: list = []
        send = c._send

        def send_logged(op, args, piggyback=True):
            rid = send(op, args, piggyback)
            sent.append(rid)
            return rid
        c._send = send_logged
        for block in blocks:
            ns = c.namespace(f"rows{block}", block_bytes=block)
            keys = b"".join((i + 1).to_bytes(16, "big") for i in range(n))
            ns.put(keys, np.random.default_rng(0).integers(0, 255, (n, block), np.uint8))
            order = np.random.default_rng(block).permutation(n)     # bench/gpu.py's
            kb = b"".join(keys[16 * i:16 * i + 16] for i in order)
            for k in range(gets + 5):
                for how in HOWS if k % 2 == 0 else HOWS[::-1]:
                    ev = one_get(ns, how, kb, n, piece_keys, sent,
                                 SIMS[sim][block] if sim else None)
                    if k >= 5:
                        evs.setdefault((block, how), []).append(ev)
                    # The GPU's wait between two gets, slept: on the 2-core dev VM a spin
                    # takes the core the service needs (the service's loop sleeps either way).
                    time.sleep(gap_ms * 1e-3)
        c.close()
    finally:
        svc.stop()
    import json
    with open(spath) as f:
        served_by = json.load(f)["kvtier"]
    out: dict = {"n": n, "gets": gets, "gap_ms": gap_ms, "tree": tree, "sim": sim,
                 "serve_kvtier": served_by, "piece_keys": piece_keys}
    for (block, how), ev in sorted(evs.items()):
        out[f"{how}_{block // 1024}k"] = serve_rows(ev, spath)
    return out


def serve_rows(evs: list, spath: str) -> dict:
    """Medians over a kind's gets (ms): its replies' arrival, its total, each reply's slot
    span, and per request in the service (bench/put_control.serve_split over the hooks'
    rows: arrival to reply written, the wait, the dispatch, the write, when written)."""
    from bench.put_control import serve_split
    med = lambda v: np.round(np.median(np.array(v, dtype=float) * 1e3, 0), 4).tolist()  # noqa: E731
    totals = [e["total"] for e in evs]
    out = {"total_ms": round(float(np.median(totals)) * 1e3, 4),
           "total_ms_p10_p90": [round(float(np.percentile(totals, q)) * 1e3, 4)
                                for q in (10, 90)],
           "reply_at_ms": med([e["reply"] for e in evs]),
           "slot_span": np.median(np.array([e["span"] for e in evs]), 0).astype(int).tolist()}
    split = serve_split(spath, [(None, e) for e in evs])
    out["serve_gets"] = split.pop("serve_puts")
    split.pop("serve_kvtier", None)
    return {**out, **split}


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
    ap.add_argument("--serve", action="store_true",
                    help="chunked against sorted gets, each request's time in the service")
    ap.add_argument("--blocks", default="16384,65536", help="--serve's block sizes")
    ap.add_argument("--sim", default="", choices=["", *SIMS],
                    help="--serve: the client's launches and the GPU's moves simulated (SIMS)")
    ap.add_argument("--tree", default=ROOT,
                    help="--serve: the kvtier tree the client and the service run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = header("bench/get_control.py")
    if args.serve:
        tree = os.path.abspath(args.tree)
        sys.path.insert(0, tree)          # kvtier from there, the harness from here
        res = run_serve([int(b) for b in args.blocks.split(",")], args.n, args.gets,
                        args.gap_ms, tree, args.sim)
        res["loadavg"] = os.getloadavg()[0]
        res["machine"] = m
        emit(res, args.json)
        return
    res = run(args.block, args.n, args.gets, args.trace, args.chunk, args.gap_ms, args.nvme)
    res["loadavg"] = os.getloadavg()[0]
    res["machine"] = m
    emit(res, args.json)


if __name__ == "__main__":
    main()
