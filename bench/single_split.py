"""Where a single-block get's time goes, piece by piece, without a profiler (its overhead is
most of what it would measure).

    python bench/single_split.py [--json] [--cuda] [--quick]

1. in process, no socket: the service's dispatch of a one-key host get and of a hello, and
   the engine's lease and release, timed step by step (median of 20,000);
2. the transport: a bare Python echo over a Unix socketpair between two processes, both
   spinning, against kvtier's ping (hello) and host get through a real `kvtier serve`;
3. with --cuda, the client's GPU steps: torch's current stream, cupy's device context, a
   64 KiB pinned-to-device copy, an event's record and synchronize.
Medians in microseconds; compare within one run. --quick: 200 repetitions and 256-key batches
(the CI smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header  # noqa: E402


REPS = 5000      # --quick: 200


def timed(fn, n: int = 0) -> float:
    n = n or REPS
    ts = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter_ns()
        fn(i)
        ts[i] = time.perf_counter_ns() - t0
    return round(float(np.median(ts)) / 1e3, 2)


def in_process() -> dict:
    from kvtier.api import protocol as P
    from kvtier.api.quota import ClientInfo
    from kvtier.api.server import Server
    from kvtier.coherence.engine import Engine
    from kvtier.config import make_settings
    from kvtier.types import Tier
    d = tempfile.mkdtemp(prefix="kvtier-split-")
    s = make_settings({"data_dir": d, "host_capacity": "64MiB", "nvme_capacity": "0"})
    eng = Engine(s)
    eng.create_namespace("p", 65536, 16, None)
    keys = [(i + 1).to_bytes(16, "big") for i in range(64)]
    eng.put("p", b"".join(keys), np.random.default_rng(0).integers(0, 255, (64, 65536),
                                                                     dtype=np.uint8))
    srv = Server(eng, s)
    cl = ClientInfo(1, 1, 0)
    ns = eng.namespace("p")
    karr = eng.check_keys(ns, keys[0], zero_check=False)
    out: dict = {}
    pend: list[int] = []

    def dispatch(i: int) -> None:
        body = {"id": i, "op": "get", "ns": "p", "keys": keys[i % 64]}
        if pend:
            body["release_first"] = np.array(pend, "<u8").tobytes()
            pend.clear()
        rep = srv._dispatch(cl, P.pack(body)[4:])
        P.pack(rep[0])
        pend.append(rep[0]["lease"])

    async def in_loop() -> float:
        # The service's loop runs what a reply deferred (call_soon) before the next frame:
        # here after each timed dispatch, outside the timing.
        ts = np.empty(REPS)
        for i in range(ts.size):
            t0 = time.perf_counter_ns()
            dispatch(i)
            ts[i] = time.perf_counter_ns() - t0
            await asyncio.sleep(0)
        return round(float(np.median(ts)) / 1e3, 2)
    out["dispatch_get_us"] = asyncio.run(in_loop())
    hello = P.pack({"id": 1, "op": "hello", "version": P.PROTOCOL_VERSION, "client": "x"})[4:]
    out["dispatch_hello_us"] = timed(lambda i: P.pack(srv._dispatch(cl, hello)[0]))

    def engine(i: int) -> None:
        r = eng.try_get("p", keys[i % 64], 1)
        eng.release_many([r.lease_id], 1)
    out["engine_get_release_us"] = timed(engine)

    def one(i: int) -> None:
        r = eng.fast.get_one(ns, karr, 1, Tier.HOST)
        eng.release_many([r.lease_id], 1)
    out["engine_get_one_release_us"] = timed(one)
    out["table_lookup_us"] = timed(lambda i: ns.table.lookup(karr))
    out["check_keys_us"] = timed(lambda i: eng.check_keys(ns, keys[0], zero_check=False))
    req = P.pack({"id": 1, "op": "get", "ns": "p", "keys": keys[0]})[4:]
    out["unpack_us"] = timed(lambda i: P.unpack(req))
    # the general path's steps (server.op_get, _get_reply, _release_first)
    from kvtier.api.server import _slot_tier
    r = {"id": 1, "op": "get", "ns": "p", "keys": keys[0]}
    out["step_slot_tier_us"] = timed(lambda i: _slot_tier(r))
    out["step_pins_check_us"] = timed(lambda i: cl.pins.check(ns, keys[0], 0.5))
    res = eng.try_get("p", keys[0], 1)
    out["step_get_reply_us"] = timed(lambda i: srv._get_reply(cl, "p", keys[0], res, False))
    out["step_arr4_us"] = timed(lambda i: [P.arr(a, d) for a, d in (
        (res.found, "u1"), (res.slots, "<i4"), (res.versions, "<u8"), (res.checksums, "<u8"))])
    rf = {"release_first": np.array([5], "<u8").tobytes()}
    out["step_release_arg_us"] = timed(lambda i: P.array_arg(rf, "release_first", "<u8").tolist())
    out["step_monotonic_us"] = timed(lambda i: time.monotonic())
    out["step_np_array1_us"] = timed(lambda i: np.array([i], dtype=np.int64))
    out["step_lock_us"] = timed(lambda i: srv._fast(int, 1))
    if hasattr(eng, "lease_one"):
        def lease_one(i: int) -> None:
            h = eng.lease_one(ns, keys[i % 64], 1)
            eng.release_many([h[0]], 1)
        out["engine_lease_one_release_us"] = timed(lease_one)

        def resident(i: int) -> None:
            o = srv._get_one_resident(cl, "p", keys[i % 64])
            cl.pins.end([o["lease"]])
            eng.release_many([o["lease"]], 1)
        out["step_get_one_resident_release_us"] = timed(resident)
    # pure Python speed: a loop of 1,000 additions
    out["py_loop_1000_us"] = timed(lambda i: sum(range(1000)))
    out["os_getppid_us"] = timed(lambda i: os.getppid())
    eng.close(flush=False)
    return out


def batch(n: int = 4096, rounds: int = 30) -> dict:
    """A 4,096-key rewrite's reserve and commit (trusted checksums, as a CUDA put sends) and
    a 4,096-key resident get: the engine alone, then the service's dispatch of the same
    requests in its loop (with its thread hop), then msgpack's share."""
    from kvtier.api import protocol as P
    from kvtier.api.quota import ClientInfo
    from kvtier.api.server import Server
    from kvtier.coherence.engine import Engine
    from kvtier.config import make_settings
    d = tempfile.mkdtemp(prefix="kvtier-split-")
    s = make_settings({"data_dir": d, "host_capacity": "512MiB", "nvme_capacity": "0"})
    eng = Engine(s)
    eng.create_namespace("b", 16384, 16, None)
    kb = b"".join((i + 1).to_bytes(16, "big") for i in range(n))
    sums = np.random.default_rng(1).integers(0, 2**63, n, dtype=np.uint64)
    eng.put("b", kb, np.zeros((n, 16384), np.uint8))
    srv = Server(eng, s)
    cl = ClientInfo(1, 1, 0)
    out: dict = {}

    def med(fn) -> float:
        ts = []
        for _ in range(rounds):
            t0 = time.perf_counter_ns()
            fn()
            ts.append(time.perf_counter_ns() - t0)
        return round(float(np.median(ts)) / 1e3, 1)
    t_res, t_com = [], []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        rid = eng.reserve("b", kb, None).rid
        t1 = time.perf_counter_ns()
        eng.commit(rid, 0, sums, True)
        t_com.append(time.perf_counter_ns() - t1)
        t_res.append(t1 - t0)
    out["batch_engine_reserve_us"] = round(float(np.median(t_res)) / 1e3, 1)
    out["batch_engine_commit_us"] = round(float(np.median(t_com)) / 1e3, 1)
    out["batch_engine_get_release_us"] = med(
        lambda: eng.release_many([eng.try_get("b", kb).lease_id]))

    async def service() -> None:
        async def call(body: dict) -> dict:
            r = srv._dispatch(cl, P.pack(body)[4:])
            if not isinstance(r, tuple):
                r = await r
            P.pack(r[0])
            return r[0]
        t_res, t_com, t_get = [], [], []
        for i in range(rounds):
            t0 = time.perf_counter_ns()
            r = await call({"id": i, "op": "reserve", "ns": "b", "keys": kb})
            t1 = time.perf_counter_ns()
            await call({"id": i, "op": "commit", "rid": r["rid"], "checksums": sums.tobytes(),
                        "trusted": True})
            t2 = time.perf_counter_ns()
            g = await call({"id": i, "op": "get", "ns": "b", "keys": kb})
            t3 = time.perf_counter_ns()
            await call({"id": i, "op": "release", "lease": g["lease"]})
            t_res.append(t1 - t0)
            t_com.append(t2 - t1)
            t_get.append(t3 - t2)
        out["batch_dispatch_reserve_us"] = round(float(np.median(t_res)) / 1e3, 1)
        out["batch_dispatch_commit_us"] = round(float(np.median(t_com)) / 1e3, 1)
        out["batch_dispatch_get_us"] = round(float(np.median(t_get)) / 1e3, 1)
    asyncio.run(service())
    body = {"id": 1, "op": "commit", "rid": 5, "checksums": sums.tobytes(), "trusted": True}
    packed = P.pack(body)
    out["batch_pack_commit_us"] = med(lambda: P.pack(body))
    out["batch_unpack_commit_us"] = med(lambda: P.unpack(packed[4:]))
    eng.close(flush=False)
    return out


