"""kvtier.coherence._fast on its own: refusals write nothing, bad arrays are typed errors.

The engine-level agreement with the numpy reference is
tests/test_engine.py::test_fast_paths_leave_the_state_the_batch_path_leaves.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.coherence import fastpath

_fast = fastpath._fast
pytestmark = pytest.mark.skipif(_fast is None, reason="kvtier.coherence._fast was not built")

CAP, TIERS, SLOT_TIERS, SLOTS, HOST = 8, 4, 3, 6, 1


def columns() -> dict[str, np.ndarray]:
    """Four resident rows (0-3) in slots 5, 4, 3, 2 of the host tier; row 4 holds a stale copy."""
    c = {"version": np.zeros(CAP, np.uint64), "copy_ver": np.zeros((CAP, TIERS), np.uint64),
         "slot": np.full((CAP, SLOT_TIERS), -1, np.int32), "leases": np.zeros(CAP, np.uint16),
         "last_access": np.zeros(CAP, np.uint64), "prev_access": np.zeros(CAP, np.uint64),
         "freq": np.zeros(CAP, np.uint32), "checksum": np.zeros(CAP, np.uint64),
         "pool": np.zeros(SLOTS, np.uint32), "retired": np.zeros(SLOTS, bool)}
    for r in range(5):
        c["version"][r] = 10 + r
        c["copy_ver"][r, HOST] = 10 + r if r < 4 else 9
        c["slot"][r, HOST] = 5 - r
        c["checksum"][r] = 1000 + r
        c["last_access"][r] = 3
    return c


def lease(c: dict[str, np.ndarray], rows: list[int], n_rows: int = 5, clock: int = 7,
          out: tuple | None = None) -> bool:
    n = len(rows)
    out = out or (np.empty(n, np.int32), np.empty(n, np.uint64), np.empty(n, np.uint64))
    ok = _fast.lease_rows(c["version"], c["copy_ver"], c["slot"], c["leases"], c["last_access"],
                          c["prev_access"], c["freq"], c["checksum"], c["pool"],
                          np.array(rows, np.int64), n_rows, HOST, clock, *out)
    c["out"] = out
    return ok


def snapshot(c: dict[str, np.ndarray]) -> dict[str, list]:
    return {k: v.tolist() for k, v in c.items() if k != "out"}


def test_a_resident_batch_is_pinned_touched_and_reported():
    c = columns()
    assert lease(c, [2, 0, 2])
    slots, versions, sums = c["out"]
    assert slots.tolist() == [3, 5, 3] and versions.tolist() == [12, 10, 12]
    assert sums.tolist() == [1002, 1000, 1002]
    assert c["pool"].tolist() == [0, 0, 0, 2, 0, 1]            # two pins of slot 3
    assert c["leases"][:3].tolist() == [1, 0, 2]
    assert c["freq"][:3].tolist() == [1, 0, 1]                 # a repeated row counts once
    assert c["last_access"][:3].tolist() == [9, 3, 10]         # the last occurrence wins
    assert c["prev_access"][[0, 2]].tolist() == [3, 3]         # from before the batch


@pytest.mark.parametrize("rows,n_rows", [([0, 4], 5),        # row 4's copy is stale
                                         ([0, 5], 5),        # a row with no version
                                         ([0, 3], 3),        # past n_rows
                                         ([0, -1], 5)])      # a miss
def test_a_batch_with_anything_not_resident_is_refused_untouched(rows, n_rows):
    c = columns()
    before = snapshot(c)
    assert lease(c, rows, n_rows) is False
    assert snapshot(c) == before


def test_a_slot_past_the_pool_is_refused_untouched():
    c = columns()
    c["slot"][1, HOST] = SLOTS                                 # a damaged column
    before = snapshot(c)
    assert lease(c, [0, 1]) is False
    assert snapshot(c) == before


def test_unlease_frees_a_retired_slot_once_and_never_goes_below_zero():
    c = columns()
    assert lease(c, [2, 2, 1])
    c["retired"][3] = True                                     # a rewrite retired row 2's slot
    c["version"][1] = 99                                       # row 1 was rewritten too
    gone = np.empty(3, np.int64)
    k = _fast.unlease_rows(c["pool"], c["retired"], c["version"], c["leases"], 5,
                           np.array([3, 3, 4], np.int64), np.array([2, 2, 1], np.int64),
                           np.array([12, 12, 11], np.uint64), gone)
    assert k == 1 and gone[0] == 3 and not c["retired"][3]
    assert c["pool"].tolist() == [0] * SLOTS
    assert c["leases"][:3].tolist() == [0, 1, 0]               # row 1 no longer at version 11
    k = _fast.unlease_rows(c["pool"], c["retired"], c["version"], c["leases"], 5,
                           np.array([3], np.int64), np.array([2], np.int64),
                           np.array([12], np.uint64), gone)
    assert k == 0 and c["pool"][3] == 0 and c["leases"][2] == 0     # a second end: no wrap


def test_unlease_one_does_what_unlease_rows_does_for_one_slot():
    """Every case of a one-slot release (retired or not, the row rewritten, past n_rows, a
    second end) through both entry points from the same columns: the same columns after."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        a = columns()
        a["pool"][:] = rng.integers(0, 3, SLOTS)
        a["retired"][:] = rng.random(SLOTS) < 0.5
        a["leases"][:] = rng.integers(0, 3, CAP)
        b = {k: v.copy() for k, v in a.items()}
        slot, row = int(rng.integers(0, SLOTS)), int(rng.integers(-1, CAP))
        ver, n_rows = int(rng.integers(9, 16)), int(rng.integers(0, CAP + 1))
        gone = np.empty(1, np.int64)
        k = _fast.unlease_rows(a["pool"], a["retired"], a["version"], a["leases"], n_rows,
                               np.array([slot], np.int64), np.array([row], np.int64),
                               np.array([ver], np.uint64), gone)
        one = _fast.unlease_one(b["pool"], b["retired"], b["version"], b["leases"], n_rows,
                                slot, row, ver)
        assert one is (k == 1)
        assert snapshot(a) == snapshot(b)


