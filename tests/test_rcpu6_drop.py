"""Round 6 of the replay's CPU (rcpu6): victims(n, drop=True), the lowest tier's eviction in
which the policy forgets its victims as it hands them out, against victims(n) then
on_remove; key_flags' zero test by words and its sets on the stack; the C returns built as
tuples directly."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.coherence.namespace import SlotState
from kvtier.coherence.policies import make_tier_policy, queues
from kvtier.pagetable import table as table_mod
from kvtier.pagetable.table import PageTable
from kvtier.tiers.host import SlotPool
from tests.conftest import keys


def _policy(name: str, n_slots: int):
    """A fresh page table, a slot tier of n_slots and its policy (a 2x ghost, 20% probation)."""
    table = PageTable(16)
    st = SlotState.for_pool(SlotPool("t", 1, n_slots))
    return table, st, make_tier_policy(name, st, table, {"ghost": "2x", "small": "0.2"})


def _evictions(name: str, seed: int, drop: bool, steps: int = 900) -> list:
    """A policy driven by random inserts, reads, leases, copies replaced in place and
    evictions whose every victim is freed at once: with drop, victims(n, drop=True) alone;
    without, victims(n) and on_remove of all of them. What each eviction returned and the
    policy's state() after every step."""
    table, st, pol = _policy(name, 20)
    rows, _ = table.insert(keys(range(1, 120)))
    cols = table.cols
    rng = np.random.default_rng(seed)
    clock = 0
    trail: list = []
    for _ in range(steps):
        op = int(rng.integers(0, 10))
        free = np.flatnonzero(st.slot_row < 0)
        busy = np.flatnonzero(st.slot_row >= 0)
        got = None
        if op < 4 and free.size:
            k = int(rng.integers(1, min(free.size, 7) + 1))
            slots = rng.choice(free, k, replace=False).astype(np.int64)
            cand = np.setdiff1d(rows, st.slot_row[busy])
            r = rng.choice(cand, k, replace=False).astype(np.int64)
            cols["freq"][r] += 1
            cols["last_access"][r] = np.arange(clock + 1, clock + k + 1)
            clock += k + int(rng.integers(0, 1500))      # epochs of 1,024 ticks go by
            st.slot_row[slots] = r
            pol.on_insert(r, slots)
        elif op < 6 and busy.size:                       # reads of resident blocks
            r = st.slot_row[rng.choice(busy, min(busy.size, 3), replace=False)]
            cols["freq"][r] += 1
            cols["last_access"][r] = np.arange(clock + 1, clock + r.size + 1)
            clock += r.size
        elif op == 6 and busy.size:                      # a lease comes or goes
            s = rng.choice(busy)
            st.leases[s] = 0 if st.leases[s] else 1
        elif op < 9:                                     # the lowest tier's eviction
            n = int(rng.integers(1, 9))
            if drop:
                v = pol.victims(n, drop=True)
            else:
                v = pol.victims(n)
                if v.size:
                    pol.on_remove(v)
            st.slot_row[v] = -1
            got = v.tolist()
        elif busy.size:                                  # a copy replaced in place
            s = rng.choice(busy, 1).astype(np.int64)
            r = st.slot_row[s].copy()
            pol.on_remove(s)
            pol.on_insert(r, s)
        trail.append((got, pol.state()))
    return trail


@pytest.mark.parametrize("with_c", [True, False], ids=["c", "numpy"])
@pytest.mark.parametrize("name", ["lru", "s3fifo", "chain"])
def test_victims_with_drop_leave_what_victims_and_on_remove_leave(name, with_c, monkeypatch):
    # The same victims in the same order, and the same state after every step (where, stamps,
    # counters, rings, the ghost, S3Fifo's stash of replaced copies), through leased entries,
    # ghost hits and epochs going by.
    if with_c and queues._queues is None:
        pytest.skip("kvtier.coherence.policies._queues was not built here")
    if not with_c:
        monkeypatch.setattr(queues, "_queues", None)
    for seed in (3, 4):
        dropped = _evictions(name, seed, drop=True)
        removed = _evictions(name, seed, drop=False)
        assert sum(1 for got, _ in dropped if got) > 100       # evictions did take victims
        for step, (a, b) in enumerate(zip(dropped, removed)):
            assert a == b, f"{name}, seed {seed}: drop parts from on_remove at step {step}"


