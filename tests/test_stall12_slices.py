"""stall12's loop slices (issue 17's stall): an NVMe reader's piggybacked releases as its
steps' first locked step, its reply written in a loop iteration after the one that built it,
and a large room step made in two slices with the batch's own copies pinned across. Each with
its cancel and error paths: no lease, pin or slot left, every block readable as put."""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from kvtier.api.steps import StepRunner, released_first
from kvtier.coherence import gets
from kvtier.coherence.engine import Engine
from kvtier.coherence.gets import advance
from kvtier.config import make_settings
from kvtier.types import Tier
from tests.conftest import blocks, keys
from tests.test_get_slices import _drive
from tests.test_steps import LOOPS, _frame, _reply, _serve_in_process, uvloop

BB = 4096


def _pins(eng: Engine, name: str = "m") -> int:
    return int(np.asarray(eng.namespace(name).slots[Tier.HOST].leases).sum())


def _accounted(eng: Engine, name: str = "m") -> None:
    """No lease or pin left, and every host slot free, a row's copy or retired."""
    ns = eng.namespace(name)
    st = ns.slots[Tier.HOST]
    assert not eng.leases
    assert _pins(eng, name) == 0
    assert int(ns.table.cols["leases"][: ns.table.n_rows].sum()) == 0
    cols, n = ns.table.cols, ns.table.n_rows
    rows = np.flatnonzero(cols["copy_ver"][:n, Tier.HOST] > 0)
    assert st.pool.free_count + rows.size + int(st.retired.sum()) == st.pool.n_slots


# ---------------------------------------------------------------- the releases as a step
# _serve_in_process's namespace m: blocks 0-7 resident, 8-15 on NVMe only (blocks(8, seed=1)).

async def _resident_lease(loop, connect):
    """A new connection, and the reply of its get of the resident blocks 0-7 (leased)."""
    s = await connect()
    s.sendall(_frame({"id": 1, "op": "get", "ns": "m", "keys": keys(range(8))}))
    first = await loop.run_in_executor(None, _reply, s)
    assert first["ok"]
    return s, first


async def _disk_get(loop, s, rid: int, release: list[int]) -> dict:
    """The reply of a get of the NVMe blocks 8-15 that carries release as release_first."""
    s.sendall(_frame({"id": rid, "op": "get", "ns": "m", "keys": keys(range(8, 16)),
                      "release_first": np.array(release, "<u8").tobytes()}))
    return await loop.run_in_executor(None, _reply, s)


async def _release(loop, s, rid: int, lease: int) -> None:
    s.sendall(_frame({"id": rid, "op": "release", "lease": lease}))
    assert (await loop.run_in_executor(None, _reply, s))["ok"]


def _calls(server, log: list[str]) -> None:
    """Log the release step and the room step, in the order they run."""
    release_step, room = server._release_step, server.engine.gets._room_for_get
    server._release_step = lambda *a: (log.append("release"), release_step(*a))[1]
    server.engine.gets._room_for_get = lambda *a: (log.append("room"), room(*a))[1]


@pytest.mark.parametrize("kind", LOOPS)
def test_a_disk_gets_piggybacked_release_is_its_first_step_not_its_dispatch(tmp_path, kind):
    async def scenario(loop, server, connect):
        s, first = await _resident_lease(loop, connect)
        log: list[str] = []
        _calls(server, log)
        inline = server._release_first
        server._release_first = lambda *a: (log.append("dispatch"), inline(*a))[1]
        r = await _disk_get(loop, s, 2, [first["lease"]])
        assert r["ok"] and r["found"] == b"\x01" * 8
        assert log == ["release", "room"]           # ended in a step, before the room
        eng = server.engine
        assert set(eng.leases) == {r["lease"]}
        pool = eng.namespace("m").slots[Tier.HOST].pool
        assert (pool.read(np.frombuffer(r["slots"], "<i4")) == blocks(8, BB, seed=1)).all()
        await _release(loop, s, 3, r["lease"])
        _accounted(eng)
    _serve_in_process(tmp_path, kind, scenario)


