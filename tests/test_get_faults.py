"""kvtier.coherence.gets under faults in a get's finish step: whatever raises between the
decide (which pins the batch's copies and the NVMe read's new slots) and the lease, every pin
ends with the error, every slot the read was to fill goes back free (the host budget with
it), no lease is left in the table and no row's reader count stays up.

Nothing in the install, the lease or the touch raises for a real fault short of no memory
(numpy stores into preallocated columns, the policies' C queues), so the faults here are
injected at one seam each: the raise a failing allocation or policy would make there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from kvtier.coherence import gets
from kvtier.coherence.engine import Engine
from kvtier.config import make_settings
from kvtier.types import Tier
from tests.conftest import blocks, drive_get, keys
from tests.test_steps import LOOPS

BB = 4096
RESIDENT = 9                    # a host copy; keys 0..5 are on NVMe only
BATCH = [RESIDENT, 0, 1, 1, 2, 77]      # a repeat of an NVMe key, and a miss


class Injected(RuntimeError):
    pass


def _fail(*args: Any, **kwargs: Any) -> None:
    raise Injected("injected")


@pytest.fixture(params=["c-install", "numpy-install"])
def eng(request, tmp_path: Path, monkeypatch) -> Iterator[Engine]:
    """Namespace m: keys 0..5 flushed and evicted to NVMe, key RESIDENT in the host tier
    (16 slots). numpy-install: the install goes through Transfers.install_read (no C
    read_installable), as builds without kvtier.coherence._gets do."""
    if request.param == "numpy-install":
        monkeypatch.setattr(gets, "_read_installable", None)
    elif gets._read_installable is None:
        pytest.skip("kvtier.coherence._gets not built")
    e = Engine(make_settings({"data_dir": str(tmp_path / "d"), "host_capacity": "64KiB",
                              "nvme_capacity": "4MiB", "segment_bytes": "1MiB",
                              "write_policy": "write_back"}))
    e.create_namespace("m", BB)
    e.put("m", keys(range(6)), blocks(6, BB, 1))
    e.flush()
    e.evict(Tier.HOST, 16)
    e.put("m", keys([RESIDENT]), blocks(1, BB, 2))
    yield e
    e.close(flush=False)


def _held(e: Engine) -> dict[str, Any]:
    """What a get holds or takes: slot pins, leases, reader counts, free slots, the host
    budget; and whether every slot is exactly one of free, a row's current copy, retired."""
    ns = e.namespace("m")
    st = ns.slots[Tier.HOST]
    t = ns.table
    cols = t.cols
    rows = np.flatnonzero(cols["copy_ver"][: t.n_rows, Tier.HOST] > 0)
    named = cols["slot"][rows, Tier.HOST]
    return {"pins": int(st.leases.sum()), "leases": len(e.leases),
            "readers": int(cols["leases"][: t.n_rows].sum()), "free": st.pool.free_count,
            "host_used": e.host_used, "blocks": int(t.live),
            "copies": sorted(zip(rows.tolist(), named.tolist())),
            "slot_rows": (st.slot_row[named] == rows).all(),
            "accounted": st.pool.free_count + rows.size + int(st.retired.sum())
            == st.pool.n_slots}


def _whole_get(e: Engine) -> None:
    """After the error the same get is served whole, with the bytes that were put, and its
    release gives everything back."""
    res = e.get("m", keys(BATCH))
    assert res.found.tolist() == [True, True, True, True, True, False]
    pool = e.namespace("m").slots[Tier.HOST].pool
    got = pool.read(res.slots[:5])
    want = np.concatenate([blocks(1, BB, 2), blocks(6, BB, 1)[[0, 1, 1, 2]]])
    assert np.array_equal(np.asarray(got), want)
    e.release(res.lease_id)
    assert not e.namespace("m").slots[Tier.HOST].leases.any() and not e.leases


def _expect_nothing_held(e: Engine, before: dict[str, Any], installed: bool = False) -> None:
    """Nothing pinned, leased or counted as a reader, every slot accounted for; and the
    copies as before the get, or (installed: the fault came after the install) the
    batch's NVMe blocks installed too, unleased: served copies like any other."""
    after = _held(e)
    assert after["pins"] == 0 and after["leases"] == 0 and after["readers"] == 0
    assert after["accounted"] and after["slot_rows"]
    if installed:
        got = {r for r, _ in after["copies"]} - {r for r, _ in before["copies"]}
        assert len(got) == 3 and after["free"] == before["free"] - 3
        after = dict(after, copies=before["copies"], free=before["free"],
                     host_used=after["host_used"] - 3 * BB)
    assert after == before


