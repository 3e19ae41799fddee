"""kvtier.coherence.transfers and the engine's slot writes: the NVMe bring-up's hit check
(_gets.c nvme_hits), Engine.set_copy's writes (set_copies) and Engine.touch's (touch_rows),
each one C call where kvtier.coherence._gets is built, leave what the numpy code leaves; the
calls' answers against numpy on random tables, and their refusals before any write."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.coherence import engine, transfers
from kvtier.types import Tier
from tests import test_eviction, test_gets

pytestmark = pytest.mark.skipif(
    transfers._nvme_hits is None or engine._set_copies is None or transfers._fast is None,
    reason="kvtier.coherence._gets or _fast was not built")

_C = {"nvme_hits": transfers._nvme_hits, "set_copies": engine._set_copies,
      "touch_rows": engine._touch_rows}


def _spy(monkeypatch, calls: dict[str, int]) -> None:
    """The three C calls counted (by name) as they run."""
    def counted(name):
        def call(*args):
            calls[name] += 1
            return _C[name](*args)
        return call
    monkeypatch.setattr(transfers, "_nvme_hits", counted("nvme_hits"))
    monkeypatch.setattr(engine, "_set_copies", counted("set_copies"))
    monkeypatch.setattr(engine, "_touch_rows", counted("touch_rows"))


def _numpy(monkeypatch) -> None:
    monkeypatch.setattr(transfers, "_nvme_hits", None)
    monkeypatch.setattr(transfers, "_fast", None)          # the bring-up's pins
    monkeypatch.setattr(engine, "_set_copies", None)
    monkeypatch.setattr(engine, "_touch_rows", None)


@pytest.mark.parametrize("policy", ["chain", "lru"])
@pytest.mark.parametrize("hbm", [False, True], ids=["host", "hbm-above"])
def test_puts_evictions_and_gets_leave_the_numpy_state_with_the_c_writes(
        tmp_path: Path, hbm: bool, policy: str, monkeypatch):
    # test_eviction's workload: puts (dirty under write-back), flushes, admin evictions and
    # gets whose bring-ups evict, rewrites between a read and its install; after every step
    # the page table (accesses included), slot arrays, free stacks, policy states, counters.
    calls = dict.fromkeys(_C, 0)
    with monkeypatch.context() as m:
        _spy(m, calls)
        with_c = test_eviction._state_after(tmp_path / "c", 3, hbm, policy)
    if hbm:                             # (the general bring-up: HBM may hold the source)
        assert calls.pop("nvme_hits") == 0
    assert min(calls.values()) > 20, calls
    with monkeypatch.context() as m:
        _numpy(m)
        assert test_eviction._state_after(tmp_path / "numpy", 3, hbm, policy) == with_c


@pytest.mark.parametrize("hbm", [False, True], ids=["host", "hbm-above"])
@pytest.mark.parametrize("seed", [5, 6])
def test_interleaved_installs_leave_the_numpy_state_with_the_c_writes(
        tmp_path: Path, hbm: bool, seed: int, monkeypatch):
    # test_gets' interleavings between a read and its install: a rewrite (not installed),
    # another get's install of the same blocks (shared), a failed verdict (dropped).
    calls = dict.fromkeys(_C, 0)
    with monkeypatch.context() as m:
        _spy(m, calls)
        with_c = test_gets._state_after_interleaved_gets(tmp_path / "c", seed, hbm)
    if hbm:
        assert calls.pop("nvme_hits") == 0
    assert min(calls.values()) > 20, calls
    with monkeypatch.context() as m:
        _numpy(m)
        assert test_gets._state_after_interleaved_gets(tmp_path / "numpy", seed, hbm) == with_c


def _table(rng: np.random.Generator, n: int = 12, nt: int = 4, pool: int = 10):
    """Random columns: versions (some 0), copy_ver with current, stale and no copies per
    tier, slots, the accesses."""
    version = rng.integers(0, 4, n).astype(np.uint64)
    copy_ver = rng.integers(0, 4, (n, nt)).astype(np.uint64)
    same = rng.random((n, nt)) < 0.5
    copy_ver[same] = np.broadcast_to(version[:, None], (n, nt))[same]
    slot = rng.integers(-1, pool, (n, 3)).astype(np.int32)
    last = rng.integers(0, 50, n).astype(np.uint64)
    return {"version": version, "copy_ver": copy_ver, "slot": slot, "last": last,
            "prev": rng.integers(0, 50, n).astype(np.uint64),
            "freq": rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32),
            "slot_row": rng.integers(-1, n, pool).astype(np.int64)}


def test_nvme_hits_keeps_the_positions_whose_nvme_copy_is_current():
    rng = np.random.default_rng(0)
    nvme = int(Tier.NVME)
    some_miss = 0
    for _ in range(300):
        c = _table(rng)
        n = int(rng.integers(1, 10))
        rows = rng.integers(-1, 12, n).astype(np.int64)
        todo = np.flatnonzero(rows >= 0)[rng.permutation(int((rows >= 0).sum()))]
        todo = todo[: int(rng.integers(0, todo.size + 1))]
        found_c, found_np = rng.random(n) < 0.8, None
        found_np = found_c.copy()
        out_todo, out_rows = np.full(todo.size, -9, np.int64), np.full(todo.size, -9, np.int64)
        k = transfers._nvme_hits(c["version"], c["copy_ver"], rows, todo, 12, nvme, found_c,
                                 out_todo, out_rows)
        r = rows[todo]
        hit = c["copy_ver"][r, nvme] == c["version"][r]
        found_np[todo[~hit]] = False
        assert k == int(hit.sum())
        assert out_todo[:k].tolist() == todo[hit].tolist()
        assert out_rows[:k].tolist() == r[hit].tolist()
        assert found_c.tolist() == found_np.tolist()
        some_miss += k < todo.size
    assert some_miss > 50


def test_set_copies_writes_what_the_numpy_assignments_write():
    rng = np.random.default_rng(1)
    for _ in range(300):
        a, b = _table(rng), None
        b = {k: v.copy() for k, v in a.items()}
        n = int(rng.integers(0, 9))
        rows = rng.integers(0, 12, n).astype(np.int64)        # repeats: the last one wins
        slots = rng.integers(0, 10, n).astype(np.int64)
        vers = rng.integers(0, 9, n).astype(np.uint64)
        tier = int(rng.integers(0, 3))
        assert engine._set_copies(a["slot"], a["copy_ver"], a["slot_row"], rows, tier, slots,
                                  vers) is None
        b["slot"][rows, tier] = slots
        b["copy_ver"][rows, tier] = vers
        b["slot_row"][slots] = rows
        for name in a:
            assert a[name].tolist() == b[name].tolist(), name


def test_touch_rows_counts_a_repeated_row_as_numpy_does():
    rng = np.random.default_rng(2)
    repeated = 0
    for _ in range(300):
        a = _table(rng)
        b = {k: v.copy() for k, v in a.items()}
        n = int(rng.integers(0, 12))
        rows = rng.integers(0, 12, n).astype(np.int64)
        clock = int(rng.integers(50, 2**40))
        assert engine._touch_rows(a["last"], a["prev"], a["freq"], rows, clock) is None
        b["prev"][rows] = b["last"][rows]
        b["last"][rows] = np.arange(clock + 1, clock + n + 1, dtype=np.uint64)
        b["freq"][rows] += 1                   # once per distinct row, wrapping at 2^32
        for name in ("last", "prev", "freq"):
            assert a[name].tolist() == b[name].tolist(), name
        repeated += np.unique(rows).size < rows.size
    assert repeated > 100


def test_the_three_calls_refuse_a_broken_table_before_they_write():
    rng = np.random.default_rng(3)
    c = _table(rng)
    before = {k: v.copy() for k, v in c.items()}
    i64 = lambda *v: np.array(v, dtype=np.int64)      # noqa: E731
    u64 = lambda *v: np.array(v, dtype=np.uint64)     # noqa: E731
    found = np.ones(3, bool)
    out = np.empty(3, np.int64), np.empty(3, np.int64)
    bad_hits = [(i64(0, 1, 2), i64(0, 3), 12, 2),       # a position past rows
                (i64(0, 1, 12), i64(0, 2), 12, 2),      # its row past the table
                (i64(0, 1, 5), i64(0, 2), 5, 2),        # (n_rows 5)
                (i64(0, 1, 2), i64(0, -1), 12, 2),
                (i64(0, 1, 2), i64(0, 1), 13, 2),       # n_rows past the columns
                (i64(0, 1, 2), i64(0, 1), 12, 4)]       # the tier past them
    for rows, todo, n_rows, tier in bad_hits:
        with pytest.raises(ValueError):
            transfers._nvme_hits(c["version"], c["copy_ver"], rows, todo, n_rows, tier, found,
                                 *out)
    with pytest.raises(ValueError):                     # found shorter than rows
        transfers._nvme_hits(c["version"], c["copy_ver"], i64(0, 1, 2, 3), i64(0), 12, 2,
                             found, *out)
    assert found.all()
    bad_sets = [(i64(0, 12), i64(1, 2), u64(1, 1), 1),  # a row past the columns
                (i64(0, -1), i64(1, 2), u64(1, 1), 1),
                (i64(0, 1), i64(1, 10), u64(1, 1), 1),  # a slot past the pool
                (i64(0, 1), i64(1, -1), u64(1, 1), 1),
                (i64(0, 1), i64(1, 2), u64(1, 1), 3),   # the tier past the slot columns
                (i64(0, 1), i64(1), u64(1, 1), 1)]      # lengths differ
    for rows, slots, vers, tier in bad_sets:
        with pytest.raises(ValueError):
            engine._set_copies(c["slot"], c["copy_ver"], c["slot_row"], rows, tier, slots, vers)
    with pytest.raises(TypeError):                      # slots of another item size
        engine._set_copies(c["slot"], c["copy_ver"], c["slot_row"], i64(0),
                           1, np.array([1], np.int32), u64(1))
    for rows in (i64(0, 12), i64(-1, 0)):
        with pytest.raises(ValueError):
            engine._touch_rows(c["last"], c["prev"], c["freq"], rows, 60)
    with pytest.raises(OverflowError):
        engine._touch_rows(c["last"], c["prev"], c["freq"], i64(0), -1)
    for name in c:
        assert c[name].tolist() == before[name].tolist(), name
