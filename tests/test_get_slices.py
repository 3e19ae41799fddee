"""An NVMe get's install and lease as two locked steps, and the read's C batch made in a step of
its own (issue 17's stall, stall10): each is a slice of the server's loop, with other requests
answered between them. What runs between the install and the lease must not change what the
get serves (the bytes of the version it read, with their checksum), and a get thrown out
between any two of its steps (a cancel) must leave no pin, no lease and no slot taken."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kvtier import checksums
from kvtier.api.steps import StepRunner
from kvtier.coherence.engine import Engine
from kvtier.coherence import gets
from kvtier.coherence.gets import advance
from kvtier.config import make_settings
from kvtier.types import Tier
from tests.conftest import blocks, keys

BB = 4096
N = 8


def _on_disk(tmp_path: Path) -> tuple[Engine, np.ndarray]:
    """An engine whose namespace m holds N blocks, the first half resident in the host tier,
    the rest on NVMe only (a get of all N reads half of them)."""
    eng = Engine(make_settings({"data_dir": str(tmp_path), "host_capacity": "1MiB",
                                "nvme_capacity": "16MiB"}))
    eng.create_namespace("m", BB)
    data = blocks(N, BB)
    eng.put("m", keys(range(N)), data)
    eng.flush()
    eng.evict(Tier.HOST, N)
    eng.read("m", keys(range(N // 2)))
    return eng, data


def _name(step) -> str:
    return getattr(step.fn, "func", step.fn).__name__


def _drive(eng: Engine, steps, between=None, throw_at: str | None = None):
    """Run steps as the server's loop does (locked ones under the lock); between(name) after
    each locked step; a CancelledError thrown in instead of running the step named throw_at
    (once). The locked steps' names in order, and the result."""
    names = []
    step, out = advance(steps, None, None)
    thrown = False
    while step is not None:
        if step.locked and _name(step) == throw_at and not thrown:
            thrown = True
            step, out = advance(steps, None, asyncio.CancelledError())
            continue
        value = _run_one(eng, step)
        if step.locked:
            names.append(_name(step))
            if between is not None:
                between(names[-1])
        step, out = advance(steps, value, None)
    return names, out


def _nothing_held(eng: Engine, data: np.ndarray) -> None:
    ns = eng.namespace("m")
    st = ns.slots[Tier.HOST]
    assert not eng.leases
    assert int(np.asarray(st.leases).sum()) == 0
    assert int(ns.table.cols["leases"][: ns.table.n_rows].sum()) == 0
    assert sum(seg.readers for seg in ns.log.segments.values()) == 0
    cols, n = ns.table.cols, ns.table.n_rows
    rows = np.flatnonzero(cols["copy_ver"][:n, Tier.HOST] > 0)
    # every slot is free, a row's copy, or retired: none was lost to the abandoned get
    assert st.pool.free_count + rows.size + int(st.retired.sum()) == st.pool.n_slots
    found, out = eng.read("m", keys(range(N)))
    assert found.all() and (out == data).all()


def test_an_nvme_gets_decide_bring_up_batch_install_and_lease_are_steps_of_their_own(tmp_path):
    eng, data = _on_disk(tmp_path)
    try:
        names, res = _drive(eng, eng.get_steps("m", keys(range(N)), 0))
        assert names == ["_room_for_get", "_get_decide", "_bring_up_step", "_read_step",
                         "_finish_get", "_lease_step"]
        pool = eng.namespace("m").slots[Tier.HOST].pool
        assert res.found.all() and (pool.read(res.slots) == data).all()
        eng.release(res.lease_id)
        _nothing_held(eng, data)
    finally:
        eng.close(flush=False)


