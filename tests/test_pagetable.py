"""The page table: batch insert, lookup, remove, chain links, and bad keys."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.errors import BadRequest
from kvtier.pagetable import table
from kvtier.pagetable.table import PageTable
from tests.conftest import keys


def test_insert_then_lookup_returns_the_same_rows():
    t = PageTable(16)
    rows, created = t.insert(keys(range(5000)))
    assert created.all() and len(set(rows.tolist())) == 5000
    assert (t.lookup(keys(range(5000))) == rows).all()
    assert (t.lookup(keys(range(5000, 5100))) == -1).all()


def test_repeated_key_in_one_batch_gets_one_row():
    t = PageTable(16)
    rows, created = t.insert(keys([7, 8, 7, 7]))
    assert rows[0] == rows[2] == rows[3] != rows[1]
    assert created.sum() == 2 and t.live == 2


@pytest.mark.parametrize("native", [True, False])
def test_insert_counted_says_how_many_rows_it_made(monkeypatch, native):
    # The commit asks "did every key get a new row?" by this count instead of created.all().
    if not native:
        monkeypatch.setattr(table, "_native", None)
    t = PageTable(16)
    for batch, made in (([7, 8, 7, 7], 2), ([8, 9, 9, 10], 2), ([7, 8, 9, 10], 0),
                        (list(range(20, 60)), 40)):
        rows, created, n = t.insert_counted(keys(batch))
        assert n == made == int(created.sum())
        assert (t.lookup(keys(batch)) == rows).all()
    assert t.live == 44


def test_remove_leaves_tombstones_that_lookups_probe_past():
    t = PageTable(16)
    rows, _ = t.insert(keys(range(2000)))
    t.remove(rows[::2])
    got = t.lookup(keys(range(2000)))
    assert (got[::2] == -1).all() and (got[1::2] == rows[1::2]).all()
    again, created = t.insert(keys(range(0, 2000, 2)))
    assert created.all() and t.live == 2000
    assert (t.lookup(keys(range(0, 2000, 2))) == again).all()


def test_keys_that_are_not_random_still_spread():
    # Keys that differ only in one trailing byte: the hash must mix every word.
    t = PageTable(20)
    ks = b"".join(b"\x00" * 19 + bytes([i]) for i in range(256))
    rows, _ = t.insert(ks)
    assert (t.lookup(ks) == rows).all()


def test_odd_key_width_and_growth():
    t = PageTable(5, initial_rows=16)
    ks = keys(range(10000), width=5)
    rows, _ = t.insert(ks)
    assert t.capacity >= 10000
    assert (t.lookup(ks) == rows).all()


def test_chain_links_and_unlink_on_remove():
    t = PageTable(16)
    rows, _ = t.insert(keys(range(4)))
    t.link(rows[1:], rows[:3])          # 0 <- 1 <- 2 <- 3
    assert t.children(int(rows[0])) == [int(rows[1])]
    t.link(rows[3:], rows[:1])          # 3 moves under 0
    assert sorted(t.children(int(rows[0]))) == sorted([int(rows[1]), int(rows[3])])
    assert t.children(int(rows[2])) == []
    t.remove(rows[1:2])
    assert t.cols["parent"][rows[2]] == -1
    assert t.children(int(rows[0])) == [int(rows[3])]


def test_bulk_link_of_many_children_of_one_parent():
    t = PageTable(16)
    rows, _ = t.insert(keys(range(100)))
    t.link(rows[1:], np.full(99, rows[0]))
    assert sorted(t.children(int(rows[0]))) == sorted(rows[1:].tolist())


def test_packed_keys_of_the_wrong_width_are_refused():
    t = PageTable(16)
    with pytest.raises(BadRequest, match="multiple of the namespace's key width 16"):
        t.lookup(b"x" * 17)


def test_entry_shows_every_field():
    t = PageTable(16)
    rows, _ = t.insert(keys([1, 2]))
    t.link(rows[1:], rows[:1])
    e = t.entry(int(rows[0]))
    assert e.key == keys([1]) and e.children == [keys([2])] and e.parent is None


@pytest.mark.parametrize("native", [True, False], ids=["c-helper", "numpy"])
@pytest.mark.parametrize("width", [16, 20, 8])
def test_lookups_agree_with_a_dict_on_every_path(width: int, native: bool, monkeypatch):
    # The C helper, and without it small batches probed with Python ints and long clusters
    # finished scalar: every path must give the rows a plain dict gives, with tombstones in
    # the probe chains.
    if native and table._native is None:
        pytest.skip("kvtier.pagetable._native was not built here")
    if not native:
        monkeypatch.setattr(table, "_native", None)
    t = PageTable(width)
    rng = np.random.default_rng(width)
    raw = rng.integers(1, 256, (3000, width), dtype=np.uint8)
    rows, _ = t.insert(raw.tobytes())
    t.remove(rows[::3])
    truth = {raw[i].tobytes(): (-1 if i % 3 == 0 else int(rows[i])) for i in range(3000)}
    absent = rng.integers(1, 256, (40, width), dtype=np.uint8)
    probe = np.concatenate([raw, absent])
    want = [truth.get(k.tobytes(), -1) for k in probe]
    assert t.lookup(probe.tobytes()).tolist() == want
    for lo in range(0, probe.shape[0], 97):
        for n in (1, 2, 8, 9):
            assert t.lookup(probe[lo:lo + n].tobytes()).tolist() == want[lo:lo + n]
    h = t._hash_numpy(t.keys_array(probe.tobytes()))
    assert t._hash(t.keys_array(probe.tobytes())).tolist() == h.tolist()
    assert [t._hash_one(k.tobytes()) for k in probe[:50]] == h[:50].tolist()


def _random_table_ops(t: PageTable, seed: int) -> list:
    """Inserts (with repeats in a batch), links (moves, repeats, unlinks, self-links) and
    removes at random; returns every row's parent and children list after each round."""
    rng = np.random.default_rng(seed)
    live: list[bytes] = []
    seen = []
    for _ in range(60):
        fresh = rng.integers(1, 1 << 62, rng.integers(1, 30), dtype=np.uint64)
        batch = np.concatenate([fresh, fresh[:rng.integers(0, 3)]])   # some repeated
        raw = np.zeros((batch.size, 2), dtype=">u8")
        raw[:, 1] = batch
        rows, _ = t.insert(raw.tobytes())
        live = list(dict.fromkeys(live + [r.tobytes() for r in raw]))
        all_rows = t.lookup(b"".join(live))
        pick = rng.choice(all_rows, min(40, all_rows.size))
        parents = rng.choice(np.concatenate([all_rows, [-1]]), pick.size)
        parents[: min(3, pick.size)] = pick[: min(3, pick.size)]      # self-links are ignored
        t.link(pick, parents)
        gone = rng.choice(all_rows, min(5, all_rows.size), replace=False)
        t.remove(gone)
        live = [k for k, r in zip(live, all_rows.tolist()) if r not in set(gone.tolist())]
        rows_now = t.lookup(b"".join(live)) if live else np.empty(0, dtype=np.int64)
        seen.append([(int(t.cols["parent"][r]), t.children(int(r))) for r in rows_now])
    return seen


