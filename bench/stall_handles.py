"""The loop's callbacks per NVMe get: what one reader's get costs the service's loop in separate
pieces of work (issue 17, stall6), counted, not timed.

    python bench/stall_handles.py --json
    python bench/stall_handles.py --gets 10 --json                 # the smoke run

A kvtier Server over a real engine, in this process on asyncio's loop (uvloop's callbacks are
not Python objects to count), answers one connection's gets of 64 random 4 KiB blocks held on
NVMe only (the host tier is emptied after each). For each get, from its send to its reply, the
loop's callbacks (asyncio Handle runs: a socket's read, a task's step or wake-up, a step of the
StepRunner, a read's reap, a future's done callback) are counted and named. Each is a piece of
work a resident get's frame can wait behind: the loop polls between batches of them. The
client's own recv runs in the loop's executor, so each count holds its two callbacks (the
future's state passed over, its task's wake-up); the loop thread's CPU time per get is given
beside, for what it is worth on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import socket
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header  # noqa: E402


def key(i: int) -> bytes:
    return (i + 1).to_bytes(16, "big")


def _name(handle: asyncio.Handle) -> str:
    cb = handle._callback
    cb = getattr(cb, "func", cb)
    name = getattr(cb, "__qualname__", type(cb).__name__)
    return name.replace(".<locals>", "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gets", type=int, default=100, help="counted gets (after 20 warm ones)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = header("bench/stall_handles.py")
    from kvtier.api import protocol as P
    from kvtier.api.connection import Connection
    from kvtier.api.server import Server
    from kvtier.coherence.engine import Engine
    from kvtier.config import make_settings
    from kvtier.types import Tier

    base = tempfile.mkdtemp(prefix="kvtier-stall-handles-", dir=os.getcwd())
    settings = make_settings({"data_dir": base, "host_capacity": "4MiB",
                              "nvme_capacity": "64MiB", "busy_poll_us": 0})
    eng = Engine(settings)
    cold = 512
    eng.create_namespace("m", 4096)
    data = np.random.default_rng(0).integers(0, 256, (64, 4096), dtype=np.uint8)
    for lo in range(0, cold, 64):
        eng.put("m", b"".join(key(i) for i in range(lo, lo + 64)), data)
    eng.flush()
    eng.evict(Tier.HOST, 1 << 30)
    names: list[str] = []
    run = asyncio.events.Handle._run

    def counted(handle: asyncio.Handle) -> None:
        names.append(_name(handle))
        return run(handle)

    counts: list[int] = []
    cpu: list[float] = []
    kinds: collections.Counter = collections.Counter()

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = Server(eng, settings)
        mine, theirs = socket.socketpair()
        await loop.connect_accepted_socket(lambda: Connection(server), theirs)
        rng = np.random.default_rng(1)
        try:
            for i in range(20 + args.gets):
                ks = b"".join(key(int(k)) for k in rng.choice(cold, 64, replace=False))
                names.clear()
                c0 = time.thread_time()
                mine.sendall(P.pack({"id": i, "op": "get", "ns": "m", "keys": ks}))
                r = await loop.run_in_executor(None, P.recv_frame, mine)
                c1, seen = time.thread_time(), list(names)
                if not r["ok"] or r["found"] != b"\x01" * 64:
                    raise SystemExit(f"the get failed: {r}")
                mine.sendall(P.pack({"id": -1, "op": "release", "lease": r["lease"]}))
                await loop.run_in_executor(None, P.recv_frame, mine)
                eng.evict(Tier.HOST, 1 << 30)
                if i >= 20:
                    counts.append(len(seen))
                    cpu.append(c1 - c0)
                    kinds.update(seen)
        finally:
            await server.stop()
            mine.close()

    asyncio.events.Handle._run = counted
    try:
        asyncio.run(serve())
    finally:
        asyncio.events.Handle._run = run
        shutil.rmtree(base, ignore_errors=True)
    out = {"gets": args.gets, "batch": 64, "block_bytes": 4096,
           "callbacks_per_get_p50": float(np.median(counts)),
           "callbacks_per_get_max": int(max(counts)),
           "by_kind_per_get": {k: round(v / args.gets, 2) for k, v in kinds.most_common()},
           "loop_cpu_per_get_p50_us": round(float(np.median(cpu)) * 1e6, 1),
           "loadavg": round(os.getloadavg()[0], 2), "machine": m}
    emit(out, args.json)


if __name__ == "__main__":
    main()
