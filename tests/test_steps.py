"""kvtier.api.steps: a get's locked steps on the event loop, one per loop iteration, with the
loop's sockets polled in between; a step whose lock is taken waits on the memory lane."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvtier.api.steps import StepRunner

LOOPS = ["asyncio"]
try:
    import uvloop
    LOOPS.append("uvloop")
except ImportError:                        # the service runs on asyncio's loop then
    uvloop = None


def _run(kind: str, scenario) -> None:
    loop = uvloop.new_event_loop() if kind == "uvloop" else asyncio.new_event_loop()
    pool = ThreadPoolExecutor(2, thread_name_prefix="test-mem")
    try:
        lock = threading.RLock()
        runner = StepRunner(lock,
                            lambda fn, *a: loop.run_in_executor(pool, fn, *a),
                            lambda fn, *a: loop.run_in_executor(pool, fn, *a))
        loop.run_until_complete(scenario(loop, runner, lock))
    finally:
        pool.shutdown()
        loop.close()


async def _steps_a_and_b(runner: StepRunner, order: list[str], sock: socket.socket) -> None:
    """Two locked steps, A then B, each noting its turn in order; A sends a byte on sock."""
    def a() -> str:
        order.append("A")
        sock.send(b"x")
        return "a"

    def b() -> str:
        order.append("B")
        return "b"

    assert await asyncio.gather(runner._locked(a), runner._locked(b)) == ["a", "b"]


@pytest.mark.parametrize("kind", LOOPS)
def test_a_frame_that_arrives_during_a_step_is_read_before_the_next_step(kind: str):
    async def scenario(loop, runner, lock):
        order: list[str] = []
        r, w = socket.socketpair()
        r.setblocking(False)
        loop.add_reader(r, lambda: (r.recv(16), order.append("frame")))
        try:
            await _steps_a_and_b(runner, order, w)   # a worker's request arrives while A runs
        finally:
            loop.remove_reader(r)
            r.close()
            w.close()
        assert order == ["A", "frame", "B"]
    _run(kind, scenario)


@pytest.mark.parametrize("kind", LOOPS)
def test_a_frame_that_arrives_between_two_steps_is_read_before_the_second(kind: str):
    # The second worker's frame arrives while the loop answers the first's (after its poll):
    # without frames_waiting, the next step ran before the loop polled again.
    import select

    async def scenario(loop, _runner, lock):
        order: list[str] = []
        r1, w1 = socket.socketpair()
        r2, w2 = socket.socketpair()
        for r in (r1, r2):
            r.setblocking(False)
        runner = StepRunner(lock, None, None,
                            lambda: bool(select.select([r1, r2], [], [], 0)[0]))

        def first_frame() -> None:
            r1.recv(16)
            order.append("frame1")
            w2.send(b"y")                     # the probe's request, during frame1's answer

        loop.add_reader(r1, first_frame)
        loop.add_reader(r2, lambda: (r2.recv(16), order.append("frame2")))
        try:
            await _steps_a_and_b(runner, order, w1)
        finally:
            for r in (r1, r2):
                loop.remove_reader(r)
            for x in (r1, w1, r2, w2):
                x.close()
        assert order == ["A", "frame1", "frame2", "B"]
        assert runner.held_back >= 1
    _run(kind, scenario)


@pytest.mark.parametrize("kind", LOOPS)
def test_a_socket_always_readable_holds_each_step_back_once_only(kind: str):
    async def scenario(loop, _runner, lock):
        runner = StepRunner(lock, None, None, lambda: True)
        outs = await asyncio.gather(*(runner._locked(lambda i=i: i) for i in range(5)))
        assert outs == list(range(5))
        assert runner.held_back == 5
    _run(kind, scenario)


@pytest.mark.parametrize("kind", LOOPS)
def test_a_step_whose_lock_is_taken_runs_on_the_memory_lane_once_it_is_free(kind: str):
    async def scenario(loop, runner, lock):
        held, go = threading.Event(), threading.Event()

        def holder() -> None:
            with lock:
                held.set()
                go.wait(10)

        t = threading.Thread(target=holder)
        t.start()
        held.wait(10)
        ran_on: list[str] = []

        def step() -> int:
            ran_on.append(threading.current_thread().name)
            return 7

        fut = runner._locked(step)
        await asyncio.sleep(0.05)
        assert not fut.done()                 # waiting for the lock, off the loop
        go.set()
        assert await fut == 7
        t.join(10)
        assert ran_on and ran_on[0].startswith("test-mem")

        def broken() -> None:
            raise ValueError("bad step")

        with pytest.raises(ValueError, match="bad step"):
            await runner._locked(broken)      # an error reaches the get's steps
    _run(kind, scenario)


def test_a_get_whose_peer_resets_during_its_disk_read_leaves_no_lease(tmp_path):
    # A worker that dies with a reply unread in its socket resets the connection: the server
    # sees connection_lost (and ends the worker's holds) while the worker's NVMe get is still
    # in its steps. The lease that get makes afterwards must end too, not 600 s later at
    # lease_timeout, its host slots pinned until then.
    import time

    import kvtier
    from kvtier.api import protocol as P
    from tests.conftest import blocks, keys
    from tests.service import Service, admin_evict

    svc = Service(tmp_path / "svc", host_capacity="8MiB", nvme_capacity="64MiB",
                  segment_bytes="4MiB").start()
    try:
        with kvtier.Client(svc.socket) as c:
            ns = c.namespace("m", block_bytes=65536)
            ns.put(keys(range(32)), blocks(32, 65536))
            c.flush()
            assert admin_evict(svc.url, svc.data_dir, count=32) == 32   # the get reads NVMe
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(svc.socket))
            s.sendall(P.pack({"op": "hello", "id": 1, "version": P.PROTOCOL_VERSION}))
            time.sleep(0.2)                   # its reply waits unread: close() resets
            s.sendall(P.pack({"op": "get", "id": 2, "ns": "m", "keys": keys(range(32))}))
            s.close()
            deadline = time.monotonic() + 10
            while c.stats()["tiers"]["host"]["blocks"] < 32 and time.monotonic() < deadline:
                time.sleep(0.05)                  # until the get has installed its reads
            assert c.stats()["tiers"]["host"]["blocks"] == 32
            while c.stats()["leases"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.stats()["leases"] == 0
    finally:
        svc.stop()


def _half_on_disk(tmp_path):
    """An engine whose namespace m holds 4 blocks: 0 and 1 resident, 2 and 3 on NVMe only."""
    from kvtier.coherence.engine import Engine
    from kvtier.config import make_settings
    from kvtier.types import Tier
    from tests.conftest import blocks, keys

    eng = Engine(make_settings({"data_dir": str(tmp_path), "host_capacity": "1MiB",
                                "nvme_capacity": "16MiB"}))
    eng.create_namespace("m", 4096)
    data = blocks(4, 4096)
    eng.put("m", keys(range(4)), data)
    eng.flush()
    eng.evict(Tier.HOST, 4)
    eng.read("m", keys(range(2)))
    return eng, data


def _no_lease_left_and_all_readable(eng, data) -> None:
    import numpy as np

    from kvtier.types import Tier
    from tests.conftest import keys

    assert not eng.leases
    assert int(np.asarray(eng.namespace("m").slots[Tier.HOST].leases).sum()) == 0
    found, out = eng.read("m", keys(range(4)))
    assert found.all() and (out == data).all()


def _not_installed(eng, which) -> None:
    """The blocks of keys(which) have no current host copy (a failed read installed none)."""
    from kvtier.types import Tier
    from tests.conftest import keys

    ns = eng.namespace("m")
    rows = ns.table.lookup(keys(which))
    cols = ns.table.cols
    assert (cols["copy_ver"][rows, Tier.HOST] != cols["version"][rows]).all()


def test_a_get_whose_disk_read_raises_leaves_no_lease_and_no_pinned_slot(tmp_path):
    # The read itself raising (a mock: the AIO set closed after io_getevents failed, which
    # cannot be produced on demand here). The get's error reaches the caller, who never sees
    # the lease its steps made for the blocks already resident: that lease must end with the
    # error, not pin those slots until lease_timeout (or for good, in process).
    import errno

    from tests.conftest import keys

    # The C read (tiers.reads.run_batch) fails after its bytes landed in the slots: the
    # mid-way failure, whose slots must go back with nothing installed.
    import kvtier.coherence.gets as G

    eng, data = _half_on_disk(tmp_path)
    try:
        log = eng.namespace("m").log

        def closed(*_a, **_k):
            raise OSError(errno.EBADF, "this AIO context set is closed")

        real, landed = G.run_batch, []

        def read_then_fail(log_, batch):
            real(log_, batch)
            landed.append(batch.requests)
            closed()

        log.read_rows = closed
        log.read = closed
        G.run_batch = read_then_fail
        try:
            with pytest.raises(OSError, match="closed"):
                eng.get("m", keys(range(4)))
        finally:
            G.run_batch = real
        del log.read_rows, log.read
        assert landed in ([], [2])              # [2]: the C read ran (where it applies)
        _not_installed(eng, range(2, 4))
        _no_lease_left_and_all_readable(eng, data)
    finally:
        eng.close(flush=False)


def test_a_get_whose_write_down_raises_after_its_install_leaves_no_lease(tmp_path):
    # The write-down after a get (drain, when eviction wanted dirty blocks written first)
    # raising, e.g. a disk that filled: mocked at that one seam (wanted and drain), since a
    # disk filling between a get's install and its drain cannot be timed here. The caller
    # sees the error and never the lease, so the lease must end with it.
    from kvtier.errors import StorageError
    from tests.conftest import keys

    eng, data = _half_on_disk(tmp_path)
    try:
        def full() -> None:
            raise StorageError("the NVMe tier's disk is full")

        eng.nvme.wanted, eng.nvme.drain = (lambda: True), full
        with pytest.raises(StorageError, match="full"):
            eng.get("m", keys(range(4)))
        del eng.nvme.wanted, eng.nvme.drain
        _no_lease_left_and_all_readable(eng, data)
    finally:
        eng.close(flush=False)


def test_a_reads_segment_pins_end_in_its_install_step_and_on_every_exit(tmp_path):
    # The read's segment pins are ended by the install step (on the loop, under the engine
    # lock), not by the I/O thread after the read; steps abandoned after the read end them
    # too. A pin left behind would keep a reclaimed segment's file for good.
    from kvtier.coherence.gets import advance
    from tests.conftest import keys

    def readers(eng) -> int:
        return sum(seg.readers for seg in eng.namespace("m").log.segments.values())

    for cancel in (False, True):
        eng, data = _half_on_disk(tmp_path / str(cancel))
        try:
            steps = eng.get_steps("m", keys(range(4)), 0)
            step, out = advance(steps, None, None)
            seen, exc = [], None
            with pytest.raises(asyncio.CancelledError) if cancel else contextlib.nullcontext():
                while step is not None:
                    if step.locked:
                        with eng.lock:
                            value = step.fn()
                    else:
                        value = step.fn()
                        seen.append(readers(eng))     # after the read: still pinned
                        if cancel and exc is None:    # the get cancelled during its read
                            exc = asyncio.CancelledError()
                            step, out = advance(steps, None, exc)
                            continue
                    step, out = advance(steps, value, None)
            assert seen and seen[0] > 0
            assert readers(eng) == 0
            if not cancel:
                eng.release(out.lease_id)
            _no_lease_left_and_all_readable(eng, data)
        finally:
            eng.close(flush=False)


@pytest.mark.parametrize("kind", LOOPS)
def test_later_slices_and_locked_steps_run_in_the_order_they_came_with_polls_between(kind):
    # A long request's dispatch (later) is a slice of the same queue as the gets' locked
    # steps: one per loop iteration, in order, a frame that arrives during one read first.
    async def scenario(loop, runner, lock):
        order: list[str] = []
        r, w = socket.socketpair()
        r.setblocking(False)
        loop.add_reader(r, lambda: (r.recv(16), order.append("frame")))
        done = loop.create_future()
        try:
            a = runner._locked(lambda: order.append("A"))
            runner.later(lambda: (order.append("L"), w.send(b"x")))
            b = runner._locked(lambda: order.append("B"))
            runner.later(lambda: (order.append("M"), done.set_result(None)))
            await asyncio.gather(a, b, done)
        finally:
            loop.remove_reader(r)
            r.close()
            w.close()
        assert order == ["A", "L", "frame", "B", "M"]
        assert runner.slices == 4
    _run(kind, scenario)


# ---------------------------------------------------------------- short requests first
# A real Server (a real engine) answering socketpairs on a loop in this process: the order in
# which it runs requests is seen through the engine calls it makes.

def _frame(obj: dict) -> bytes:
    from kvtier.api import protocol as P
    return P.pack(obj)


def _reply(sock: socket.socket) -> dict:
    from kvtier.api import protocol as P
    return P.recv_frame(sock)


def _serve_in_process(tmp_path, kind: str, scenario) -> None:
    """scenario(loop, server, connect) with a Server over a real engine whose namespace m
    holds 16 blocks of 4 KiB: 0-7 resident in the host tier, 8-15 on NVMe only. connect()
    gives a client socket (blocking) of a new connection."""
    from kvtier.api.connection import Connection
    from kvtier.api.server import Server
    from kvtier.coherence.engine import Engine
    from kvtier.config import make_settings
    from kvtier.types import Tier
    from tests.conftest import blocks, keys

    settings = make_settings({"data_dir": str(tmp_path / "data"), "host_capacity": "1MiB",
                              "nvme_capacity": "16MiB", "busy_poll_us": 0})
    eng = Engine(settings)
    eng.create_namespace("m", 4096)
    eng.put("m", keys(range(8, 16)), blocks(8, 4096, seed=1))
    eng.flush()
    eng.evict(Tier.HOST, 8)
    eng.put("m", keys(range(8)), blocks(8, 4096))
    loop = uvloop.new_event_loop() if kind == "uvloop" else asyncio.new_event_loop()
    server = Server(eng, settings)
    clients: list[socket.socket] = []

    async def connect() -> socket.socket:
        mine, theirs = socket.socketpair()
        await loop.connect_accepted_socket(lambda: Connection(server), theirs)
        clients.append(mine)
        return mine

    async def main() -> None:
        try:
            await scenario(loop, server, connect)
        finally:
            await server.stop()

    try:
        loop.run_until_complete(main())
    finally:
        for c in clients:
            c.close()
        loop.close()


@pytest.mark.parametrize("kind", LOOPS)
def test_a_short_get_read_in_the_same_poll_runs_before_a_long_requests_dispatch(tmp_path, kind):
    # The long request's frame is read first (its socket became readable first), yet the
    # short get of the other connection is served before the long one is even looked at:
    # without the Later turn, data_received ran the long get's lookup first.
    from tests.conftest import keys

    async def scenario(loop, server, connect):
        order: list[str] = []
        eng = server.engine
        try_get, lease_one = eng.try_get, eng.lease_one
        eng.try_get = lambda *a: (order.append("long"), try_get(*a))[1]
        eng.lease_one = lambda *a: (order.append("short"), lease_one(*a))[1]
        a, b = await connect(), await connect()
        a.sendall(_frame({"id": 1, "op": "get", "ns": "m", "keys": keys(range(8))}))
        b.sendall(_frame({"id": 1, "op": "get", "ns": "m", "keys": keys([0])}))
        ra = await loop.run_in_executor(None, _reply, a)
        rb = await loop.run_in_executor(None, _reply, b)
        assert ra["ok"] and ra["found"] == b"\x01" * 8
        assert rb["ok"] and rb["found"] == b"\x01"
        assert order == ["short", "long"]
        for r, s in ((ra, a), (rb, b)):
            s.sendall(_frame({"id": 2, "op": "release", "lease": r["lease"]}))
            assert (await loop.run_in_executor(None, _reply, s))["ok"]
        assert not eng.leases
    _serve_in_process(tmp_path, kind, scenario)


@pytest.mark.parametrize("kind", LOOPS)
def test_replies_keep_their_request_order_across_long_and_short_requests(tmp_path, kind):
    # Pipelined on one connection: a long get that reads NVMe, short gets, a long resident get
    # and a release. The long ones wait their turn; the connection answers in request order.
    from kvtier.types import Tier
    from tests.conftest import keys

    async def scenario(loop, server, connect):
        s = await connect()
        reqs = [{"op": "get", "ns": "m", "keys": keys(range(8, 16))},
                {"op": "get", "ns": "m", "keys": keys([1])},
                {"op": "get", "ns": "m", "keys": keys(range(8))},
                {"op": "get", "ns": "m", "keys": keys([2])},
                {"op": "stats"}]
        s.sendall(b"".join(_frame({**r, "id": i}) for i, r in enumerate(reqs)))
        replies = [await loop.run_in_executor(None, _reply, s) for _ in reqs]
        assert [r["id"] for r in replies] == list(range(len(reqs)))
        assert all(r["ok"] for r in replies)
        assert [r["found"] for r in replies[:4]] == [b"\x01" * 8, b"\x01", b"\x01" * 8, b"\x01"]
        ns = server.engine.namespace("m")
        pool = ns.slots[Tier.HOST].pool
        from tests.conftest import blocks
        got = pool.read(np.frombuffer(replies[0]["slots"], "<i4"))
        assert (got == blocks(8, 4096, seed=1)).all()         # read from NVMe, installed
        for r in replies[:4]:
            s.sendall(_frame({"id": 9, "op": "release", "lease": r["lease"]}))
            assert (await loop.run_in_executor(None, _reply, s))["ok"]
        assert not server.engine.leases
    _serve_in_process(tmp_path, kind, scenario)


@pytest.mark.parametrize("kind", LOOPS)
def test_a_long_get_progresses_under_a_stream_of_short_ones(tmp_path, kind):
    # One connection sends short gets back to back, each as soon as the last was answered,
    # for as long as the long get of another connection (an NVMe read: five slices and a
    # read) is unanswered. Every frame of the stream is read before any slice runs (and held
    # back once), yet each iteration runs a slice: the long get is answered while the stream
    # goes on, its replies in order.
    from tests.conftest import keys

    async def scenario(loop, server, connect):
        a, b = await connect(), await connect()
        stop = threading.Event()
        served: list[int] = []

        def stream() -> None:
            i = 0
            while not stop.is_set() and i < 100_000:
                b.sendall(_frame({"id": i, "op": "get", "ns": "m", "keys": keys([3]),
                                  "release_first": b""}))
                r = _reply(b)
                assert r["ok"] and r["id"] == i, r
                served.append(i)
                b.sendall(_frame({"id": -1, "op": "release", "lease": r["lease"]}))
                assert _reply(b)["ok"]
                i += 1

        def long_get() -> dict:
            while len(served) < 20:           # the stream runs first
                threading.Event().wait(0.001)
            a.sendall(_frame({"id": 7, "op": "get", "ns": "m", "keys": keys(range(8, 16))}))
            r = _reply(a)
            stop.set()
            return r

        streamer = loop.run_in_executor(None, stream)
        r = await loop.run_in_executor(None, long_get)
        await streamer
        assert r["ok"] and r["found"] == b"\x01" * 8
        assert len(served) < 100_000          # it ended the stream, not the stream's cap
        a.sendall(_frame({"id": 8, "op": "release", "lease": r["lease"]}))
        assert (await loop.run_in_executor(None, _reply, a))["ok"]
    _serve_in_process(tmp_path, kind, scenario)


@pytest.mark.parametrize("kind", LOOPS)
def test_a_lone_long_request_with_nothing_queued_is_dispatched_inline(tmp_path, kind):
    # Nothing to let go first (no slice queued, no frame waiting): a lone worker's batch get
    # and put keep their inline dispatch, no loop iteration added (a GPU put's reserve and
    # commit go chunk by chunk).
    from tests.conftest import keys

    async def scenario(loop, server, connect):
        s = await connect()
        s.sendall(_frame({"id": 1, "op": "get", "ns": "m", "keys": keys(range(8))}))
        r = await loop.run_in_executor(None, _reply, s)
        assert r["ok"] and r["found"] == b"\x01" * 8
        s.sendall(_frame({"id": 2, "op": "reserve", "ns": "m", "keys": keys(range(20, 28))}))
        rr = await loop.run_in_executor(None, _reply, s)
        assert rr["ok"]
        s.sendall(_frame({"id": 3, "op": "commit", "rid": rr["rid"],
                          "checksums": np.zeros(8, "<u8").tobytes(), "trusted": True}))
        assert (await loop.run_in_executor(None, _reply, s))["ok"]
        assert server.steps.slices == 0
        s.sendall(_frame({"id": 4, "op": "release", "lease": r["lease"]}))
        assert (await loop.run_in_executor(None, _reply, s))["ok"]
    _serve_in_process(tmp_path, kind, scenario)


@pytest.mark.parametrize("kind", LOOPS)
def test_a_long_request_whose_peer_went_before_its_turn_still_runs_and_leaves_no_lease(
        tmp_path, kind):
    # Its frame came before the peer went, so it runs (a commit sent just before a close
    # still lands, as it did when dispatched in data_received); the lease its get made ends
    # with the connection, not at lease_timeout.
    from tests.conftest import keys

    async def scenario(loop, server, connect):
        eng = server.engine
        ran: list[str] = []
        try_get = eng.try_get
        eng.try_get = lambda *a: (ran.append("get"), try_get(*a))[1]
        b = await connect()
        conn = max(server._live, key=lambda c: c.client.cid)
        server.steps.later(lambda: conn.transport.abort())    # its peer goes first...
        server.steps.later(lambda: None)
        b.sendall(_frame({"id": 1, "op": "get", "ns": "m", "keys": keys(range(8))}))
        while server.steps.slices < 3:                     # ...then its get's turn
            await asyncio.sleep(0.01)
        while server._tasks - {t for t in server._tasks if t.get_name() == "housekeeping"}:
            await asyncio.sleep(0.01)
        assert conn.closed and ran == ["get"]
        assert not eng.leases
    _serve_in_process(tmp_path, kind, scenario)