def test_s3_victims_with_drop_refuses_a_key_column_without_the_victims_rows():
    # The drop's ghost step reads each victim's key: a key column shorter than a victim's row
    # is a ValueError, raised before any victim's where or the ghost is written.
    if queues._queues is None:
        pytest.skip("kvtier.coherence.policies._queues was not built here")
    table, st, pol = _policy("s3fifo", 8)
    rows, _ = table.insert(keys(range(1, 9)))
    st.slot_row[:] = rows
    pol.on_insert(rows.astype(np.int64), np.arange(8, dtype=np.int64))
    ghost_before = [a.copy() for a in pol._ghost_args]
    out = np.empty(4, dtype=np.int64)
    short = table.cols["key"][:2]
    with pytest.raises(ValueError, match="past the keys"):
        queues._queues.s3_victims(*pol._c_args(), st.slot_row, table.cols["freq"], st.leases,
                                  4, out, *pol._ghost_args, short, table.key_width)
    assert all((a == b).all() for a, b in zip(pol._ghost_args, ghost_before))
    assert (pol._where[out] == queues._SlotPolicy.PENDING).all()   # handed out, not dropped


@pytest.mark.parametrize("width", [1, 5, 8, 13, 16, 24, 40])
def test_c_key_flags_agree_with_numpy_on_zero_keys_and_repeats(width, monkeypatch):
    # Batches on both sides of the 64 keys whose sets sit on the stack; keys whose only
    # non-zero byte is the last (the zero test reads 8 bytes at a time, then the tail).
    if table_mod._native is None:
        pytest.skip("kvtier.pagetable._native was not built here")
    rng = np.random.default_rng(width)
    t = PageTable(width)
    for _ in range(150):
        n = int(rng.choice([1, 2, 25, 63, 64, 65, 200]))
        raw = np.zeros((n, width), dtype=np.uint8)
        lanes = rng.integers(0, width, size=n)
        raw[np.arange(n), lanes] = rng.integers(0, 3, size=n)     # 0: a zero key
        if rng.random() < 0.3:
            raw[:, -1] = rng.integers(1, 256, size=n)             # only the last byte set
        karr = t.keys_array(raw.tobytes())
        c = t.key_flags(karr)
        with monkeypatch.context() as m:
            m.setattr(table_mod, "_native", None)
            exact = t.key_flags(karr)
        assert c[0] == exact[0]
        assert exact[1] <= c[1]              # C may also say "repeat" on a hash collision


def test_c_returns_are_tuples_of_python_ints():
    # The page table's C returns (remove_rows, current_prefix, put_rows's (n_rows, nfree,
    # top)) are built directly, not by Py_BuildValue: what the callers unpack.
    if table_mod._native is None:
        pytest.skip("kvtier.pagetable._native was not built here")
    t = PageTable(16)
    rows, _ = t.insert(keys(range(1, 40)))
    t.cols["version"][rows] = np.arange(1, 40, dtype=np.uint64)
    n, below = t.current_prefix(t.keys_array(keys(range(1, 4))), (1,), (1,))
    assert (type(n), type(below)) == (int, int)
    live = t.live
    t.remove(rows[:5])
    assert t.live == live - 5 and t.version_floor == 5
    assert (t.lookup(keys(range(1, 6))) == -1).all()
    assert (t.lookup(keys(range(6, 40))) == rows[5:]).all()


def test_lru_epochs_distinct_as_np_unique_gives_them():
    # LruQueue._add groups a batch by epoch through queues._distinct (np.unique without its
    # import of numpy.ma): the same sorted distinct values, for empty, single and repeated.
    rng = np.random.default_rng(5)
    for n in (0, 1, 2, 3, 25, 1000):
        for hi in (1, 3, 50, 1 << 40):
            a = rng.integers(-hi, hi, size=n, dtype=np.int64)
            got = queues._distinct(a)
            assert got.dtype == np.int64
            assert got.tolist() == np.unique(a).tolist()
