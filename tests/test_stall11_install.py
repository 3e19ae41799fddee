"""kvtier.coherence._gets install_shares (stall11): an NVMe read's install that shares the
copies another get installed first, in one C call, leaves the state that Transfers'
numpy install_shared leaves (columns, slot arrays, retired marks, the pool's free stack, the
host budget, every tier policy's state), and refuses bad input before writing anything."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.coherence import gets, transfers
from tests import test_gets
from tests import test_get_faults

eng = test_get_faults.eng       # its engine fixture: keys 0..5 on NVMe only, the C install or not

needs_c = pytest.mark.skipif(transfers._install_shares is None or gets._read_shares is None,
                             reason="kvtier.coherence._gets not built")


def _full_snapshot(eng, seen: list) -> None:
    """test_gets' snapshot, and what it leaves out that a shared install writes or could:
    the retired marks, the pool's free stack (its order decides the next slots handed out),
    the host budget and each tier policy's state."""
    _base_snapshot(eng, seen)
    ns = eng.namespace("m")
    for tier, st in sorted(ns.slots.items()):
        stack, low = st.pool.stack() if hasattr(st.pool, "stack") else (None, None)
        seen.append((int(tier), st.retired.tolist(),
                     None if stack is None else (stack[low:].tolist(), low),
                     None if st.policy is None else _plain(st.policy.state())))
    seen.append(eng.host_used)


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


_base_snapshot = test_gets._snapshot


def _state(tmp: Path, seed: int, hbm: bool, eviction: str, monkeypatch) -> list:
    from tests import engines

    real_small = engines.small_engine

    def small(t, h, **settings):
        return real_small(t, h, eviction=eviction, **settings)

    with monkeypatch.context() as m:
        m.setattr(test_gets, "_snapshot", _full_snapshot)
        m.setattr(test_gets, "small_engine", small)
        return test_gets._state_after_interleaved_gets(tmp, seed, hbm)


@needs_c
@pytest.mark.parametrize("eviction", ["lru", "s3fifo", "chain"])
@pytest.mark.parametrize("hbm", [False, True], ids=["host", "hbm-above"])
@pytest.mark.parametrize("seed", [5, 6, 7])
def test_the_c_shared_install_leaves_the_state_the_numpy_one_leaves(
        tmp_path: Path, hbm: bool, seed: int, eviction: str, monkeypatch):
    # test_gets' interleavings (a rewrite between a read and its install, another get's
    # install of the same blocks, a failed verdict): install_shares against install_shared's
    # numpy, after every step. The slots going back are not told to the policy in C (never
    # placed): the policies' states say it changes nothing.
    calls: list[int] = []
    real = transfers._install_shares

    def spy(*a):
        calls.append(int(np.asarray(a[9]).sum()))
        return real(*a)

    with monkeypatch.context() as m:
        m.setattr(transfers, "_install_shares", spy)
        with_c = _state(tmp_path / "c", seed, hbm, eviction, monkeypatch)
    assert sum(k > 0 for k in calls) > 5, calls          # it shared, many times
    with monkeypatch.context() as m:
        m.setattr(transfers, "_install_shares", None)
        assert _state(tmp_path / "n", seed, hbm, eviction, monkeypatch) == with_c


def _args(m=4, p=16, c=10, nt=3, tier=1):
    """A consistent table: rows 0..m-1, the even ones current in tier at slot 8 + row (to be
    shared), our read slots 0..m-1, each pinned once."""
    slot = np.full((c, nt), -1, dtype=np.int32)
    copy_ver = np.zeros((c, nt), dtype=np.uint64)
    slot_row = np.full(p, -1, dtype=np.int64)
    leases = np.zeros(p, dtype=np.uint32)
    retired = np.zeros(p, dtype=bool)
    rows = np.arange(m, dtype=np.int64)
    have = rows % 2 == 0
    for r in rows[have]:
        slot[r, tier], copy_ver[r, tier], slot_row[8 + r] = 8 + r, 5, r
    dst = np.arange(m, dtype=np.int64)
    leases[dst] = 1
    versions = np.full(m, 5, dtype=np.uint64)
    pos = np.arange(m, dtype=np.int64)[::-1].copy()
    out_slots = np.full(m, -1, dtype=np.int64)
    out = np.zeros((3, m), dtype=np.int64)
    return [slot, copy_ver, slot_row, leases, retired, rows, tier, dst, versions, have, pos,
            out_slots, out]