def test_an_unknown_piggybacked_lease_is_counted_and_the_disk_get_still_served(tmp_path):
    async def scenario(loop, server, connect):
        s = await connect()
        r = await _disk_get(loop, s, 1, [987654])
        assert r["ok"] and r["found"] == b"\x01" * 8
        (client,) = server.clients.values()
        assert client.errors == 1
        await _release(loop, s, 2, r["lease"])
        _accounted(server.engine)
    _serve_in_process(tmp_path, "asyncio", scenario)


def test_a_release_step_that_raises_fails_the_get_and_leaves_it_nothing(tmp_path):
    # A mock: release_many raising cannot be produced for real (it is a bug if it does).
    async def scenario(loop, server, connect):
        s, first = await _resident_lease(loop, connect)
        eng = server.engine
        release_many = eng.release_many

        def broken(*a):
            raise RuntimeError("injected: release_many")
        eng.release_many = broken
        r = await _disk_get(loop, s, 2, [first["lease"]])
        assert not r["ok"] and "injected" in r["error"]["message"]
        assert set(eng.leases) == {first["lease"]}      # the get's steps never started
        assert _pins(eng) == 8
        eng.release_many = release_many
        r = await _disk_get(loop, s, 3, [first["lease"]])
        assert r["ok"] and set(eng.leases) == {r["lease"]}
        await _release(loop, s, 4, r["lease"])
        _accounted(eng)
    _serve_in_process(tmp_path, "asyncio", scenario)


def test_a_disk_get_waiting_for_a_stage_ends_its_releases_before_that_wait(tmp_path):
    async def scenario(loop, server, connect):
        s, first = await _resident_lease(loop, connect)
        eng = server.engine
        stage = loop.create_task(asyncio.sleep(0.3))
        server._staging["m"] = stage
        log: list[str] = []
        release_many = eng.release_many
        eng.release_many = lambda *a: (log.append(f"release, staged {stage.done()}"),
                                       release_many(*a))[1]
        r = await _disk_get(loop, s, 2, [first["lease"]])
        assert r["ok"] and stage.done()
        assert log == ["release, staged False"]         # not held through the stage's wait
        server._staging.pop("m")
        await _release(loop, s, 3, r["lease"])
        _accounted(eng)
    _serve_in_process(tmp_path, "asyncio", scenario)


def _cold_then_resident(tmp_path: Path, n: int, host: str) -> tuple[Engine, np.ndarray]:
    """An engine whose namespace m holds 2n blocks of BB: 0..n-1 on NVMe only, n..2n-1
    resident in the host tier (of host_capacity host), flushed."""
    eng = Engine(make_settings({"data_dir": str(tmp_path / "d"), "host_capacity": host,
                                "nvme_capacity": "64MiB"}))
    eng.create_namespace("m", BB)
    data = blocks(2 * n, BB)
    eng.put("m", keys(range(n)), data[:n])
    eng.flush()
    eng.evict(Tier.HOST, n)
    eng.put("m", keys(range(n, 2 * n)), data[n:])
    eng.flush()
    return eng, data


@pytest.mark.parametrize("kind", LOOPS)
def test_a_cancel_before_the_release_step_still_ends_the_releases_and_starts_no_get(
        tmp_path, kind):
    eng, data = _cold_then_resident(tmp_path, 8, "1MiB")
    held = eng.get("m", keys(range(8, 16)), 0)
    decided: list[int] = []
    decide = eng.gets._get_decide
    eng.gets._get_decide = lambda *a: (decided.append(1), decide(*a))[1]
    loop = uvloop.new_event_loop() if kind == "uvloop" else asyncio.new_event_loop()
    runner = StepRunner(eng.lock, None, None)

    async def main():
        steps = released_first(partial(eng.release_many, [held.lease_id], 0),
                               eng.get_steps("m", keys(range(8)), 0))
        task = loop.create_task(runner.drive(steps))
        await asyncio.sleep(0)              # the release step is queued, not run
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    try:
        loop.run_until_complete(main())
        assert not decided                  # the get's steps never started
        _accounted(eng)
        found, out = eng.read("m", keys(range(16)))
        assert found.all() and (out == data).all()
    finally:
        runner.close()
        loop.close()
        eng.close(flush=False)