@pytest.mark.parametrize("seam", ["finish_read", "set_copy", "on_insert"])
def test_an_install_that_raises_ends_the_gets_pins_and_frees_the_reads_slots(
        eng: Engine, monkeypatch, seam: str):
    # Before the fix only the lease's own step was covered: the resident copy's pin and the
    # read's two new slots (pinned, named by no row) stayed for ever, 3 of 16 slots gone.
    if seam == "finish_read" and gets._read_installable is not None:
        pytest.skip("the C install tells an installable read without finish_read")
    before = _held(eng)
    ns = eng.namespace("m")
    with monkeypatch.context() as m:
        if seam == "finish_read":               # before any slot is named
            m.setattr(eng.nvme, "finish_read", _fail)
        elif seam == "set_copy":                # the install's set_copy, before it writes
            m.setattr(eng, "set_copy", _fail)
        else:                                   # set_copy's columns written, then its policy
            m.setattr(ns.slots[Tier.HOST].policy, "on_insert", _fail)
        with pytest.raises(Injected):
            eng.get("m", keys(BATCH))
    _expect_nothing_held(eng, before)
    _whole_get(eng)


def test_a_result_that_fails_to_build_leaves_no_lease_to_end_twice(eng: Engine, monkeypatch):
    # Before the fix the lease went into the table first, then the GetResult was built: when
    # that raised, the finish step's except ended the pins and the lease stayed, so its end
    # (here the reaper's) took the slots' counts down a second time.
    before = _held(eng)
    real = gets.GetResult

    class Refused(real):                # isinstance checks of GetResult still hold
        __slots__ = ()

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise Injected("injected")
    with monkeypatch.context() as m:
        m.setattr(gets, "GetResult", Refused)
        with pytest.raises(Injected):
            eng.get("m", keys(BATCH))
    _expect_nothing_held(eng, before, installed=True)
    assert eng.reap(now=float("inf")) == 0
    _expect_nothing_held(eng, before, installed=True)
    _whole_get(eng)


def test_a_touch_that_raises_leaves_no_reader_count_up(eng: Engine, monkeypatch):
    # The rows' reader counts were added before the touch: when it raised, they stayed one
    # up (per served occurrence) until a rewrite reset them.
    before = _held(eng)
    with monkeypatch.context() as m:
        m.setattr(eng, "touch", _fail)
        with pytest.raises(Injected):
            eng.get("m", keys(BATCH))
    _expect_nothing_held(eng, before, installed=True)
    _whole_get(eng)


@pytest.mark.parametrize("seam", ["set_copy", "free_slots"])
def test_an_install_that_shares_another_gets_copy_and_raises_ends_that_pin_too(
        eng: Engine, monkeypatch, seam: str):
    # Key 0 is installed by another get while this one's read is in flight: the install
    # shares that copy (one more pin on it) and gives its own slot back. A fault in the
    # install of the others (set_copy) or in that give-back (free_slots, after the share's
    # pin) must end the share's pin and every slot of the read, each once.
    from kvtier.coherence import transfers
    if gets._read_installable is not None and transfers._install_shares is not None:
        pytest.skip("the C shared install (_gets.c install_shares) calls neither seam: "
                    "tests/test_stall11_install.py injects at its own")
    before = _held(eng)
    ns = eng.namespace("m")
    other = {}

    def meanwhile(p: Any) -> None:
        res = eng.get("m", keys([0]))
        other["slot"] = int(res.slots[0])
        eng.release(res.lease_id)
        m.setattr(eng, seam, _once(getattr(eng, seam)))

    with monkeypatch.context() as m:
        with pytest.raises(Injected):
            drive_get(eng, eng.get_steps("m", keys(BATCH)), before_install=meanwhile)
    after = _held(eng)
    assert after["pins"] == 0 and after["leases"] == 0 and after["readers"] == 0
    assert after["accounted"] and after["slot_rows"]
    # Key 0's copy (the other get's) stays; nothing else of this get's read does.
    row0 = int(ns.table.lookup(ns.table.keys_array(keys([0])))[0])
    assert after["copies"] == sorted(before["copies"] + [(row0, other["slot"])])
    assert after["free"] == before["free"] - 1
    assert after["host_used"] == before["host_used"] + BB
    _whole_get(eng)


