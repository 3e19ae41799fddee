"""rev13: a get's locked step that had to wait for the engine lock runs on the memory lane
(StepRunner._next, a flush holding the lock). A cancel of the get while it waited there must
not be thrown into the steps as though the step had not run: it ran, and what it took (the
room step's pins across its two slices, the decide's pins or lease, the piggybacked
releases) is the steps' to end. Real engine, real StepRunner and memory lane; the lock is
held by a real thread, as a flush holds it."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest

from kvtier.api.steps import LOOP_WAIT_S, StepRunner, released_first
from tests.conftest import keys
from tests.test_steps import _serve_in_process
from tests.test_stall12_slices import (BATCH, _accounted, _all_readable, _cold_then_resident,
                                       _full_host)


def _hold(lock: threading.RLock, taken: threading.Event, free: threading.Event) -> None:
    """Hold lock (as a flush applying its batch does) from taken until free."""
    with lock:
        taken.set()
        free.wait(10)


def _cancelled_on_the_memory_lane(eng, steps, dropped=None) -> None:
    """Drive steps with the engine lock held by another thread, so that their first locked
    step waits on the memory lane; cancel the get while it waits, then free the lock.
    dropped: drive's."""
    loop = asyncio.new_event_loop()
    pool = ThreadPoolExecutor(2, thread_name_prefix="rev13-mem")
    runner = StepRunner(eng.lock, lambda fn, *a: loop.run_in_executor(pool, fn, *a),
                        lambda fn, *a: loop.run_in_executor(pool, fn, *a))
    taken, free = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold, args=(eng.lock, taken, free))
    holder.start()
    taken.wait(10)

    async def main() -> None:
        task = loop.create_task(runner.drive(steps, dropped))
        # Its first slice finds the lock taken (for LOOP_WAIT_S) and goes to the memory lane.
        await asyncio.sleep(LOOP_WAIT_S * 20 + 0.05)
        task.cancel()
        await asyncio.sleep(0.01)
        free.set()                      # the step now runs there, under the lock
        with pytest.raises(asyncio.CancelledError):
            await task
    try:
        loop.run_until_complete(main())
    finally:
        free.set()
        holder.join()
        runner.close()
        pool.shutdown()
        loop.close()


def test_a_room_step_run_on_the_memory_lane_then_cancelled_ends_its_pins(tmp_path):
    eng, data = _full_host(tmp_path)
    try:
        _cancelled_on_the_memory_lane(eng, eng.get_steps("m", keys(BATCH), 0))
        _accounted(eng)                 # main: the 16 resident copies stayed pinned
        _all_readable(eng, data)
    finally:
        eng.close(flush=False)


def test_a_decide_run_on_the_memory_lane_then_cancelled_hands_its_lease_to_dropped(tmp_path):
    eng, data = _cold_then_resident(tmp_path, 8, "1MiB")
    try:
        # A resident batch, no room step: its decide (the first step) leases it at once.
        dropped = []
        _cancelled_on_the_memory_lane(eng, eng.get_steps("m", keys(range(8, 16)), 0,
                                                         room_first=False), dropped.append)
        (res,) = dropped                # main: no dropped; the lease left to lease_timeout
        assert res.found.all() and eng.leases.keys() == {res.lease_id}
        eng.release(res.lease_id)
        _accounted(eng)
    finally:
        eng.close(flush=False)


def test_releases_run_on_the_memory_lane_then_cancelled_end_once(tmp_path):
    eng, data = _cold_then_resident(tmp_path, 8, "1MiB")
    try:
        held = eng.get("m", keys(range(8, 16)), 0)
        unknown: list[int] = []

        def release(ids):
            unknown.append(eng.release_many(ids, 0))
        _cancelled_on_the_memory_lane(eng, released_first(
            partial(release, [held.lease_id]), eng.get_steps("m", keys(range(8)), 0)))
        # Run once, and found its lease (main: run again as the cancel's cleanup, which
        # counted the lease as unknown: a connection's errors for a release it sent once).
        assert unknown == [0]
        _accounted(eng)
    finally:
        eng.close(flush=False)


def test_the_servers_dropped_get_ends_its_lease(tmp_path):
    """Server._get_slow's dropped (what drive hands a result made after the cancel): the
    lease, never sent, ends on the memory lane."""
    async def scenario(loop, server, connect):
        await connect()
        (client,) = server.clients.values()
        res = server.engine.get("m", keys(range(8, 16)), client.cid)
        assert server.engine.leases.keys() == {res.lease_id}
        server._dropped_get(client, res)
        for _ in range(200):
            if not server.engine.leases:
                break
            await asyncio.sleep(0.005)
        _accounted(server.engine)
        assert client.errors == 0
    _serve_in_process(tmp_path, "asyncio", scenario)