def test_what_runs_between_the_install_and_the_lease_never_changes_what_is_served(tmp_path):
    # Between the two steps: a rewrite of a block read (a put lands a new version in the
    # host tier), another get of the same blocks, and an eviction of everything evictable.
    # The get serves the bytes of the version it read, with that version's checksum; the
    # rewritten row counts no reader of the old version; nothing it serves was evicted.
    eng, data = _on_disk(tmp_path)
    new = blocks(1, BB, 7)
    try:
        def between(name: str) -> None:
            if name != "_finish_get":
                return
            eng.put("m", keys([N - 1]), new)
            other = eng.get("m", keys(range(N)))
            eng.release(other.lease_id)
            eng.evict(Tier.HOST, 4 * N)

        _, res = _drive(eng, eng.get_steps("m", keys(range(N)), 0), between)
        ns = eng.namespace("m")
        assert res.found.all()
        got = ns.slots[Tier.HOST].pool.read(res.slots)
        assert (got == data).all()                      # the version read, not the rewrite
        assert res.checksums.tolist() == checksums.block_checksums(data).tolist()
        rows = ns.table.lookup(keys(range(N)))
        readers = ns.table.cols["leases"][rows]
        assert readers[:-1].tolist() == [1] * (N - 1) and readers[-1] == 0
        eng.release(res.lease_id)
        found, out = eng.read("m", keys(range(N)))
        assert found.all() and (out[:-1] == data[:-1]).all() and (out[-1] == new[0]).all()
    finally:
        eng.close(flush=False)


@pytest.mark.parametrize("what", ["rewrite", "delete", "installed"])
def test_what_runs_between_the_decide_and_its_bring_up_is_decided_again(tmp_path, what,
                                                                         monkeypatch):
    # Between the decide (which pinned the resident half and left the bring-ups of the rest
    # to the next step) and the bring-up: one block to bring up is rewritten (its new version
    # in the host tier), deleted, or installed by another get. The bring-up step sees it and
    # decides the whole get again: the get serves what is current then, nothing it pinned
    # before stays pinned, and the rows' reader counts are its lease's only.
    eng, data = _on_disk(tmp_path)
    new = blocks(1, BB, 7)
    decides = []
    real = eng.gets._get_decide

    @functools.wraps(real)
    def counted(*a):
        if a[1] == keys(range(N)):             # this get's (not the other get's, between)
            decides.append(a)
        return real(*a)

    monkeypatch.setattr(eng.gets, "_get_decide", counted)
    try:
        def between(name: str) -> None:
            if name != "_get_decide":
                return
            if what == "rewrite":
                eng.put("m", keys([N - 1]), new)
            elif what == "delete":
                assert eng.delete("m", keys([N - 1])) == 1
            else:
                other = eng.get("m", keys([N - 1]))
                eng.release(other.lease_id)

        names, res = _drive(eng, eng.get_steps("m", keys(range(N)), 0), between)
        assert names.count("_get_decide") == 1 and "_bring_up_step" in names
        assert len(decides) == 2                # the split's, then the whole one again
        ns = eng.namespace("m")
        pool = ns.slots[Tier.HOST].pool
        want = data.copy()
        if what == "rewrite":
            want[-1] = new[0]
        if what == "delete":
            assert res.found.tolist() == [True] * (N - 1) + [False]
        else:
            assert res.found.all()
        served = np.flatnonzero(res.found)
        assert (pool.read(res.slots[served]) == want[served]).all()
        assert res.checksums[served].tolist() == checksums.block_checksums(want[served]).tolist()
        st = ns.slots[Tier.HOST]
        assert int(np.asarray(st.leases).sum()) == served.size     # the lease's pins only
        eng.release(res.lease_id)
        assert int(np.asarray(st.leases).sum()) == 0 and not eng.leases
    finally:
        eng.close(flush=False)


@pytest.mark.parametrize("at", ["_bring_up_step", "_read_step", "_finish_get", "_lease_step"])
def test_a_get_thrown_out_before_any_step_after_its_decide_holds_nothing(tmp_path, at):
    # The driver throws a CancelledError in instead of running the step (the server's loop
    # does so for a get whose awaiting task was cancelled). Before stall10 one thrown in at
    # the install step left every slot the get had pinned pinned for good.
    eng, data = _on_disk(tmp_path)
    try:
        with pytest.raises(asyncio.CancelledError):
            _drive(eng, eng.get_steps("m", keys(range(N)), 0), throw_at=at)
        _nothing_held(eng, data)
    finally:
        eng.close(flush=False)