def test_a_reply_task_cancelled_before_its_write_ends_the_lease_it_made(tmp_path):
    async def scenario(loop, server, connect):
        await connect()
        (client,) = server.clients.values()
        reply = server._get_reply

        def cancel_after(*a):
            out = reply(*a)
            asyncio.current_task().cancel()     # at the await before the write
            return out
        server._get_reply = cancel_after
        task = loop.create_task(server._get_slow(client, "m", keys(range(8, 16)), False))
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not client.pins.by_id
        _accounted(server.engine)
    _serve_in_process(tmp_path, "asyncio", scenario)


# ---------------------------------------------------------------- the room step in two

def _full_host(tmp_path: Path) -> tuple[Engine, np.ndarray]:
    """64 host slots of 4 KiB (host_capacity 256 KiB), all held by blocks 64-127 (flushed, so
    evictable); blocks 0-63 on NVMe only."""
    eng, data = _cold_then_resident(tmp_path, 64, "256KiB")
    assert eng.room_short(eng.namespace("m"), Tier.HOST, 48) == 48     # every slot taken
    return eng, data


BATCH = list(range(48)) + list(range(64, 80))       # 48 to bring up, 16 resident


@pytest.fixture
def full_host(tmp_path: Path):
    eng, data = _full_host(tmp_path)
    yield eng, data
    eng.close(flush=False)


def test_a_large_room_step_is_two_slices_each_evicting_about_half(full_host):
    eng, data = full_host
    host = eng.counters.tiers[Tier.HOST]
    ns = eng.namespace("m")
    resident = ns.table.cols["slot"][ns.table.lookup(ns.table.keys_array(
        keys(range(64, 80)))), Tier.HOST].astype(np.int64)
    seen: list[tuple[str, int, int]] = []

    def between(name):
        seen.append((name, host.evictions, int(ns.slots[Tier.HOST].leases[resident].min())))
    ev0 = host.evictions
    names, res = _drive(eng, eng.get_steps("m", keys(BATCH), 0), between)
    assert names[:3] == ["_room_for_get", "_room_rest", "_get_decide"]
    (_, after_room, pinned), (_, after_rest, _), (_, after_decide, _) = seen[:3]
    assert after_room - ev0 == 24 and after_rest - ev0 == 48    # half each
    assert pinned == 1                      # the batch's copies pinned across the two
    assert after_decide == after_rest       # the decide found the room made
    pool = ns.slots[Tier.HOST].pool
    assert res.found.all() and (pool.read(res.slots) == data[BATCH]).all()
    eng.release(res.lease_id)
    _accounted(eng)


def test_a_small_room_step_stays_one_slice(full_host):
    eng, data = full_host
    few = list(range(gets.ROOM_SPLIT_MIN - 1)) + [64]
    names, res = _drive(eng, eng.get_steps("m", keys(few), 0))
    assert "_room_rest" not in names and names[:2] == ["_room_for_get", "_get_decide"]
    assert res.found.all()
    eng.release(res.lease_id)
    _accounted(eng)


def test_a_cancel_thrown_in_at_the_rooms_second_step_ends_its_pins(full_host):
    eng, data = full_host
    names, err = _drive_raising(eng, eng.get_steps("m", keys(BATCH), 0), "_room_rest",
                                asyncio.CancelledError())
    assert isinstance(err, asyncio.CancelledError)
    assert names == ["_room_for_get", "unpin_slots"]
    _accounted(eng)
    _all_readable(eng, data)


def test_a_second_room_step_that_raises_ends_its_pins_once(full_host):
    # A mock: make_room does not fail for real (it evicts what it can); the fault is injected
    # at its second call, the room step's second half.
    eng, data = full_host
    calls = []
    make_room = eng.make_room

    def second_fails(*a):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected: make_room")
        return make_room(*a)
    eng.gets.owner.make_room = second_fails
    with pytest.raises(RuntimeError, match="injected"):
        _drive(eng, eng.get_steps("m", keys(BATCH), 0))
    eng.gets.owner.make_room = make_room
    _accounted(eng)
    _all_readable(eng, data)


