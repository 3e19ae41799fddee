"""An NVMe reader's loop slices in process: bench/stall.py's readers against a Server on its own
event loop, with no socket (issue 17's stall, stall12).

    python bench/stall_dispatch.py --json
    python bench/stall_dispatch.py --cold-blocks 512 --host-capacity 8MiB --gets 30 --json  # smoke

Each reader is a Connection whose transport is a stub: its frames (64 random cold keys, the
lease of its previous get piggybacked as release_first, as a worker's ns.get sends them) go to
data_received, and each reply written sends its next frame on the loop's next iteration, as a
socket would. Everything else is the service's: the dispatch, its Later turn in the step
queue, the reply's task, the steps, the C reader threads. Timed, on the loop thread: every
slice of the step queue by kind (wall and the thread's CPU time; "_later" is a reader's
dispatch), every data_received, and the loop thread's CPU per reader get over the measured
phase (every slice, task step and callback of the loop: what the readers cost it in all; busy
polling off, or its spinning would be most of it).
The service's own figures are bench/stall_trace.py's; these are for pairs of trees, in one
process each, with no probe, sockets or other processes in the way.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header  # noqa: E402
from bench.stall_steps import key, stall_engine  # noqa: E402


class _Transport:
    """A Connection's transport with no socket: each reply goes to on_reply."""

    def __init__(self, on_reply: Any) -> None:
        self.on_reply = on_reply

    def write(self, data: bytes) -> None:
        self.on_reply(data)

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _pct(v: list[float]) -> dict[str, float]:
    a = np.asarray(v) * 1e6
    return {"n": int(a.size), "p50": round(float(np.percentile(a, 50)), 1),
            "p90": round(float(np.percentile(a, 90)), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--block-bytes", type=int, default=64 << 10)
    ap.add_argument("--cold-blocks", type=int, default=4096)
    ap.add_argument("--host-capacity", default="64MiB")
    ap.add_argument("--gets", type=int, default=300, help="timed gets per reader (after 50)")
    ap.add_argument("--inline-dispatch", action="store_true",
                    help="a reader's dispatch deferred only when steps are queued (no probe)")
    ap.add_argument("--no-gc", action="store_true", help="the collector off while measured")
    ap.add_argument("--task-steps", action="store_true",
                    help="time the reply tasks' steps too (pure-Python tasks: slower ones)")
    ap.add_argument("--profile", default="",
                    help="cProfile the measured phase into this file (pstats)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = header("bench/stall_dispatch.py")
    import gc

    from kvtier.api import protocol as P
    from kvtier.api import steps as S
    from kvtier.api.connection import Connection
    from kvtier.api.quota import ClientInfo
    from kvtier.api.server import Server
    base = tempfile.mkdtemp(prefix="kvtier-stall-dispatch-", dir=os.getcwd())
    # No busy polling: its spinning would be most of the loop's CPU (loop_cpu_per_get).
    eng = stall_engine(base, args, busy_poll_us=0)
    pc, tt = time.perf_counter, time.thread_time
    slices: dict[str, list[tuple[float, float]]] = {}
    drs: list[tuple[float, float]] = []
    state = {"on": False, "gets": 0}
    import cProfile
    prof = cProfile.Profile() if args.profile else None

    orig_next = S.StepRunner._next

    def timed_next(self: Any) -> None:
        fn = self._queue[0][0] if self._queue else None
        c0, t0 = tt(), pc()
        orig_next(self)
        if state["on"]:
            name = getattr(getattr(fn, "func", None), "__name__", "?")
            slices.setdefault(name, []).append((pc() - t0, tt() - c0))
    S.StepRunner._next = timed_next

    class TimedTask(asyncio.tasks._PyTask):     # type: ignore[name-defined, misc]
        """A task whose steps are timed as slices: "task:start" (its first step, up to its
        first await), "task:end" (its last, which writes the reply), "task:mid" others."""

        def _Task__step(self, exc: Any = None) -> None:
            first = not getattr(self, "_stepped", False)
            self._stepped = True
            c0, t0 = tt(), pc()
            super()._Task__step(exc)
            if state["on"] and (self.get_name() or "").startswith("reply-"):
                kind = "task:start" if first else ("task:end" if self.done() else "task:mid")
                slices.setdefault(kind, []).append((pc() - t0, tt() - c0))

    def timed(cls: Any, name: str) -> None:
        """cls.name timed as "part:<name>" (inside whichever slice calls it)."""
        orig = getattr(cls, name)

        def f(*a: Any, **k: Any) -> Any:
            c0, t0 = tt(), pc()
            try:
                return orig(*a, **k)
            finally:
                if state["on"]:
                    slices.setdefault(f"part:{name}", []).append((pc() - t0, tt() - c0))
        setattr(cls, name, f)

    if args.task_steps:
        timed(Server, "_get_reply")
        timed(Connection, "_write")
        timed(_Transport, "write")

    async def run() -> dict:
        if args.task_steps:
            asyncio.get_running_loop().set_task_factory(
                lambda loop, coro, **kw: TimedTask(coro, loop=loop, **kw))
        srv = Server(eng, eng.settings)
        if not args.inline_dispatch:
            # As in the service beside the probe, whose frames are often waiting: every
            # reader's dispatch is a Later, a slice of its own ("_later").
            srv._another_waits = lambda own: True
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        total = args.readers * (args.gets + 50)
        count = {"all": 0}

        def reader(i: int) -> None:
            rng = np.random.default_rng(100 + i)
            # The batches drawn before the run: the readers' own work is not the loop's.
            batches = [b"".join(key(int(k)) for k in rng.choice(args.cold_blocks, args.batch,
                                                                 replace=False))
                       for _ in range(args.gets + 50)]
            conn = Connection(srv)
            conn.client = ClientInfo(i + 1, os.getpid(), os.getuid(), name="stall-reader")
            pending: list[int] = []
            rid = [0]

            def send() -> None:
                body = {"id": rid[0] + 1, "op": "get", "ns": "s", "keys": batches[rid[0] % len(batches)]}
                rid[0] += 1
                if pending:
                    body["release_first"] = np.asarray(pending, "<u8").tobytes()
                    pending.clear()
                frame = P.pack(body)
                c0, t0 = tt(), pc()
                conn.data_received(frame)
                if state["on"]:
                    drs.append((pc() - t0, tt() - c0))

            def on_reply(raw: bytes) -> None:
                rep = P.unpack(raw[4:])
                if not rep.get("ok"):
                    done.set_exception(RuntimeError(f"get failed: {rep}"))
                    return
                pending.append(rep["lease"])
                count["all"] += 1
                if count["all"] == args.readers * 50:
                    start()
                if state["on"]:
                    state["gets"] += 1
                if count["all"] >= total:
                    if not done.done():
                        done.set_result(None)
                    return
                loop.call_soon(send)
            conn.transport = _Transport(on_reply)
            send()

        marks: dict[str, float] = {}

        def start() -> None:
            if args.no_gc:
                gc.disable()
            state["on"] = True
            marks["cpu"], marks["wall"] = tt(), pc()
            if prof is not None:
                prof.enable()

        for i in range(args.readers):
            reader(i)
        await done
        cpu, wall = tt() - marks["cpu"], pc() - marks["wall"]
        if prof is not None:
            prof.disable()
            prof.dump_stats(args.profile)
        state["on"] = False
        gc.enable()
        srv.steps.close()
        srv._pool.shutdown(wait=True)
        srv._mem_pool.shutdown(wait=True)
        kinds = {k: {"wall": _pct([x[0] for x in v]), "cpu": _pct([x[1] for x in v])}
                 for k, v in sorted(slices.items())}
        cpu50 = {k: v["cpu"]["p50"] for k, v in kinds.items() if not k.startswith("part:")}
        return {"readers": args.readers, "batch": args.batch, "cold_blocks": args.cold_blocks,
                "gets": state["gets"], "slices": kinds,
                "data_received": {"wall": _pct([x[0] for x in drs]),
                                  "cpu": _pct([x[1] for x in drs])},
                "longest_cpu_p50": max(cpu50.items(), key=lambda kv: kv[1]),
                "sum_cpu_p50_us": round(sum(cpu50.values()), 1),
                "loop_cpu_per_get_us": round(cpu / max(1, state["gets"]) * 1e6, 1),
                "wall_per_get_us": round(wall / max(1, state["gets"]) * 1e6, 1)}

    try:
        try:
            import uvloop                  # the service's loop (kvtier.cli)
            out = uvloop.run(run())
        except ImportError:
            out = asyncio.run(run())
    finally:
        eng.close(flush=False)
        shutil.rmtree(base, ignore_errors=True)
    out["machine"] = m
    emit(out, args.json)


if __name__ == "__main__":
    main()