@pytest.mark.parametrize("at", ["_bring_up_step", "_finish_get", "_lease_step"])
def test_a_get_cancelled_while_its_install_or_lease_is_queued_on_the_loop_holds_nothing(
        tmp_path, at):
    # The same through the loop's StepRunner: the get's task is cancelled while the step is
    # queued behind another slice; the runner throws the cancel in at that step, and the
    # get's pins end in a step of their own before the cancel reaches the task.
    eng, data = _on_disk(tmp_path)
    loop = asyncio.new_event_loop()
    pool = ThreadPoolExecutor(2, thread_name_prefix="test-io")
    try:
        runner = StepRunner(eng.lock, lambda fn, *a: loop.run_in_executor(pool, fn, *a),
                            lambda fn, *a: loop.run_in_executor(pool, fn, *a))
        runner.use_read_threads = False              # the read on the pool: no C threads

        async def scenario() -> None:
            queued = asyncio.Event()
            real = runner._push

            def push(fn, kind, target):
                real(fn, kind, target)
                if getattr(fn, "func", None) is not None and fn.func.__name__ == at:
                    queued.set()

            runner._push = push
            task = asyncio.ensure_future(runner.drive(eng.get_steps("m", keys(range(N)), 0)))
            await queued.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        loop.run_until_complete(scenario())
        _nothing_held(eng, data)
    finally:
        pool.shutdown()
        loop.close()
        eng.close(flush=False)


# ---------------------------------------------------------------- read_shares (the shared install)

needs_c = pytest.mark.skipif(gets._read_shares is None, reason="kvtier.coherence._gets not built")


def _numpy_shares(version, copy_ver, key, n_rows, tier, ok, rows, keys, versions):
    """What read_shares must answer, by numpy: -1 unless every record is installable as read
    (ok, its row in the table at the version read > 0, holding its key), else (k, have)."""
    inside = (rows >= 0) & (rows < n_rows)
    if not (ok.all() and inside.all()):
        return -1, None
    v = version[rows]
    if not ((v > 0) & (v == versions) & (key[rows] == keys)).all():
        return -1, None
    have = copy_ver[rows, tier] == v
    return int(have.sum()), have


@needs_c
def test_read_shares_answers_what_numpy_answers_on_random_tables():
    rng = np.random.default_rng(10)
    answers = {"refused": 0, "none shared": 0, "some shared": 0}
    for _ in range(400):
        n, nt = int(rng.integers(1, 12)), 4
        m = int(rng.integers(0, n + 1))
        version = rng.integers(0, 3, n).astype(np.uint64)
        copy_ver = np.where(rng.random((n, nt)) < 0.3, version[:, None], 0).astype(np.uint64)
        key = rng.integers(0, 2, (n, 16), dtype=np.uint8).view("V16").ravel()
        rows = rng.permutation(n)[:m].astype(np.int64)
        if m and rng.random() < 0.1:
            rows[0] = n                                  # a row past the table
        safe = np.minimum(rows, n - 1)
        ok = rng.random(m) < 0.95
        keys = key[safe].copy()
        versions = version[safe].copy()
        if m and rng.random() < 0.2:
            versions[-1] += 1                            # moved on while read
        tier = int(rng.integers(0, nt))
        have = np.full(m, True)
        k = gets._read_shares(version, copy_ver, key, n, tier, ok, rows, keys, versions, have)
        want_k, want_have = _numpy_shares(version, copy_ver, key, n, tier, ok, rows, keys,
                                          versions)
        assert k == want_k
        if k < 0:
            assert have.all()                            # nothing written when refused
            answers["refused"] += 1
        else:
            assert (have == want_have).all()
            answers["some shared" if k else "none shared"] += 1
        # read_installable says yes exactly when nothing is refused and nothing shared
        assert gets._read_installable(version, copy_ver, key, n, tier, ok, rows, keys,
                                      versions) == (k == 0)
    assert min(answers.values()) > 30, answers


@needs_c
def test_read_shares_refuses_bad_input_before_any_write():
    n, rows = 4, np.arange(2, dtype=np.int64)
    version, copy_ver = np.arange(1, n + 1, dtype=np.uint64), np.zeros((n, 4), np.uint64)
    key = np.arange(n * 16, dtype=np.uint8).view("V16")
    ok = np.ones(2, dtype=bool)
    args = (version, copy_ver, key, n, int(Tier.HOST), ok, rows, key[:2].copy(),
            version[:2].copy())
    have = np.zeros(2, dtype=bool)
    assert gets._read_shares(*args, have) == 0
    copy_ver[1, Tier.HOST] = 2
    assert gets._read_shares(*args, have) == 1 and have.tolist() == [False, True]
    for bad, match in (((version, copy_ver, key, n + 1) + args[4:], "shorter than n_rows"),
                       (args[:4] + (9,) + args[5:], "tier is past"),
                       (args[:5] + (ok[:1],) + args[6:], "differ in length")):
        with pytest.raises(ValueError, match=match):
            gets._read_shares(*bad, np.zeros(2, dtype=bool))
    with pytest.raises(ValueError, match="out_have is shorter"):
        gets._read_shares(*args, np.zeros(1, dtype=bool))
    with pytest.raises(TypeError, match="10 arguments"):
        gets._read_shares(*args)
    read_only = np.zeros(2, dtype=bool)
    read_only.setflags(write=False)
    with pytest.raises((ValueError, TypeError, BufferError)):
        gets._read_shares(*args, read_only)


