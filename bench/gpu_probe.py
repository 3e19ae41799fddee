"""Where a small-page GPU get's or put's time goes, step by step (issue 16's 64 / 16 KiB rows).

bench/gpu.py's onboard timeline gives each chunk's reply and GPU span; this probe logs every
step of the client's side on one time axis: each request sent and each reply read, each
Mover step (move, _staged, _launch, _copy, upload, event) entered and left, the GPU hash,
each commit sent, and the GPU time at which each of the transfer's events completed (a timing
event recorded beside it, placed on the host's axis through one recorded when the Mover was
made). Cases: 4,096 blocks of 16 KiB and of 64 KiB in bench/gpu.py's shuffled order, onboard
(the chunked get; and the sorted get, sorted_gets="on") and offload. For each case the
median repetition (by time to wait()'s return) is printed step by step, ms from the call, and
every repetition is kept in the JSON.

    python bench/gpu_probe.py [--reps 11] [--json]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header  # noqa: E402

LOG: list[tuple[str, float]] = []
GPU: list[tuple[str, object]] = []      # (label, cupy event) resolved after the call
ZERO: list[tuple[float, object]] = []   # (host time, event) recorded at the Mover's making


def _stream_of(mover) -> object:
    return mover.stream.cupy


def instrument(client) -> None:
    """Wrap the client's and the GPU path's steps with log entries (this process only)."""
    import cupy
    from kvtier.gpu import device, staging, transfer

    def steps(owner, names: tuple[str, ...], tag: str) -> None:
        """Each of owner's (a class or a module) functions names logged entered and left."""
        for name in names:
            fn = getattr(owner, name)

            @functools.wraps(fn)
            def wrapped(*a, __fn=fn, __label=f"{tag}{name}", **k):
                LOG.append((f"{__label}>", time.perf_counter()))
                try:
                    return __fn(*a, **k)
                finally:
                    LOG.append((f"{__label}<", time.perf_counter()))
            setattr(owner, name, wrapped)

    steps(device.Mover, ("move", "_staged", "_launch", "_copy", "_staged_out", "stage_sorted",
                         "_sorted", "_place"), "mover.")
    steps(staging.Staging, ("upload",), "staging.")
    steps(transfer, ("_hash", "_commit"), "")
    move = device.Mover.move

    def move_marked(self, *a, **k):
        move(self, *a, **k)
        ev = cupy.cuda.Event()              # after the move, on the stream it last used
        ev.record(self._work.cupy)
        GPU.append((f"gpu: move {sum(1 for g in GPU if g[0].startswith('gpu: move'))} done",
                    ev))
    device.Mover.move = move_marked

    init = device.Mover.__init__

    def mover_init(self, *a, **k):
        init(self, *a, **k)
        ev = cupy.cuda.Event()
        ev.record(_stream_of(self))
        ZERO.append((time.perf_counter(), ev))
        LOG.append(("mover made", time.perf_counter()))
    device.Mover.__init__ = mover_init

    event = device.Mover.event

    def mover_event(self):
        e = event(self)
        ev = cupy.cuda.Event()
        ev.record(_stream_of(self))
        GPU.append((f"gpu: event {sum(1 for g in GPU if g[0].startswith('gpu: event'))} done",
                    ev))
        return e
    device.Mover.event = mover_event

    send, reply = client._send, client._reply

    def sent(op, *a, **k):
        rid = send(op, *a, **k)
        LOG.append((f"sent {op}", time.perf_counter()))
        return rid

    def replied(rid, *a, **k):
        LOG.append(("reply wait>", time.perf_counter()))
        try:
            return reply(rid, *a, **k)
        finally:
            LOG.append(("reply read<", time.perf_counter()))
    client._send, client._reply = sent, replied


def one(call) -> tuple[float, list[tuple[str, float]]]:
    """call() -> a handle; its wait(); the steps in ms from the call."""
    import cupy
    import torch
    torch.cuda.synchronize()
    LOG.clear()
    GPU.clear()
    ZERO.clear()
    t0 = time.perf_counter()
    h = call()
    LOG.append(("returned", time.perf_counter()))
    h.wait()
    t1 = time.perf_counter()
    LOG.append(("wait returned", t1))
    torch.cuda.synchronize()
    rows = [(label, (t - t0) * 1e3) for label, t in LOG]
    if ZERO:
        host0, ev0 = ZERO[0]
        for label, ev in GPU:
            ms = cupy.cuda.get_elapsed_time(ev0, ev)
            rows.append((label, (host0 - t0) * 1e3 + float(ms)))
    rows.sort(key=lambda r: r[1])
    return (t1 - t0) * 1e3, [(label, round(ms, 4)) for label, ms in rows]