def _echo(sock: socket.socket) -> None:
    sock.setblocking(False)
    while True:
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            continue
        if not data:
            return
        sock.send(data)


def transport(n: int = 0) -> dict:
    n = n or REPS
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        a.close()
        _echo(b)
        os._exit(0)
    b.close()
    a.setblocking(False)
    msg = b"x" * 120

    def rtt(i: int) -> None:
        a.send(msg)
        while True:
            try:
                if a.recv(65536):
                    return
            except BlockingIOError:
                pass
    t = timed(rtt, n)
    a.close()
    os.waitpid(pid, 0)
    return {"socketpair_spin_rtt_us": t}


def service(cuda: bool, n: int = 0) -> dict:
    import kvtier
    n = n or min(REPS, 3000)
    from tests.service import Service
    work = tempfile.mkdtemp(prefix="kvtier-split-")
    extra = {"hbm_capacity": "256MiB"} if cuda else {}
    svc = Service(os.path.join(work, "svc"), admin=False, host_capacity="256MiB",
                  nvme_capacity="0", **extra).start()
    out: dict = {}
    try:
        with kvtier.Client(str(svc.socket)) as c:
            ns = c.namespace("p", block_bytes=65536)
            keys = [(i + 1).to_bytes(16, "big") for i in range(64)]
            ns.put(b"".join(keys), np.random.default_rng(0).integers(0, 255, (64, 65536),
                                                                      dtype=np.uint8))
            host = np.empty((1, 65536), np.uint8)
            for _ in range(2):
                out["ping_us"] = timed(lambda i: c.ping(), n)
                out["host_get_us"] = timed(lambda i: ns.get(keys[i % 64], out=host), n)
                out["raw_get_call_us"] = timed(lambda i: c._release_later(
                    c._call("get", ns="p", keys=keys[i % 64])["lease"]), n)
            if cuda:
                import torch
                dev = torch.empty(1, 65536, dtype=torch.uint8, device="cuda")
                for k in keys:
                    ns.get(k, out=dev)
                out["cuda_get_us"] = timed(lambda i: ns.get(keys[i % 64], out=dev), n)
                out["host_get_again_us"] = timed(lambda i: ns.get(keys[i % 64], out=host), n)
                out["cuda_get_again_us"] = timed(lambda i: ns.get(keys[i % 64], out=dev), n)
    finally:
        svc.stop()
    return out