def _once(fn: Any) -> Any:
    """fn, except that its first call raises Injected."""
    calls: list[int] = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise Injected("injected")
        return fn(*args, **kwargs)
    return wrapped


# ---------------------------------------------------------------------- the remote tier's fill

@pytest.fixture
def remote_eng(tmp_path: Path) -> Iterator[Engine]:
    """Namespace m with key RESIDENT in the host tier (16 slots) and keys 0..2 only in a
    real redis-server."""
    import xxhash

    from tests.redis_servers import RedisServer
    server = RedisServer(tmp_path).start()
    e = Engine(make_settings({"data_dir": str(tmp_path / "d"), "host_capacity": "64KiB",
                              "nvme_capacity": "4MiB", "redis": server.url}))
    try:
        e.create_namespace("m", BB)
        e.put("m", keys([RESIDENT]), blocks(1, BB, 2))
        data = blocks(3, BB, 3)
        sums = np.array([xxhash.xxh3_64_intdigest(r) for r in data], dtype=np.uint64)
        assert e.remote.put_many("m", [keys([i]) for i in range(3)],
                                 np.array([5, 6, 7], np.uint64), sums, list(data)).all()
        yield e
    finally:
        e.close(flush=False)
        server.stop()


def _remote_whole_get(e: Engine) -> None:
    res = e.get("m", keys([RESIDENT, 0, 1, 2]))
    assert res.found.all() and res.versions.tolist()[1:] == [5, 6, 7]
    got = np.asarray(e.namespace("m").slots[Tier.HOST].pool.read(res.slots))
    assert np.array_equal(got, np.concatenate([blocks(1, BB, 2), blocks(3, BB, 3)]))
    e.release(res.lease_id)
    assert not e.namespace("m").slots[Tier.HOST].leases.any() and not e.leases


@pytest.mark.parametrize("seam", ["set_copy", "on_insert"])
def test_a_remote_fill_that_raises_after_writing_its_rows_puts_them_back(
        remote_eng: Engine, monkeypatch, seam: str):
    # The fill wrote its rows' versions, checksums and states, then set_copy raised (before
    # it wrote: its slots were named by no row; after its columns, in the policy: they were).
    # Before the fix the rows stayed at the remote version, dirty, with no copy, the slots
    # pinned and the host budget taken; the rows it made stayed, counted as blocks.
    e = remote_eng
    ns = e.namespace("m")
    before = _held(e)
    with monkeypatch.context() as m:
        if seam == "set_copy":
            m.setattr(e, "set_copy", _fail)
        else:
            m.setattr(ns.slots[Tier.HOST].policy, "on_insert", _fail)
        with pytest.raises(Injected):
            e.get("m", keys([RESIDENT, 0, 1, 2]))
    _expect_nothing_held(e, before)
    assert (ns.table.lookup(ns.table.keys_array(keys(range(3)))) == -1).all()
    _remote_whole_get(e)


def test_a_remote_fill_with_no_room_leaves_no_empty_rows(remote_eng: Engine):
    # Every host slot leased: the fill finds no room, the keys are misses, and the rows it
    # made for them go again (they stayed, empty, counted as blocks); then room for one.
    e = remote_eng
    ns = e.namespace("m")
    e.put("m", keys(range(100, 115)), blocks(15, BB, 4))
    held = e.get("m", keys([RESIDENT, *range(100, 115)]))
    before = int(ns.table.live)
    res = e.get("m", keys([0, 1]))
    assert not res.found.any()
    assert int(ns.table.live) == before
    assert (ns.table.lookup(ns.table.keys_array(keys([0, 1]))) == -1).all()
    e.release(res.lease_id)
    # One slot free: key 0 is filled, key 1 is a miss whose row goes too.
    e.release(held.lease_id, slots=held.slots[:1])
    res = e.get("m", keys([0, 1]))
    assert res.found.tolist() == [True, False]
    assert int(ns.table.live) == before + 1
    assert ns.table.lookup(ns.table.keys_array(keys([0, 1]))).tolist()[1] == -1
    e.release(res.lease_id)
    e.release(held.lease_id)
    _remote_whole_get(e)