def case(name: str, call, reps: int) -> dict:
    runs = [one(call) for _ in range(reps)]
    runs.sort(key=lambda r: r[0])
    total, steps = runs[len(runs) // 2]
    print(f"## {name}: median {total:.3f} ms (of {[round(r[0], 3) for r in runs]})",
          file=sys.stderr)
    last = 0.0
    for label, ms in steps:
        print(f"  {ms:8.4f}  +{ms - last:7.4f}  {label}", file=sys.stderr)
        last = ms
    return {"median_ms": round(total, 4), "all_ms": [round(r[0], 4) for r in runs],
            "median_steps": steps}


def layerwise(c, reps: int) -> dict:
    """bench/gpu.py's layer-wise overlap (1,024 blocks as 32 per-layer pages of 64 KiB, rows
    permuted) under the default policy and under copy engines for every page (no staging
    placement kernel on the SMs the compute uses), alternated, each in the same process."""
    import torch
    from bench.gpu import LAYERS, namespace, overlap
    from kvtier.api.layouts import Pages
    from kvtier.gpu import transfer
    from kvtier.gpu.plan import TransferPolicy
    n, page = 1024, 65536
    ns = namespace(c, "layers", LAYERS * page)
    keys = b"".join((i + 1).to_bytes(16, "big") for i in range(n))
    caches = [torch.randint(0, 255, (n, page), dtype=torch.uint8, device="cuda")
              for _ in range(LAYERS)]
    rows = np.random.default_rng(7).permutation(n)
    dst = Pages.from_layers([torch.zeros_like(t) for t in caches])
    torch.cuda.synchronize()
    ns.put_async(keys, Pages.from_layers(caches), rows=rows).wait()
    out: dict = {}
    for rnd in range(2):
        for name, pol in (("default", None), ("copy_engines", TransferPolicy(copy_engine_bytes=0))):
            transfer.set_policy(pol)
            try:
                r = overlap(ns, keys, dst, rows, reps)
            finally:
                transfer.set_policy(None)
            out.setdefault(name, []).append(r)
            print(f"## layerwise {name} round {rnd}: {r}", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-layers", action="store_true", help="skip the layer-wise overlaps")
    args = ap.parse_args()
    m = header("bench/gpu_probe.py")
    import torch
    import kvtier
    from bench.gpu import ceilings, namespace, scattered_rows
    from kvtier.gpu import transfer, warm
    from kvtier.gpu.plan import TransferPolicy
    from tests.service import Service
    warm()
    out = {"machine": m, **ceilings(3)}
    work = tempfile.mkdtemp(prefix="kvtier-probe-")
    svc = Service(os.path.join(work, "svc"), admin=False, host_capacity="4GiB",
                  nvme_capacity="0").start()
    try:
        with kvtier.Client(str(svc.socket), timeout=300) as c:
            instrument(c)
            for bb, tag in ((16384, "16k"), (65536, "64k")):
                ns = namespace(c, f"probe{tag}", bb)
                src, _order, kb, rows = scattered_rows(ns, bb, 4096)
                dst = torch.zeros_like(src)
                stream = torch.cuda.Stream()
                torch.cuda.synchronize()
                get = lambda: ns.get_async(kb, out=dst, rows=rows, stream=stream)  # noqa: E731
                put = lambda: ns.put_async(kb, src, rows=rows, stream=stream)     # noqa: E731
                for _ in range(3):
                    get().wait()
                    put().wait()
                out[f"onboard_{tag}"] = case(f"onboard {tag}", get, args.reps)
                transfer.set_policy(TransferPolicy(sorted_gets="on"))
                try:
                    get().wait()
                    out[f"onboard_sorted_{tag}"] = case(f"onboard sorted {tag}", get, args.reps)
                finally:
                    transfer.set_policy(None)
                out[f"offload_{tag}"] = case(f"offload {tag}", put, args.reps)
            if not args.no_layers:
                out["layerwise"] = layerwise(c, 5)
    finally:
        svc.stop()
    emit(out, args.json)


if __name__ == "__main__":
    main()