@pytest.mark.parametrize("bad", ["slot_past", "slot_negative", "version_negative", "dtype",
                                 "nargs"])
def test_unlease_one_refuses_bad_input_writing_nothing(bad):
    c = columns()
    assert lease(c, [0])
    args = [c["pool"], c["retired"], c["version"], c["leases"], 5, 5, 0, 10]
    if bad == "slot_past":
        args[5] = SLOTS
    elif bad == "slot_negative":
        args[5] = -1
    elif bad == "version_negative":
        args[7] = -1
    elif bad == "dtype":
        args[0] = c["pool"].astype(np.uint16)
    else:
        args = args[:7]
    before = snapshot(c)
    with pytest.raises((TypeError, ValueError, OverflowError)):
        _fast.unlease_one(*args)
    assert snapshot(c) == before


@pytest.mark.parametrize("bad", ["dtype", "short_column", "short_out", "fortran", "tier"])
def test_bad_arrays_are_typed_errors_that_write_nothing(bad):
    c = columns()
    out = (np.empty(2, np.int32), np.empty(2, np.uint64), np.empty(2, np.uint64))
    tier = HOST
    if bad == "dtype":
        c["leases"] = c["leases"].astype(np.uint32)
    elif bad == "short_column":
        c["freq"] = c["freq"][:2]
    elif bad == "short_out":
        out = (np.empty(1, np.int32), out[1], out[2])
    elif bad == "fortran":
        c["copy_ver"] = np.asfortranarray(c["copy_ver"])
    else:
        tier = SLOT_TIERS
    before = snapshot(c)
    with pytest.raises((TypeError, ValueError, BufferError)):
        _fast.lease_rows(c["version"], c["copy_ver"], c["slot"], c["leases"], c["last_access"],
                         c["prev_access"], c["freq"], c["checksum"], c["pool"],
                         np.array([0, 1], np.int64), 5, tier, 7, *out)
    assert snapshot(c) == before
    with pytest.raises(TypeError):
        _fast.lease_rows(1, 2, 3)
    c = columns()
    with pytest.raises(ValueError):                            # a slot past the pool
        _fast.unlease_rows(c["pool"], c["retired"], c["version"], c["leases"], 5,
                           np.array([SLOTS], np.int64), np.array([0], np.int64),
                           np.array([10], np.uint64), np.empty(1, np.int64))


def test_pin_slots_adds_one_pin_per_listed_slot_and_refuses_a_slot_past_the_pool():
    pool = np.zeros(SLOTS, np.uint32)
    _fast.pin_slots(pool, np.array([3, 5, 3], np.int64))
    assert pool[[3, 5]].tolist() == [2, 1] and int(pool.sum()) == 3
    with pytest.raises(ValueError, match="past the pool"):
        _fast.pin_slots(pool, np.array([1, SLOTS], np.int64))
    assert int(pool.sum()) == 3                       # checked before anything is written