@needs_c
@pytest.mark.parametrize("hbm", [False, True], ids=["host", "hbm-above"])
@pytest.mark.parametrize("seed", [5, 6])
def test_the_shared_install_leaves_the_state_the_general_install_leaves(
        tmp_path: Path, hbm: bool, seed: int, monkeypatch):
    # test_gets' interleavings (a rewrite between a read and its install, another get's
    # install of the same blocks, a failed verdict), with read_shares and without it (its
    # installs then take finish_read and install_read): the same state after every step.
    from tests import test_gets

    told: list[int] = []
    real = gets._read_shares

    def spy(*a):
        told.append(real(*a))
        return told[-1]

    with monkeypatch.context() as m:
        m.setattr(gets, "_read_shares", spy)
        with_shares = test_gets._state_after_interleaved_gets(tmp_path / "c", seed, hbm)
    assert sum(k > 0 for k in told) > 5 and -1 in told, told
    with monkeypatch.context() as m:
        m.setattr(gets, "_read_shares", None)
        assert test_gets._state_after_interleaved_gets(tmp_path / "g", seed, hbm) == with_shares


@needs_c
def test_a_read_another_get_installed_first_is_shared_pinned_once_per_lease(tmp_path, monkeypatch):
    # Gets A and B of the same NVMe blocks, both decided (both plan a read) before either
    # installs: A installs, then B's install finds every copy current already and shares them
    # (read_shares, install_shared). While both leases are held each served slot holds two
    # pins, B's own read slots are free again, and an eviction of everything takes none of
    # the served blocks; after both releases nothing is pinned.
    from kvtier.coherence import transfers

    eng, data = _on_disk(tmp_path)
    shared: list[int] = []
    real = transfers.Transfers.install_shared

    def spy(self, plan, tier, pos, slots, have):
        shared.append(int(have.sum()))
        return real(self, plan, tier, pos, slots, have)

    monkeypatch.setattr(transfers.Transfers, "install_shared", spy)
    try:
        ns = eng.namespace("m")
        st = ns.slots[Tier.HOST]
        ids = list(range(N // 2, N))                     # on NVMe only
        a = eng.get_steps("m", keys(ids), 0)
        b = eng.get_steps("m", keys(ids), 0)
        sa, _ = advance(a, None, None)
        sb, _ = advance(b, None, None)

        sa, _ = _run_until(eng, a, sa, "_finish_get")    # A read, its install next
        sb, _ = _run_until(eng, b, sb, "_finish_get")    # B read too
        free_before = st.pool.free_count
        res_a = _run_until(eng, a, sa)[1]
        res_b = _run_until(eng, b, sb)[1]
        assert shared == [len(ids)]
        assert res_b.slots.tolist() == res_a.slots.tolist()
        assert st.leases[res_a.slots].tolist() == [2] * len(ids)
        assert st.pool.free_count == free_before + len(ids)   # B's read slots went back
        eng.evict(Tier.HOST, 4 * N)
        assert (ns.slots[Tier.HOST].pool.read(res_b.slots) == data[ids]).all()
        eng.release(res_a.lease_id)
        assert st.leases[res_b.slots].tolist() == [1] * len(ids)
        eng.release(res_b.lease_id)
        _nothing_held(eng, data)
    finally:
        eng.close(flush=False)


def _run_one(eng: Engine, step):
    """One step's value: a locked one under the engine lock."""
    if not step.locked:
        return step.fn()
    with eng.lock:
        return step.fn()


def _run_until(eng: Engine, gen, step, until: str | None = None):
    """Run gen from step up to its locked step named until (not run), or to its end: (that
    step or None, the result)."""
    out = None
    while step is not None and not (step.locked and _name(step) == until):
        step, out = advance(gen, _run_one(eng, step), None)
    return step, out