@needs_c
def test_install_shares_writes_what_it_says():
    a = _args()
    slot, copy_ver, slot_row, leases, retired = a[:5]
    tier, out_slots, out = a[6], a[11], a[12]
    leases[2] = 2                    # our slot 2 pinned elsewhere too: its count kept
    k_mine, k_back = transfers._install_shares(*a)
    assert (k_mine, k_back) == (2, 2)
    assert out[0, :2].tolist() == [1, 3] and out[1, :2].tolist() == [1, 3]
    assert out[2, :2].tolist() == [0, 2]    # going back: retired, still pinned
    # positions reversed: row i at position 3 - i; shared rows served from 8 + row
    assert out_slots.tolist() == [3, 10, 1, 8]
    assert slot[[1, 3], tier].tolist() == [1, 3] and copy_ver[[1, 3], tier].tolist() == [5, 5]
    assert slot_row[[0, 1, 2, 3]].tolist() == [-1, 1, -1, 3]
    assert leases[[0, 1, 2, 3, 8, 10]].tolist() == [1, 1, 2, 1, 1, 1]
    assert retired.tolist() == [True, False, True] + [False] * 13


@needs_c
@pytest.mark.parametrize("bad", ["row", "dst", "pos", "unpinned", "theirs", "tier", "length",
                                 "out"])
def test_install_shares_refuses_bad_input_before_any_write(bad):
    a = _args()
    if bad == "row":
        a[5] = np.array([0, 1, 2, 99], dtype=np.int64)
    elif bad == "dst":
        a[7] = np.array([0, 1, 2, 16], dtype=np.int64)
    elif bad == "pos":
        a[10] = np.array([0, 1, 2, 4], dtype=np.int64)
    elif bad == "unpinned":
        a[3][2] = 0                  # a shared record's slot of ours holds no pin
    elif bad == "theirs":
        a[0][2, 1] = 40              # the shared row's slot past the pool
    elif bad == "tier":
        a[6] = 3
    elif bad == "length":
        a[8] = a[8][:3].copy()
    elif bad == "out":
        a[12] = np.zeros((2, 4), dtype=np.int64)
    before = [x.copy() if isinstance(x, np.ndarray) else x for x in a]
    with pytest.raises(ValueError):
        transfers._install_shares(*a)
    for x, y in zip(a, before):
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y)


# ------------------------------------------------------------------ faults in the shared install

@needs_c
@pytest.mark.parametrize("seam", ["install_shares", "unpin_slots", "placed"])
def test_a_shared_install_that_raises_in_c_or_after_ends_every_pin_once(
        eng, monkeypatch, seam: str):
    # test_get_faults' share-and-raise case at the C path's seams (its set_copy and free_slots
    # seams are not called by it): key 0 is installed by another get while this one's read is
    # in flight, so the install shares that copy and gives its own slot back. A fault in the
    # C call (before any write: a broken table's ValueError), in the unpin that frees the
    # read's slots going back, or in the policy's notice of the copies placed must end the
    # share's pin and
    # every slot of the read, each once. (Injected: none of these raises for a real fault
    # short of no memory.)
    from tests.conftest import drive_get, keys
    from tests.test_get_faults import BATCH, Injected, _held, _once, _whole_get

    if gets._read_installable is None:          # (the fixture's numpy-install)
        pytest.skip("the numpy install shares through install_read: test_get_faults' case")
    before = _held(eng)
    ns = eng.namespace("m")
    other = {}
    called: list[str] = []

    def meanwhile(p) -> None:
        res = eng.get("m", keys([0]))
        other["slot"] = int(res.slots[0])
        eng.release(res.lease_id)
        if seam == "install_shares":
            m.setattr(transfers, "_install_shares", _once(transfers._install_shares))
        else:
            m.setattr(eng, seam, _once(getattr(eng, seam)))
        called.append(seam)

    with monkeypatch.context() as m:
        with pytest.raises(Injected):
            drive_get(eng, eng.get_steps("m", keys(BATCH)), before_install=meanwhile)
    assert called == [seam]
    after = _held(eng)
    assert after["pins"] == 0 and after["leases"] == 0 and after["readers"] == 0
    assert after["accounted"] and after["slot_rows"]
    # Key 0's copy (the other get's) stays; nothing else of this get's read does.
    row0 = int(ns.table.lookup(ns.table.keys_array(keys([0])))[0])
    assert after["copies"] == sorted(before["copies"] + [(row0, other["slot"])])
    assert after["free"] == before["free"] - 1
    assert after["host_used"] == before["host_used"] + test_gets.BB
    _whole_get(eng)