def _eviction_columns(rng: np.random.Generator, step: int, cap: int, nt: int, ns: int,
                      slots: int) -> tuple[dict[str, np.ndarray], int, np.ndarray]:
    """Random page-table columns and a slot tier's arrays for the eviction helpers' tests
    (no copy placed yet), a tier, and a permutation of the slots to place copies in."""
    from kvtier.coherence.states import BlockState
    c = {"copy_ver": rng.integers(0, 3, (cap, nt)).astype(np.uint64),
         "slot": np.full((cap, ns), -1, np.int32),
         "slot_row": np.full(slots, -1, np.int64),
         "pool": (rng.random(slots) < 0.2).astype(np.uint32),
         "retired": np.zeros(slots, bool),
         "version": rng.integers(0, 3, cap).astype(np.uint64),
         "state": rng.choice([int(s) for s in BlockState], cap).astype(np.uint8),
         "checksum": rng.integers(0, 1 << 60, cap).astype(np.uint64),
         "nvme_checksum": rng.integers(0, 1 << 60, cap).astype(np.uint64)}
    if step % 3:                                   # mostly states that can lose a block
        c["state"][:] = int(BlockState.CLEAN)
    return c, int(rng.integers(0, ns)), rng.permutation(slots)


def test_drop_rows_does_what_release_copies_then_empty_rows_do():
    """An eviction's fused call against its two parts on copies of the same random columns:
    the same freed slots, dropped rows, fallbacks to NVMe and refusals (-1), column by column."""
    from kvtier.coherence.states import BlockState, Event, transition_array
    from kvtier.types import Tier
    lost = transition_array(Event.LOST)
    rng = np.random.default_rng(18)
    cap, nt, ns, slots = 40, len(Tier), 3, 64
    seen = set()
    for step in range(400):
        c, tier, free_slots = _eviction_columns(rng, step, cap, nt, ns, slots)
        for r in range(cap):
            if c["copy_ver"][r, tier]:
                c["slot"][r, tier] = free_slots[r]
                c["slot_row"][free_slots[r]] = r
        rows = rng.choice(cap, int(rng.integers(0, 12)), replace=False).astype(np.int64)
        a = {k: v.copy() for k, v in c.items()}
        fa, da = np.empty(rows.size, np.int64), np.empty(rows.size, np.int64)
        kf, kd = _fast.drop_rows(a["copy_ver"], a["slot"], a["slot_row"], a["pool"],
                                 a["retired"], rows, tier, fa, a["version"], a["state"],
                                 a["checksum"], a["nvme_checksum"], lost, int(Tier.NVME),
                                 int(BlockState.CLEAN), da)
        b = {k: v.copy() for k, v in c.items()}
        fb, db = np.empty(rows.size, np.int64), np.empty(rows.size, np.int64)
        kf2 = _fast.release_copies(b["copy_ver"], b["slot"], b["slot_row"], b["pool"],
                                   b["retired"], rows, tier, fb)
        kd2 = _fast.empty_rows(b["version"], b["copy_ver"], b["state"], b["checksum"],
                               b["nvme_checksum"], rows, lost, int(Tier.NVME),
                               int(BlockState.CLEAN), db)
        assert (kf, kd) == (kf2, kd2), step
        assert fa[:kf].tolist() == fb[:kf].tolist()
        assert kd < 0 or da[:kd].tolist() == db[:kd].tolist()
        for k in c:
            assert np.array_equal(a[k], b[k]), (step, k)
        seen.add((kf > 0, kd > 0, kd < 0))
    assert {(True, True, False), (True, False, True)} <= seen   # drops and refusals both met
    with pytest.raises(TypeError, match="16 arguments"):
        _fast.drop_rows(1, 2, 3)