@pytest.mark.parametrize("between_rooms", ["rewrite", "delete", "another get"])
def test_what_runs_between_the_two_room_steps_is_decided_on_after(full_host, between_rooms):
    eng, data = full_host
    new = blocks(1, BB, seed=9)
    other = []

    def between(name):
        if name != "_room_for_get":
            return
        if between_rooms == "rewrite":          # a resident one and one to bring up
            eng.put("m", keys([64]), new)
            eng.put("m", keys([0]), new)
        elif between_rooms == "delete":
            eng.delete("m", keys([1, 65]))
        else:                                   # some of the batch's, installed first
            o = eng.get("m", keys(range(40, 56)), 0)
            assert o.found.all()
            eng.release(o.lease_id)
            other.append(o)
    names, res = _drive(eng, eng.get_steps("m", keys(BATCH), 0), between)
    assert names[:2] == ["_room_for_get", "_room_rest"]
    pool = eng.namespace("m").slots[Tier.HOST].pool
    want = data[BATCH].copy()
    found = np.ones(len(BATCH), dtype=bool)
    if between_rooms == "rewrite":
        want[BATCH.index(64)] = new[0]
        want[0] = new[0]
    elif between_rooms == "delete":
        found[[1, BATCH.index(65)]] = False
    assert (res.found == found).all()
    assert (pool.read(res.slots[found]) == want[found]).all()
    eng.release(res.lease_id)
    _accounted(eng)
    if between_rooms == "rewrite":
        _all_readable(eng, _rewritten(data, new))
    else:
        _all_readable(eng, data, (1, 65) if between_rooms == "delete" else ())


def _rewritten(data: np.ndarray, new: np.ndarray) -> np.ndarray:
    out = data.copy()
    out[[0, 64]] = new[0]
    return out


def _all_readable(eng: Engine, data: np.ndarray, gone: tuple[int, ...] = ()) -> None:
    """Every block but those deleted (gone) reads back as put (32 at a time: the host tier
    holds 64)."""
    for lo in range(0, len(data), 32):
        ids = np.arange(lo, lo + 32)
        found, out = eng.read("m", keys(ids.tolist()))
        assert (found == ~np.isin(ids, gone)).all()
        assert (out[found] == data[ids[found]]).all()


def _drive_raising(eng: Engine, steps, at: str, exc: BaseException):
    """Run steps as _drive does, with exc thrown in instead of running the locked step named
    at (once): the locked steps run, in order, and the exception the steps ended with."""
    names, thrown = [], False
    step, _ = advance(steps, None, None)
    try:
        while step is not None:
            name = getattr(step.fn, "func", step.fn).__name__
            if step.locked and name == at and not thrown:
                thrown = True
                step, _ = advance(steps, None, exc)
                continue
            if step.locked:
                with eng.lock:
                    value = step.fn()
                names.append(name)
            else:
                value = step.fn()
            step, _ = advance(steps, value, None)
    except BaseException as err:             # (what was thrown in comes back out)
        return names, err
    return names, None


# ---------------------------------------------------------------- the benches' smoke runs

def test_stall_dispatch_bench_smoke():
    # In process: each kind of the readers' loop slices, the reply tasks' steps among them.
    from tests.test_benches import _bench, _positive
    r = _bench("bench/stall_dispatch.py", "--cold-blocks", "512", "--host-capacity", "8MiB",
               "--gets", "20", "--readers", "2", "--task-steps")
    kinds = r["slices"]
    for k in ("_later", "_release_step", "_room_for_get", "_get_decide", "_finish_get",
              "_lease_step", "task:start", "task:mid", "task:end"):
        assert kinds[k]["cpu"]["n"] > 0, k
    assert r["gets"] >= 40 and r["longest_cpu_p50"][0] in kinds
    _positive(r, "sum_cpu_p50_us", "loop_cpu_per_get_us")


def test_stall_trace_bench_task_steps_smoke():
    # --task-steps: the reply tasks' steps are traced loop work, their CPU time with them.
    from tests.test_benches import _bench
    r = _bench("bench/stall_trace.py", "--cold-blocks", "256", "--batch", "16",
               "--host-capacity", "8MiB", "--samples", "300", "--readers", "1", "--no-gc",
               "--task-steps")
    work = r["conditions"]["1"]["loop_work_us"]
    assert work["task:end"]["n"] > 0 and "cpu_p50" in work["task:end"]
    assert work["task:start"]["n"] > 0