def cuda_steps() -> dict:
    import cupy
    import torch
    out: dict = {}
    out["torch_current_stream_us"] = timed(lambda i: torch.cuda.current_stream(0).cuda_stream)
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        out["torch_raw_stream_us"] = timed(lambda i: raw(0))

    def ctx(i: int) -> None:
        with cupy.cuda.Device(0):
            pass
    out["cupy_device_ctx_us"] = timed(ctx)
    host = torch.empty(65536, dtype=torch.uint8).pin_memory()
    dev = torch.empty(65536, dtype=torch.uint8, device="cuda")
    s = torch.cuda.current_stream(0).cuda_stream
    ev = cupy.cuda.Event(block=False, disable_timing=True)
    st = cupy.cuda.ExternalStream(s)
    hp, dp = host.data_ptr(), dev.data_ptr()
    out["memcpy_async_enqueue_us"] = timed(
        lambda i: cupy.cuda.runtime.memcpyAsync(dp, hp, 65536, 4, s), 2000)
    torch.cuda.synchronize()

    def rec_sync(i: int) -> None:
        ev.record(st)
        ev.synchronize()
    out["event_record_sync_us"] = timed(rec_sync)

    def copy_sync(i: int) -> None:
        cupy.cuda.runtime.memcpyAsync(dp, hp, 65536, 4, s)
        ev.record(st)
        ev.synchronize()
    out["copy64k_event_sync_us"] = timed(copy_sync)

    def copy_stream_sync(i: int) -> None:
        cupy.cuda.runtime.memcpyAsync(dp, hp, 65536, 4, s)
        cupy.cuda.runtime.streamSynchronize(s)
    out["copy64k_stream_sync_us"] = timed(copy_stream_sync)
    evb = cupy.cuda.Event(block=True, disable_timing=True)

    def copy_block(i: int) -> None:
        cupy.cuda.runtime.memcpyAsync(dp, hp, 65536, 4, s)
        evb.record(st)
        evb.synchronize()
    out["copy64k_blocking_event_us"] = timed(copy_block, 3000)

    def copy_query(i: int) -> None:
        cupy.cuda.runtime.memcpyAsync(dp, hp, 65536, 4, s)
        ev.record(st)
        while not ev.done:
            pass
    out["copy64k_event_query_us"] = timed(copy_query)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--quick", action="store_true", help="few repetitions, small batches")
    args = ap.parse_args()
    global REPS
    if args.quick:
        REPS = 200
    m = header("bench/single_split.py")
    out = {**in_process(), **transport(),
           **(batch(256, 3) if args.quick else batch())}
    if args.cuda:
        import torch
        torch.cuda.init()
        out.update(cuda_steps())
    out.update(service(args.cuda))
    out["machine"] = m
    emit(out, args.json)


if __name__ == "__main__":
    main()