def test_evict_slots_does_what_drop_rows_and_the_stack_s_free_do():
    """The lowest tier's fused eviction against drop_rows over slot_row[victims] and
    SlotStack.free of the freed slots, on copies of the same random columns and stack: the same
    columns, stack, top, freed count, dropped rows and refusals (-1); a victim that holds no
    row, a stack without room and short scratch are refused."""
    from kvtier.coherence.states import BlockState, Event, transition_array
    from kvtier.tiers.slots import SlotStack
    from kvtier.types import Tier
    lost = transition_array(Event.LOST)
    rng = np.random.default_rng(19)
    cap, nt, ns, slots = 40, len(Tier), 3, 64
    seen = set()
    for step in range(400):
        c, tier, free_slots = _eviction_columns(rng, step, cap, nt, ns, slots)
        for r in range(cap):
            c["copy_ver"][r, tier] = max(int(c["copy_ver"][r, tier]), 1)   # each holds one
            c["slot"][r, tier] = free_slots[r]
            c["slot_row"][free_slots[r]] = r
        held = np.flatnonzero(c["slot_row"] >= 0)
        victims = rng.choice(held, int(rng.integers(0, 12)), replace=False).astype(np.int64)
        stacks = []
        for _ in range(2):
            st = SlotStack()
            st._init_slots("t", slots)
            st.alloc(int(rng.integers(cap, slots)) if not stacks else stacks[0].used_count)
            stacks.append(st)
        a = {k: v.copy() for k, v in c.items()}
        stack, low = stacks[0].stack()
        scratch = np.full(2 * victims.size + 3, -7, np.int64)
        low2, kf, kd = _fast.evict_slots(
            a["copy_ver"], a["slot"], a["slot_row"], a["pool"], a["retired"], victims, tier,
            a["version"], a["state"], a["checksum"], a["nvme_checksum"], lost, int(Tier.NVME),
            int(BlockState.CLEAN), stack, low, scratch)
        stacks[0].pushed(low2)
        b = {k: v.copy() for k, v in c.items()}
        rows = b["slot_row"][victims]
        fb, db = np.empty(rows.size, np.int64), np.empty(rows.size, np.int64)
        kf2, kd2 = _fast.drop_rows(b["copy_ver"], b["slot"], b["slot_row"], b["pool"],
                                   b["retired"], rows, tier, fb, b["version"], b["state"],
                                   b["checksum"], b["nvme_checksum"], lost, int(Tier.NVME),
                                   int(BlockState.CLEAN), db)
        stacks[1].free(fb[:kf2])
        assert (kf, kd) == (kf2, kd2), step
        assert scratch[:victims.size].tolist() == rows.tolist()
        assert kd < 0 or scratch[victims.size:victims.size + kd].tolist() == db[:kd].tolist()
        assert stacks[0].free_count == stacks[1].free_count
        assert np.array_equal(stacks[0]._free, stacks[1]._free), step
        for k in c:
            assert np.array_equal(a[k], b[k]), (step, k)
        seen.add((kf > 0, kd > 0, kd < 0))
    assert {(True, True, False), (True, False, True)} <= seen   # drops and refusals both met
    args = lambda v, stack, low, scratch: (  # noqa: E731
        c["copy_ver"], c["slot"], c["slot_row"], c["pool"], c["retired"], v, tier, c["version"],
        c["state"], c["checksum"], c["nvme_checksum"], lost, int(Tier.NVME),
        int(BlockState.CLEAN), stack, low, scratch)
    empty = np.flatnonzero(c["slot_row"] < 0)[:1].astype(np.int64)
    before = {k: v.copy() for k, v in c.items()}
    full = np.arange(slots, dtype=np.int64)
    for bad, err in [((empty, full, 0, np.empty(8, np.int64)), "not a slot holding a row"),
                     ((np.array([slots], np.int64), full, 0, np.empty(8, np.int64)),
                      "not a slot holding a row"),
                     ((held[:2].astype(np.int64), full, 0, np.empty(3, np.int64)), "arrays"),
                     ((held[:2].astype(np.int64), full[:5], 0, np.empty(8, np.int64)),
                      "arrays")]:
        with pytest.raises(ValueError, match=err):
            _fast.evict_slots(*args(*bad))
        for k in c:
            assert np.array_equal(c[k], before[k]), k          # refused before any write
    with pytest.raises(RuntimeError, match="double free"):
        _fast.evict_slots(*args(held[:2].astype(np.int64), full, 0, np.empty(8, np.int64)))
    with pytest.raises(TypeError, match="17 arguments"):
        _fast.evict_slots(1, 2, 3)


def test_kept_views_follow_their_arrays_and_let_them_go():
    # cviews.h keeps the views of large arrays that own their memory between calls. A kept
    # view must never outlive its array's identity, serve a writable request from a read-only
    # view, or hold an mmap (a pool's bytes) open.
    import gc
    import mmap
    import weakref
    slots = np.arange(0, 2000, 7, dtype=np.int64)         # 2,288 bytes: kept as well
    pool = np.zeros(2000, np.uint32)
    _fast.pin_slots(pool, slots)
    _fast.pin_slots(pool, slots)
    assert pool[slots].tolist() == [2] * slots.size and pool.sum() == 2 * slots.size
    gone = weakref.ref(pool)
    del pool
    gc.collect()
    fresh = np.zeros(2000, np.uint32)                     # a miss: the dead entry is released
    _fast.pin_slots(fresh, slots)
    assert gone() is None
    assert fresh[slots].tolist() == [1] * slots.size and fresh.sum() == slots.size
    ro = np.zeros(300, np.int64)
    ro.flags.writeable = False
    _fast.pin_slots(fresh, ro)                            # kept read-only
    assert fresh[0] == 1 + 300
    with pytest.raises((ValueError, BufferError, TypeError)):
        _fast.unpin_slots(fresh, np.zeros(2000, bool), slots[:1], ro)   # ro as an output
    assert not ro.any() and fresh[0] == 1 + 300
    mm = mmap.mmap(-1, 8192)
    over = np.frombuffer(mm, dtype=np.uint32)             # not its own memory: never kept
    _fast.pin_slots(over, slots)
    assert over[slots].tolist() == [1] * slots.size
    del over
    mm.close()                                            # no export left behind
