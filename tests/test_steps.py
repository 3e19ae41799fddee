"""kvtier.api.steps: a get's locked steps on the event loop, one per loop iteration, with the
loop's sockets polled in between; a step whose lock is taken waits on the memory lane."""

from __future__ import annotations

import asyncio
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

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


@pytest.mark.parametrize("kind", LOOPS)
def test_a_frame_that_arrives_during_a_step_is_read_before_the_next_step(kind: str):
    async def scenario(loop, runner, lock):
        order: list[str] = []
        r, w = socket.socketpair()
        r.setblocking(False)
        loop.add_reader(r, lambda: (r.recv(16), order.append("frame")))
        try:
            def a() -> str:
                order.append("A")
                w.send(b"x")                  # a worker's request arrives while A runs
                return "a"

            def b() -> str:
                order.append("B")
                return "b"

            assert await asyncio.gather(runner._locked(a), runner._locked(b)) == ["a", "b"]
        finally:
            loop.remove_reader(r)
            r.close()
            w.close()
        assert order == ["A", "frame", "B"]
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