def _c_and_numpy_agree(monkeypatch, steps, seed: int) -> None:
    """steps(table, seed) returns what it saw: the same with and without the C helpers."""
    if table._native is None:
        pytest.skip("kvtier.pagetable._native was not built here")
    with_c = steps(PageTable(16), seed)
    monkeypatch.setattr(table, "_native", None)
    assert steps(PageTable(16), seed) == with_c


def test_c_helper_links_and_removes_exactly_as_numpy_does(monkeypatch):
    # link_rows, unlink_rows, index_insert and index_remove (kvtier.pagetable._native) must
    # leave the chain links, children order and index the numpy code leaves.
    _c_and_numpy_agree(monkeypatch, _random_table_ops, 7)


def _removes_and_prefixes(t: PageTable, seed: int, batch: int = 40, gone_max: int = 6,
                          keys: int = 400) -> list:
    """Removes with repeated rows, reinserts that reuse the freed rows, and prefix matches
    over rows whose versions and copies are set at random; returns what each step saw."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(40):
        raw = np.zeros((int(rng.integers(1, batch)), 2), dtype=">u8")
        raw[:, 1] = rng.integers(1, keys, raw.shape[0])
        rows, created = t.insert(raw.tobytes())
        t.cols["version"][rows] = rng.integers(0, 3, rows.size)
        t.cols["copy_ver"][rows] = rng.integers(0, 3, (rows.size, 4))
        t.link(rows[1:], rows[:-1])
        n, below = t.current_prefix(t.keys_array(raw.tobytes()), (0, 1, 2), (0, 1))
        gone = rng.choice(rows, min(rows.size, gone_max))      # repeats allowed
        t.remove(gone)
        reset = (t.cols["version"][gone].tolist(), t.cols["copy_ver"][gone].tolist(),
                 t.cols["slot"][gone].tolist(), bytes(t.cols["key"][gone].tobytes()))
        out.append((rows.tolist(), created.tolist(), n, below, t.live, t.version_floor, reset,
                    t.live_rows().tolist(), [t.children(int(r)) for r in t.live_rows()]))
    return out


def test_c_remove_and_prefix_match_leave_what_numpy_leaves(monkeypatch):
    # remove_rows + reset_rows (row reuse order, index, links, version floor) and
    # current_prefix (kvtier.pagetable._native) against the numpy code on the same steps.
    _c_and_numpy_agree(monkeypatch, _removes_and_prefixes, 11)


def test_c_remove_of_large_batches_frees_rows_in_numpy_order(monkeypatch):
    # Batches of hundreds of rows: remove_rows sorts the freed rows through a bitmap of the
    # table's rows there (qsort below 65); the free stack must still be ascending as numpy's.
    _c_and_numpy_agree(monkeypatch, lambda t, seed: _removes_and_prefixes(
        t, seed, batch=600, gone_max=400, keys=5000), 13)


@pytest.mark.parametrize("native", [True, False], ids=["c-helper", "numpy"])
def test_key_flags_name_a_zero_key_and_a_repeat(native: bool, monkeypatch):
    # What a put's reserve learns in one pass: an all-zero key (refused), and whether the
    # commit must look for repeated keys (the last write of a key wins).
    if native and table._native is None:
        pytest.skip("kvtier.pagetable._native was not built here")
    if not native:
        monkeypatch.setattr(table, "_native", None)
    t = PageTable(16)
    flags = lambda ids: t.key_flags(t.keys_array(b"".join(  # noqa: E731
        i.to_bytes(16, "big") for i in ids)))
    assert flags([1, 2, 3]) == (False, False)
    assert flags([1, 2, 1]) == (False, True)
    assert flags([4, 0, 5]) == (True, False)
    assert flags([0, 0]) == (True, True)
    assert flags([7]) == (False, False)


def test_c_insert_refuses_a_free_row_outside_the_table_and_writes_nothing():
    # insert_keys checks the rows it may hand out (the top of the free stack) before it writes
    # a key: a corrupt entry there is refused whole, the index and key column left as they were.
    if table._native is None:
        pytest.skip("kvtier.pagetable._native was not built here")
    t = PageTable(16)
    raw = np.zeros((8, 2), dtype=">u8")
    raw[:, 1] = np.arange(1, 9)
    rows, _ = t.insert(raw.tobytes())
    t.remove(rows[:4])
    t._free[t._nfree - 1] = t.n_rows + 100          # the row the next insert would take
    index, keycol = t._index.copy(), t.cols["key"].copy()
    new = np.zeros((2, 2), dtype=">u8")
    new[:, 1] = [100, 101]
    with pytest.raises(ValueError, match="free row outside the table"):
        t.insert(new.tobytes())
    assert np.array_equal(t._index, index) and np.array_equal(t.cols["key"], keycol)


def test_c_reset_rows_sets_every_column_s_fill_or_refuses_before_writing():
    # reset_rows reads the table's fills (bytes) in place and checks the rows once against
    # the shortest column: the rows get their fills in every column; a row outside a column,
    # a fill of the wrong width or an unbufferable fill is refused with nothing written.
    if table._native is None:
        pytest.skip("kvtier.pagetable._native was not built here")
    t = PageTable(16)
    raw = np.zeros((20, 2), dtype=">u8")
    raw[:, 1] = np.arange(1, 21)
    rows, _ = t.insert(raw.tobytes())
    rng = np.random.default_rng(5)
    for c in t._col_tuple:
        c.view(np.uint8)[...] = rng.integers(0, 256, c.nbytes, dtype=np.uint8).reshape(
            c.view(np.uint8).shape)
    pick = np.array([3, 17, 0, 9], dtype=np.int64)
    before = [c.copy() for c in t._col_tuple]
    # a bytearray and a numpy fill are read through the buffer protocol, bytes in place
    fills = tuple(bytearray(f) if i % 3 == 1 else np.frombuffer(f, np.uint8) if i % 3 == 2
                  else f for i, f in enumerate(t._row_fills))
    table._native.reset_rows(t._col_tuple, fills, pick)
    for c, b, f in zip(t._col_tuple, before, t._row_fills):
        want = b.copy()
        want.view(np.uint8).reshape(b.shape[0], -1)[pick] = np.frombuffer(f, np.uint8)
        assert np.array_equal(c, want)
    now = [c.copy() for c in t._col_tuple]
    bad_fill = t._row_fills[:5] + (b"\0" * 7,) + t._row_fills[6:]
    for cols, fl, r, err in [
            (t._col_tuple, t._row_fills, np.array([1, t.capacity], np.int64), ValueError),
            (t._col_tuple, t._row_fills, np.array([-1], np.int64), ValueError),
            (t._col_tuple, bad_fill, pick, ValueError),
            (t._col_tuple, t._row_fills[:-1] + (object(),), pick, TypeError),
            (t._col_tuple, t._row_fills[:-1], pick, TypeError)]:
        with pytest.raises(err):
            table._native.reset_rows(cols, fl, r)
        assert all(np.array_equal(c, b) for c, b in zip(t._col_tuple, now))


def test_c_link_keys_links_what_lookup_and_link_rows_link_and_refuses_bad_input():
    # _native.link_keys (the commit's chain: the parents' lookup and the link in one call)
    # against lookup + link_rows on copies of the same table, parents present, absent and
    # repeated; then arguments it must refuse with nothing linked.
    if table._native is None:
        pytest.skip("kvtier.pagetable._native was not built here")
    rng = np.random.default_rng(7)
    for step in range(60):
        a, b = PageTable(16), PageTable(16)
        ids = rng.permutation(200)[:int(rng.integers(2, 120))] + 1
        raw = np.zeros((ids.size, 2), dtype=">u8")
        raw[:, 1] = ids
        for t in (a, b):
            t.insert(raw.tobytes())
        n = int(rng.integers(1, ids.size))
        rows = rng.choice(a.live_rows(), n).astype(np.int64)       # repeats allowed
        pk = np.zeros((n, 2), dtype=">u8")
        pk[:, 1] = rng.choice(np.r_[ids, 1000 + np.arange(20)], n)  # some parents absent
        pkeys = a.keys_array(pk.tobytes())
        ca, cb = a.cols, b.cols
        table._native.link_keys(a._index, ca["key"], 16, pkeys, ca["parent"],
                                ca["first_child"], ca["next_sib"], rows, a.n_rows)
        found = np.empty(n, np.int64)
        table._native.lookup(b._index, cb["key"][:b.n_rows], 16, pkeys, found)
        table._native.link_rows(cb["parent"], cb["first_child"], cb["next_sib"], rows, found)
        for name in ("parent", "first_child", "next_sib"):
            assert np.array_equal(ca[name][:a.n_rows], cb[name][:b.n_rows]), (step, name)
    c = a.cols
    links = [c[k].copy() for k in ("parent", "first_child", "next_sib")]
    good = (a._index, c["key"], 16, pkeys, c["parent"], c["first_child"], c["next_sib"], rows,
            a.n_rows)
    for i, bad in [(2, 0), (3, pkeys[:-1]), (7, np.array([a.capacity], np.int64)),
                   (7, np.array([-1], np.int64)), (5, c["first_child"][:-1]),
                   (8, a.capacity + 1), (0, a._index[:-1])]:
        args = list(good)
        args[i] = bad
        if i == 7:
            args[3] = pkeys[:1]
        with pytest.raises(ValueError):
            table._native.link_keys(*args)
        assert all(np.array_equal(c[k], v) for k, v in
                   zip(("parent", "first_child", "next_sib"), links))
    with pytest.raises(TypeError):
        table._native.link_keys(*good[:8])
    out = np.empty(pkeys.size, np.int64)
    for n_rows in (-1, a.capacity + 1):
        with pytest.raises(ValueError):
            table._native.lookup(a._index, c["key"], 16, pkeys, out, n_rows)


def _put_args(t: PageTable, karr, pkeys, slot_row, pool, data, slots, clock: int = 100,
              base: int = 7 << 32) -> list:
    from kvtier.checksums import XXH3_ADDRESS
    from kvtier.coherence.engine import _COMMIT_NEXT
    return [t._index, t._put_cols, 16, karr, pkeys, t._free, t._nfree, t.n_rows, slot_row,
            pool, data, slots, XXH3_ADDRESS, _COMMIT_NEXT, 1, t.version_floor, base, clock, 3,
            np.empty(karr.size, np.uint64), np.empty(karr.size, np.int64)]


def _reference_put(t: PageTable, karr, pkeys, slot_row, pool, data, slots, clock: int,
                   base: int) -> np.ndarray:
    """put_rows's effects the slow way: numpy's write, block_checksums, insert_counted, the
    install in numpy (engine.install without the C helper), link_keys."""
    from kvtier.checksums import block_checksums
    from kvtier.coherence.engine import _COMMIT_NEXT
    pool[slots] = data
    sums = block_checksums(pool, slots)
    rows, created, made = t.insert_counted(karr)
    assert made == karr.size
    c = t.cols
    c["version"][rows[created]] = t.version_floor
    c["version"][rows] = np.maximum(c["version"][rows], np.uint64(base)) + np.uint64(1)
    c["leases"][rows] = 0
    c["size"][rows] = 3
    c["checksum"][rows] = sums
    c["state"][rows] = _COMMIT_NEXT[c["state"][rows]]
    c["prev_access"][rows] = c["last_access"][rows]
    c["last_access"][rows] = np.arange(clock + 1, clock + rows.size + 1, dtype=np.uint64)
    c["freq"][rows] += 1
    c["slot"][rows, 1] = slots
    c["copy_ver"][rows, 1] = c["version"][rows]
    slot_row[slots] = rows
    t.link_keys(rows, pkeys)
    return c["version"][rows]


def test_c_put_rows_leaves_what_insert_install_and_link_leave():
    # PageTable.put_new (one _native.put_rows call: the replay's put of new keys) against the
    # reference steps on a twin table: batches of fresh keys whose parents are keys of the
    # batch, older keys, absent keys or none, with removals between them (free rows reused,
    # tombstones probed past) and growth (fresh rows reset, an index rebuilt). Every column,
    # the index, the free stack, the pools and slot_row must agree after every batch.
    if table._native is None:
        pytest.skip("kvtier.pagetable._native was not built here")
    from kvtier.checksums import XXH3_ADDRESS
    from kvtier.coherence.engine import _COMMIT_NEXT
    if XXH3_ADDRESS is None:
        pytest.skip("libxxhash is not installed here")
    rng = np.random.default_rng(11)
    a, b = PageTable(16, initial_rows=16), PageTable(16, initial_rows=16)
    nslots = 4096
    pools = [np.zeros((nslots, 3), np.uint8) for _ in range(2)]
    slot_rows = [np.full(nslots, -1, np.int64) for _ in range(2)]
    next_id, live, free_slots, clock, taken = 1, [], list(range(nslots)), 0, 0
    for step in range(150):
        n = int(rng.integers(1, 40))
        ids = list(range(next_id, next_id + n))
        next_id += n
        choice = rng.integers(0, 4, n)
        pids = [ids[i - 1] if c == 0 and i else (int(rng.choice(live)) if c == 1 and live
                                                else (10**9 + i if c == 2 else 0))
                for i, c in enumerate(choice)]
        karr, pkeys = a.keys_array(keys(ids)), a.keys_array(keys(pids))
        slots = np.array([free_slots.pop() for _ in range(n)], np.int64)
        data = rng.integers(0, 256, (n, 3), dtype=np.uint8)
        base = (7 << 32) + int(rng.integers(0, 3))
        got = a.put_new(karr, pkeys, slot_rows[0], pools[0], data, slots, XXH3_ADDRESS,
                        _COMMIT_NEXT, 1, base, clock, 3)
        assert got is not None
        ref = _reference_put(b, karr, pkeys, slot_rows[1], pools[1], data, slots, clock, base)
        clock += n
        taken += 1
        assert got[1].tolist() == ref.tolist() and got[2] == int(ref.max())
        assert np.array_equal(got[0], b.lookup(karr))
        live += ids
        if step % 3 == 2:                       # evict some: free rows, tombstones, slots back
            gone = [int(x) for x in rng.choice(live, len(live) // 3, replace=False)]
            for t, sr in ((a, slot_rows[0]), (b, slot_rows[1])):
                rows = t.lookup(keys(gone))
                sl = t.cols["slot"][rows, 1].astype(np.int64)
                sr[sl] = -1
                t.remove(rows)
            free_slots += sl.tolist()
            live = [x for x in live if x not in set(gone)]
        assert (a.n_rows, a.live, a._nfree, a.version_floor) == \
            (b.n_rows, b.live, b._nfree, b.version_floor)
        assert np.array_equal(a._index, b._index)
        assert np.array_equal(a._free[:a._nfree], b._free[:b._nfree])
        for name in a.cols:
            assert np.array_equal(a.cols[name][:a.n_rows], b.cols[name][:b.n_rows]), name
        assert np.array_equal(pools[0], pools[1]) and np.array_equal(*slot_rows)
    assert a.capacity > 16 and taken == 150


def test_c_put_rows_declines_a_key_with_a_row_and_strided_data_writing_nothing():
    if table._native is None:
        pytest.skip("kvtier.pagetable._native was not built here")
    from kvtier.checksums import XXH3_ADDRESS
    if XXH3_ADDRESS is None:
        pytest.skip("libxxhash is not installed here")
    t = PageTable(16)
    t.insert(keys([5]))
    t._reset_rows(slice(t.n_rows, t.capacity))     # put_new's part: the rows it may take
    pool, slot_row = np.zeros((8, 3), np.uint8), np.full(8, -1, np.int64)
    before = {k: v.copy() for k, v in t.cols.items()}
    index = t._index.copy()
    data = np.ones((2, 3), np.uint8)
    for ks, d in (([4, 5], data), ([6, 5], data), ([6, 6], data),        # a row; a repeat
                  ([6, 7], np.ones((2, 6), np.uint8)[:, ::2])):          # strided data
        args = _put_args(t, t.keys_array(keys(ks)), t.keys_array(keys([0, 0])), slot_row,
                         pool, d, np.array([1, 2], np.int64))
        assert table._native.put_rows(*args) is None
    assert np.array_equal(t._index, index) and not pool.any() and (slot_row == -1).all()
    for name, col in before.items():
        assert np.array_equal(t.cols[name], col), name


@pytest.mark.parametrize("bad", ["nargs", "tuple", "slot_past", "slot_negative", "dtype",
                                 "n_rows", "free_row", "fn", "tier", "width", "data_rows",
                                 "state", "slot_twice", "slot_held", "index_full"])
def test_c_put_rows_refuses_bad_input_writing_nothing(bad):
    if table._native is None:
        pytest.skip("kvtier.pagetable._native was not built here")
    from kvtier.checksums import XXH3_ADDRESS
    if XXH3_ADDRESS is None:
        pytest.skip("libxxhash is not installed here")
    t = PageTable(16)
    rows, _ = t.insert(keys([1, 2, 3]))
    t.remove(rows[:2])
    pool, slot_row = np.zeros((8, 3), np.uint8), np.full(8, -1, np.int64)
    args = _put_args(t, t.keys_array(keys([10, 11])), t.keys_array(keys([10, 0])), slot_row,
                     pool, np.ones((2, 3), np.uint8), np.array([1, 2], np.int64))
    if bad == "nargs":
        args = args[:20]
    elif bad == "tuple":
        args[1] = args[1][:13]
    elif bad == "slot_past":
        args[11] = np.array([1, 8], np.int64)
    elif bad == "slot_negative":
        args[11] = np.array([-1, 2], np.int64)
    elif bad == "dtype":
        args[11] = np.array([1, 2], np.int32)
    elif bad == "n_rows":
        args[7] = t.capacity + 1
    elif bad == "free_row":
        t._free[t._nfree - 1] = t.n_rows + 5
    elif bad == "fn":
        args[12] = 0
    elif bad == "tier":
        args[14] = 99
    elif bad == "width":
        args[2] = 8
    elif bad == "data_rows":
        args[10] = np.ones((3, 3), np.uint8)
    elif bad == "slot_twice":                   # two rows on one slot's bytes (rev7)
        args[11] = np.array([2, 2], np.int64)
    elif bad == "index_full":                   # ran full at the second key, the first written
        args[0] = t._index = np.full(1, -1, np.int32)
    elif bad == "slot_held":                    # slot 2 still holds row 2's host copy
        t.cols["slot"][rows[2], 1], slot_row[2] = 2, rows[2]
        t.cols["copy_ver"][rows[2], 1] = t.cols["version"][rows[2]] = 5
    else:
        t.cols["state"][t._free[t._nfree - 1]] = 250        # a state with no COMMIT move
    before = {k: v.copy() for k, v in t.cols.items()}
    index, owners = t._index.copy(), slot_row.copy()
    with pytest.raises((TypeError, ValueError)):
        table._native.put_rows(*args)
    assert np.array_equal(t._index, index) and not pool.any()
    assert np.array_equal(slot_row, owners)
    for name, col in before.items():
        assert np.array_equal(t.cols[name], col), name