def test_a_key_the_batch_repeats_is_filled_from_the_remote_tier_once(remote_eng: Engine):
    # A real case, no fault: both positions of key 0 missed locally, and the fill gave each
    # its own slot for the one row; the row named the second, the first was named by no
    # copy (never freed, never evicted: a slot lost per repeat).
    e = remote_eng
    before = _held(e)
    res = e.get("m", keys([RESIDENT, 0, 0, 1]))
    assert res.found.all() and res.slots[1] == res.slots[2]
    assert res.versions.tolist() == [1, 5, 5, 6]
    assert e.namespace("m").slots[Tier.HOST].leases[res.slots[1]] == 2
    e.release(res.lease_id)
    after = _held(e)
    assert after["pins"] == 0 and after["readers"] == 0 and after["accounted"]
    assert after["free"] == before["free"] - 2
    assert after["host_used"] == before["host_used"] + 2 * BB
    _remote_whole_get(e)


# ---------------------------------------------------------------------- the server's side

@pytest.mark.parametrize("kind", LOOPS)
def test_a_client_that_closes_during_its_gets_read_leaves_no_lease(tmp_path: Path, kind: str,
                                                                  monkeypatch):
    # A real socket's peer closes while its get's NVMe read is in flight (held there, not
    # failed, until the close's release_owner has run): the lease the get makes after it is
    # ended by the reply's end (Connection._finish), not left until lease_timeout (600 s).
    import asyncio
    import select
    import threading

    from tests.test_steps import _frame, _serve_in_process

    reading, go = threading.Event(), threading.Event()

    def held(fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            reading.set()
            go.wait(10)
            return fn(*args, **kwargs)
        return run

    async def scenario(loop, server, connect):
        eng = server.engine
        server.steps.use_read_threads = False          # the read on the I/O pool, held
        monkeypatch.setattr(gets, "run_batch", held(gets.run_batch))
        monkeypatch.setattr(eng.nvme, "run_read", held(eng.nvme.run_read))
        s = await connect()
        conn = max(server._live, key=lambda c: c.client.cid)
        # A reply left unread makes the close a reset (ECONNRESET on the server's side, at
        # once); a plain close is an EOF, which the server answers before it closes.
        s.sendall(_frame({"id": 0, "op": "stats"}))
        assert await loop.run_in_executor(None, select.select, [s], [], [], 10)
        s.sendall(_frame({"id": 1, "op": "get", "ns": "m", "keys": keys(range(4, 12))}))
        assert await loop.run_in_executor(None, reading.wait, 10)
        s.close()
        while not conn.closed or any(t.get_name().startswith("release-owner")
                                     for t in server._tasks):
            await asyncio.sleep(0.01)
        assert not eng.leases                   # the close found nothing to end yet
        go.set()
        while server._tasks - {t for t in server._tasks if t.get_name() == "housekeeping"}:
            await asyncio.sleep(0.01)
        assert not eng.leases
        assert not eng.namespace("m").slots[Tier.HOST].leases.any()
    _serve_in_process(tmp_path, kind, scenario)


@pytest.mark.parametrize("inline", [False, True], ids=["slots", "inline"])
def test_a_get_reply_that_fails_to_build_ends_its_lease(tmp_path: Path, monkeypatch,
                                                        inline: bool):
    # The engine made the lease, then the reply failed (an injected raise in the prefetch
    # check, which nothing real makes raise; the inline copy's read likewise): the client
    # gets an error and never learns the lease's id, so the lease must end now, not at
    # lease_timeout (600 s).
    import asyncio

    from tests.test_steps import _frame, _reply, _serve_in_process

    async def scenario(loop, server, connect):
        eng = server.engine
        monkeypatch.setattr(eng, "wants_prefetch", _fail)
        s = await connect()
        # One resident key (the one-key lease), resident keys, NVMe ones (the steps).
        for i, ks in enumerate((keys([3]), keys(range(8)), keys(range(4, 12)))):
            req = {"id": i, "op": "get", "ns": "m", "keys": ks}
            if inline:
                req["inline"] = True
            s.sendall(_frame(req))
            r = await loop.run_in_executor(None, _reply, s)
            assert not r["ok"] and "injected" in str(r)
            assert not eng.leases
            assert not eng.namespace("m").slots[Tier.HOST].leases.any()
        await asyncio.sleep(0)
    _serve_in_process(tmp_path, "asyncio", scenario)


# ---------------------------------------------------------------------- the decide's bring-ups

@pytest.mark.parametrize("seam", ["device-copy", "plan_read", "set_copy"])
def test_a_bring_up_that_raises_in_the_decide_ends_the_gets_pins(tmp_path: Path, monkeypatch,
                                                                 seam: str):
    # An HBM get of [a copy already in HBM, two blocks in host memory, one on NVMe]: the
    # decide pins the first, allocates and pins slots for the others, then copies them up.
    # A copy that raises there (a device copy: no CUDA here, so injected into the stand-in
    # pool; the read plan's gathers; set_copy) left those pins and slots for ever.
    from tests.engines import small_engine
    e = small_engine(tmp_path / "d", hbm=True)
    try:
        e.put("m", keys([9]), blocks(1, BB, 3))
        e.flush()
        e.evict(Tier.HOST, 16)                  # key 9 on NVMe only
        e.put("m", keys([0]), blocks(1, BB, 1), tier=Tier.HBM)
        e.put("m", keys([1, 2]), blocks(2, BB, 2))
        ns = e.namespace("m")
        hbm = ns.slots[Tier.HBM]
        host = ns.slots[Tier.HOST]
        before = (hbm.pool.free_count, host.pool.free_count, e.host_used)
        with monkeypatch.context() as m:
            if seam == "device-copy":
                m.setattr(hbm.pool, "write", _fail)
            elif seam == "plan_read":
                m.setattr(e.nvme, "plan_read", _fail)
            else:
                m.setattr(e, "set_copy", _fail)
            with pytest.raises(Injected):
                e.get("m", keys([0, 1, 2, 9]), 0, Tier.HBM)
        assert not hbm.leases.any() and not host.leases.any() and not e.leases
        assert (hbm.pool.free_count, host.pool.free_count, e.host_used) == before
        assert all(seg.readers == 0 for seg in ns.log.segments.values())
        res = e.get("m", keys([0, 1, 2, 9]), 0, Tier.HBM)
        assert res.found.all()
        got = np.asarray(hbm.pool.read(res.slots))
        assert np.array_equal(got, np.concatenate([blocks(1, BB, 1), blocks(2, BB, 2),
                                                   blocks(1, BB, 3)]))
        e.release(res.lease_id)
        assert not hbm.leases.any()
    finally:
        e.close(flush=False)


def test_an_nvme_plan_that_raises_in_the_decide_ends_the_gets_pins(eng: Engine, monkeypatch):
    # The host-only bring-up (_bring_up_from_nvme): its slots allocated and pinned, then the
    # plan's gathers raise (injected: the C gather refuses only a broken table).
    before = _held(eng)
    with monkeypatch.context() as m:
        m.setattr(eng.nvme, "plan_read", _fail)
        with pytest.raises(Injected):
            eng.get("m", keys(BATCH))
    _expect_nothing_held(eng, before)
    _whole_get(eng)


# ---------------------------------------------------------------------- at random

@pytest.mark.parametrize("numpy", [False, True], ids=["c", "numpy"])
@pytest.mark.parametrize("hbm", [False, True], ids=["host", "hbm-above"])
@pytest.mark.parametrize("seed", [1, 2])
def test_random_gets_with_random_faults_keep_every_slot_and_every_block(
        tmp_path: Path, hbm: bool, seed: int, numpy: bool, monkeypatch):
    # Random puts, flushes and evictions, and gets (of either tier, some with another get
    # of the same keys between the read and the install) of which a third meet a fault at
    # one of the seams above (injected, once); with the C helpers, or the numpy paths. After every step, with every lease ended:
    # no pin, no reader count, every slot free, a current copy or retired, the host budget
    # what the host pool has out; and every get served the bytes last put.
    from kvtier.coherence import fastpath
    from tests.engines import put_or_evict, small_engine
    if numpy:                                   # the numpy fast path, split and install
        for mod, name in ((fastpath, "_fast"), (gets, "_split"), (gets, "_read_installable"),
                          (gets, "_lease_current")):
            monkeypatch.setattr(mod, name, None)
    e = small_engine(tmp_path / "d", hbm)
    rng = np.random.default_rng(seed)
    ns = e.namespace("m")
    host = ns.slots[Tier.HOST]
    model: dict[int, np.ndarray] = {}
    seen: list = []
    faults = served = 0
    real_put = e.put

    def put(namespace: str, ks: bytes, data: np.ndarray, **kw: Any) -> Any:
        out = real_put(namespace, ks, data, **kw)
        for j in range(len(ks) // 16):
            model[int.from_bytes(ks[16 * j:16 * j + 16], "big") - 1] = data[j].copy()
        return out
    e.put = put                                 # the model follows put_or_evict's puts
    seams: list[Any] = [lambda: (e, "set_copy"), lambda: (e.nvme, "finish_read"),
                        lambda: (e, "touch"), lambda: (host.policy, "on_insert"),
                        lambda: (e.nvme, "plan_read"), lambda: (e, "free_slots")]
    if hbm:
        seams.append(lambda: (ns.slots[Tier.HBM].pool, "write"))
    for step in range(250):
        op = int(rng.integers(0, 10))
        ids = [int(i) for i in rng.integers(0, 30, int(rng.integers(1, 8)))]
        if put_or_evict(e, rng, op, ids, 100 + step, seen, evict_below=4):
            pass
        else:
            tier = Tier.HBM if hbm and rng.integers(0, 2) else Tier.HOST
            undo: list[tuple[Any, str, Any]] = []
            seam = seams[int(rng.integers(0, len(seams)))]()
            if rng.integers(0, 3) == 0 and seam[0] is not None:   # (a policy made lazily)
                obj, name = seam
                setattr(obj, name, _once(getattr(obj, name)))
                undo.append((obj, name))
            later: list[int] = []

            def meanwhile(p: Any, ids: list[int] = ids, later: list[int] = later) -> None:
                if rng.integers(0, 2):
                    try:                        # (the fault may be this get's instead)
                        later.append(e.get("m", keys(ids[:1])).lease_id)
                    except Injected:
                        pass
            try:
                res = drive_get(e, e.get_steps("m", keys(ids), 0, tier), meanwhile)
            except Injected:
                faults += 1
            else:
                got = np.asarray(ns.slots[tier].pool.read(res.slots[res.found]))
                want = [model[i] for i, f in zip(ids, res.found) if f]
                assert all(np.array_equal(g, w) for g, w in zip(got, want)), step
                served += int(res.found.sum())
                later.append(res.lease_id)
            for obj, name in undo:
                delattr(obj, name)          # the instance's patch: the class's method again
            for lid in later:
                e.release(lid)
        assert not e.leases and not e.reservations, step
        t = ns.table
        assert not t.cols["leases"][: t.n_rows].any(), step
        for st in ns.slots.values():
            assert not st.leases.any(), step
            rows = np.flatnonzero(st.slot_row >= 0)
            assert st.pool.free_count + rows.size + int(st.retired.sum()) == st.pool.n_slots
        assert e.host_used == (host.pool.n_slots - host.pool.free_count) * BB, step
    assert faults > 10 and served > 100
    e.close(flush=False)


@pytest.mark.parametrize("seam", ["touch", "GetResult"])
def test_the_numpy_resident_lease_that_raises_leaves_no_pin_or_count(tmp_path: Path,
                                                                     monkeypatch, seam: str):
    # Without the C helpers a resident batch is leased by FastPath.lease_resident: its pins
    # and reader counts were taken, then the touch raised (they stayed for ever), or the
    # lease was in the table before its GetResult raised (a lease nobody knew, to its
    # timeout). Injected at the touch and the GetResult (neither raises for real).
    from kvtier.coherence import fastpath
    from tests.engines import small_engine
    monkeypatch.setattr(fastpath, "_fast", None)
    monkeypatch.setattr(gets, "_split", None)
    e = small_engine(tmp_path / "d", hbm=False)
    try:
        e.put("m", keys(range(3)), blocks(3, BB, 1))
        ns = e.namespace("m")
        with monkeypatch.context() as m:
            if seam == "touch":
                m.setattr(e, "touch", _fail)
            else:
                class Refused(fastpath.GetResult):
                    __slots__ = ()

                    def __init__(self, *args: Any, **kwargs: Any) -> None:
                        raise Injected("injected")
                m.setattr(fastpath, "GetResult", Refused)
            with pytest.raises(Injected):
                e.get("m", keys([0, 1, 2, 1]))
        assert not ns.slots[Tier.HOST].leases.any() and not e.leases
        assert not ns.table.cols["leases"][: ns.table.n_rows].any()
        res = e.get("m", keys([0, 1, 2, 1]))
        assert res.found.all()
        e.release(res.lease_id)
        assert not ns.slots[Tier.HOST].leases.any()
    finally:
        e.close(flush=False)
