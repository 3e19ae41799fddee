"""The C fast paths of round 5 (rcpu5, stall5) under bad and adversarial input (rev7's review):
kvtier.pagetable._native.put_rows, kvtier.coherence._fast.lease_rows / unlease_one and
kvtier.coherence._gets.read_installable / lease_current / plan_columns (and stall7's
room_rows, stall8's victims_covered and must_bring, stall9's nvme_hits, set_copies and
touch_rows, fio7's kvtier.coherence._flush). Garbage is a typed error that writes nothing; the
limits (65,535 readers of a row, batches past them) hold; and each C path leaves what its
Python path leaves on random input.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.coherence import fastpath, gets
from kvtier.coherence.engine import Engine
from kvtier.config import make_settings
from kvtier.errors import BadRequest
from kvtier.types import Tier
from tests.conftest import blocks, drive_get, keys

_fast = fastpath._fast
pytestmark = pytest.mark.skipif(_fast is None or gets._lease_current is None,
                                reason="kvtier.coherence._fast or _gets was not built")


def _host_engine(tmp: Path, host: str = "16MiB", block: int = 64) -> Engine:
    eng = Engine(make_settings({"data_dir": str(tmp), "host_capacity": host,
                                "hbm_capacity": "0", "nvme_capacity": "0",
                                "write_policy": "write_back"}))
    eng.create_namespace("m", block)
    return eng


def test_a_get_of_more_than_65535_keys_is_served_and_its_pins_end(tmp_path: Path):
    # lease_current refused any batch of 65,536 served keys or more (its overflow test was
    # against the batch's size), after the install had pinned every slot: the get raised and
    # its 70,000 pins stayed for ever. One missing key sends the get the general way.
    eng = _host_engine(tmp_path)
    n = 70_000
    ids = list(range(1, n + 1))
    for lo in range(0, n, 10_000):
        eng.put("m", keys(ids[lo:lo + 10_000]), blocks(10_000, 64, lo))
    table, pins = eng.namespace("m").table, eng.namespace("m").slots[Tier.HOST].leases
    res = eng.get("m", keys(ids + [10**7]))
    assert int(res.found.sum()) == n and not res.found[-1]
    assert int(table.cols["leases"][:table.n_rows].min()) == 1
    eng.release(res.lease_id)
    assert int(pins.sum()) == 0 and not eng.leases
    assert int(table.cols["leases"][:table.n_rows].max()) == 0
    eng.close(flush=False)


def test_lease_current_counts_each_row_exactly_and_saturates_at_65535():
    m = 70_000
    version = np.arange(1, 5, dtype=np.uint64)
    key = np.arange(4 * 16, dtype=np.uint8).view("V16")
    leases = np.array([0, 65_534, 65_535, 7], dtype=np.uint16)
    rows = np.resize(np.array([0, 1, 2], dtype=np.int64), m)   # each row ~23,000 times
    out = np.empty(m, dtype=np.int64)
    k = gets._lease_current(version, key, leases, rows, version[rows].copy(), key[rows].copy(),
                            out)
    assert k == m and np.array_equal(out, rows)
    assert leases.tolist() == [23_334, 65_535, 65_535, 7]


def test_lease_rows_saturates_a_full_reader_count_rather_than_wrap_it():
    # The resident get's lease (lease_native, lease_one) wrapped a row's reader count of
    # 65,535 to 0: an admin eviction then took a row that had readers.
    version = np.array([5, 6], np.uint64)
    copy_ver = np.zeros((2, 4), np.uint64)
    copy_ver[:, 1] = version
    slot = np.array([[-1, 0, -1], [-1, 1, -1]], np.int32)
    leases = np.array([65_535, 3], np.uint16)
    zeros = [np.zeros(2, t) for t in (np.uint64, np.uint64, np.uint32, np.uint64)]
    pool = np.zeros(2, np.uint32)
    out = (np.empty(3, np.int32), np.empty(3, np.uint64), np.empty(3, np.uint64))
    assert _fast.lease_rows(version, copy_ver, slot, leases, zeros[0], zeros[1], zeros[2],
                            zeros[3], pool, np.array([0, 1, 0], np.int64), 2, 1, 9, *out)
    assert leases.tolist() == [65_535, 4] and pool.tolist() == [2, 1]


@pytest.mark.parametrize("c_helper", [True, False], ids=["c", "numpy"])
def test_lease_one_refuses_no_key_or_several(tmp_path: Path, monkeypatch, c_helper: bool):
    # lease_one's outputs are one key's. With no key, lease_rows had nothing to refuse, and the
    # reply was the previous call's slot, version and checksum, with a lease pinning nothing;
    # without the C helper, no key was an IndexError and several leased the first alone.
    if not c_helper:
        monkeypatch.setattr(fastpath, "_fast", None)
    eng = _host_engine(tmp_path)
    eng.put("m", keys([1, 2]), blocks(2, 64, 1))
    ns = eng.namespace("m")
    with eng.lock:
        hit = eng.lease_one(ns, keys([1]), 0)
    assert hit is not None
    eng.release(hit[0])
    pins = ns.slots[Tier.HOST].leases.copy()
    table = {k: v.copy() for k, v in ns.table.cols.items()}
    for bad in (b"", keys([1, 2]), ns.table.keys_array(keys([2, 1]))):
        with eng.lock, pytest.raises(BadRequest, match="one key"):
            eng.lease_one(ns, bad, 0)
    assert not eng.leases and np.array_equal(ns.slots[Tier.HOST].leases, pins)
    for name, col in table.items():
        assert np.array_equal(ns.table.cols[name], col), name
    eng.close(flush=False)


# ------------------------------------------------------------------ garbage at every argument

def _variants(arg):
    """Replacements for one argument: other kinds, signs and sizes; for an array, other item
    sizes, lengths, dimensions, strides, a read-only copy, and every value -1 or its maximum."""
    out = [None, "x", 1.5, -1, 2**64, []]
    if isinstance(arg, tuple):
        for c in range(len(arg)):
            for col in (arg[c][:-1], _other_items(arg[c])):
                out.append(arg[:c] + (col,) + arg[c + 1:])
        return out + [arg[:-1], arg + (arg[0],)]
    if isinstance(arg, int):
        return out + [arg + 1, arg - 1, 0, -arg - 1, 2**62, 2**31]
    if not isinstance(arg, np.ndarray):
        return out
    out += [_other_items(arg), arg[:0], arg[:1], np.concatenate([arg, arg]),
            arg.reshape(-1, 1).copy() if arg.ndim == 1 else arg.reshape(-1),
            np.concatenate([arg, arg])[::2],
            np.asfortranarray(arg) if arg.ndim == 2 else arg[np.newaxis]]
    ro = arg.copy()
    ro.flags.writeable = False
    out.append(ro)
    if arg.dtype.kind in "iu":
        out += [np.full(arg.shape, -1).astype(arg.dtype),       # (unsigned: the maximum)
                np.full_like(arg, np.iinfo(arg.dtype).max // 2 + 1)]
    return out


def _other_items(a: np.ndarray) -> np.ndarray:
    """a with items of another size (keys as bytes)."""
    if a.dtype.kind == "V":
        return a.view(np.uint8).copy()
    return a.astype(np.int8 if a.dtype.itemsize != 1 else np.int64)


def _arrays(args) -> list[np.ndarray]:
    found = []
    for a in args:
        if isinstance(a, np.ndarray):
            found.append(a)
        elif isinstance(a, tuple):
            found += [c for c in a if isinstance(c, np.ndarray)]
    return found


def _fuzz(build, fn, outputs: set[int], skip_ints: set[int] = frozenset()) -> int:
    """fn(*args) with each argument of build()'s in turn replaced by each of its variants:
    a typed error that leaves every array but the outputs as it was, or a result; never a
    crash. Returns how many calls raised."""
    raised = 0
    for pos in range(len(build())):
        for k in range(len(_variants(build()[pos]))):
            args = build()
            bad = _variants(args[pos])[k]
            if pos in skip_ints and isinstance(bad, int):
                continue                          # a raw function address: any int is one
            args[pos] = bad
            keep = [i for i, a in enumerate(args) if i not in outputs]
            before = [a.copy() for a in _arrays([args[i] for i in keep])]
            try:
                fn(*args)
            except (TypeError, ValueError, OverflowError, BufferError, RuntimeError):
                raised += 1
                after = _arrays([args[i] for i in keep])
                for x, y in zip(before, after):
                    assert np.array_equal(x, y, equal_nan=False), (pos, k)
    return raised


def _table_for_put():
    from kvtier.pagetable.table import PageTable
    t = PageTable(16)
    rows, _ = t.insert(keys([1, 2, 3, 4]))
    t.remove(rows[:2])
    t._room_for_rows(4)
    t._reset_rows(slice(t.n_rows, t.capacity))
    return t


def test_put_rows_survives_garbage_at_every_argument():
    from kvtier.checksums import XXH3_ADDRESS
    from kvtier.coherence.engine import _COMMIT_NEXT
    from kvtier.pagetable import table
    if table._native is None or XXH3_ADDRESS is None:
        pytest.skip("kvtier.pagetable._native or libxxhash missing here")

    def build():
        t = _table_for_put()
        karr = t.keys_array(keys([10, 11, 12]))
        return [t._index, t._put_cols, 16, karr, t.keys_array(keys([3, 10, 0])), t._free,
                t._nfree, t.n_rows, np.full(8, -1, np.int64), np.zeros((8, 3), np.uint8),
                np.ones((3, 3), np.uint8), np.array([1, 5, 2], np.int64), XXH3_ADDRESS,
                _COMMIT_NEXT, 1, t.version_floor, 7 << 32, 100, 3, np.empty(3, np.uint64),
                np.empty(3, np.int64)]

    assert table._native.put_rows(*build()) is not None
    assert _fuzz(build, table._native.put_rows, {19, 20}, skip_ints={12}) > 100


def test_the_flush_pick_and_apply_survive_garbage_at_every_argument():
    # fio7's kvtier.coherence._flush (a flush's pick and apply; tests/test_flush_native.py
    # holds their comparison with numpy): every argument replaced in turn by its variants.
    from kvtier.coherence import flushes
    from kvtier.coherence.states import Event, transition_array
    from kvtier.pagetable.store import record_dtype
    if flushes._flush is None:
        pytest.skip("kvtier.coherence._flush was not built")
    rows = np.array([4, 0, 2, 2, 5], np.int64)

    def columns():
        c = _lease_columns()
        c["state"] = np.array([1, 1, 2, 1, 1, 1], np.uint8)        # DIRTY but row 2
        c["parent"] = np.array([-1, 0, -1, 1, 3, -1], np.int32)
        c["copy_ver"][:, 1] = c["version"]                          # host copies current
        c["copy_ver"][1, 1] = 0                                     # row 1: none anywhere
        c["copy_ver"][[0, 3], 2] = 1                                # old NVMe copies
        return c

    def pick():
        c = columns()
        return [rows.copy(), 6, 1, 1, 0, 1, 4096, c["state"], c["version"], c["copy_ver"],
                c["slot"], c["sums"], c["key"], c["parent"], np.empty(5, np.int64),
                np.empty(5, np.uint64), np.empty(5, np.int64), np.empty(5, np.uint64),
                np.empty(5, "V16"), np.zeros(5, record_dtype(16)), 16]

    k, distinct, staged = flushes._flush.pick(*pick())
    assert (k, distinct, staged) == (3, False, 0)
    assert _fuzz(pick, flushes._flush.pick, set(range(14, 20))) > 100

    def apply():
        c = columns()
        r = np.array([0, 3, 5], np.int64)
        return [6, 2, transition_array(Event.FLUSHED), r, c["key"][r].copy(),
                c["version"][r].copy(), np.array([7, 7, 8], np.int32),
                np.array([1, 2, 3], np.uint32), c["sums"][r].copy(), c["key"], c["version"],
                c["copy_ver"], c["slot"], c["off"], c["csum"], c["state"],
                np.empty(3, np.int64), np.empty(3, np.int32), 16]

    assert flushes._flush.apply(*apply()) == (3, 2, 0)
    # Only the two out arrays may differ after a refusal: the columns are written last.
    assert _fuzz(apply, flushes._flush.apply, {16, 17}) > 100


def _lease_columns():
    n, nt, ns = 6, 4, 3
    c = {"version": np.arange(10, 10 + n, dtype=np.uint64),
         "copy_ver": np.zeros((n, nt), np.uint64), "slot": np.full((n, ns), -1, np.int32),
         "key": np.arange(n * 16, dtype=np.uint8).view("V16"),
         "leases": np.zeros(n, np.uint16), "last": np.zeros(n, np.uint64),
         "prev": np.zeros(n, np.uint64), "freq": np.zeros(n, np.uint32),
         "sums": np.arange(n, dtype=np.uint64), "pool": np.zeros(8, np.uint32),
         "retired": np.zeros(8, bool), "csum": np.arange(n, dtype=np.uint64),
         "off": np.arange(n, dtype=np.uint32)}
    c["copy_ver"][:4, 1] = c["version"][:4]
    c["slot"][:4, 1] = [5, 4, 3, 2]
    c["copy_ver"][:, 3] = c["version"]
    c["slot"][:, 2] = [0, 1, 0, 2, 1, 0]        # (the NVMe tier's segments, Tier.NVME = 2)
    return c


def test_the_lease_and_read_helpers_survive_garbage_at_every_argument():
    rows = np.array([0, 3, 0, 2], np.int64)

    def lease_rows():
        c = _lease_columns()
        return [c["version"], c["copy_ver"], c["slot"], c["leases"], c["last"], c["prev"],
                c["freq"], c["sums"], c["pool"], rows.copy(), 6, 1, 7, np.empty(4, np.int32),
                np.empty(4, np.uint64), np.empty(4, np.uint64)]

    def unlease_one():
        c = _lease_columns()
        c["pool"][3], c["leases"][2] = 1, 1
        return [c["pool"], c["retired"], c["version"], c["leases"], 6, 3, 2, 12]

    def split_rows():
        c = _lease_columns()
        return [c["version"], c["copy_ver"], c["slot"], c["sums"], c["pool"],
                np.array([0, -1, 4, 5, 4], np.int64), 6, 1, np.empty(5, bool),
                np.empty(5, np.int64), np.empty(5, np.uint64), np.empty(5, np.uint64),
                np.empty(5, np.int64)]

    def read_installable():
        c = _lease_columns()
        r = np.array([4, 5], np.int64)
        return [c["version"], c["copy_ver"], c["key"], 6, 1, np.ones(2, bool), r,
                c["key"][r].copy(), c["version"][r].copy()]

    def lease_current():
        c = _lease_columns()
        return [c["version"], c["key"], c["leases"], rows.copy(), c["version"][rows].copy(),
                c["key"][rows].copy(), np.empty(4, np.int64)]

    def plan_columns():
        c = _lease_columns()
        return [c["slot"], c["key"], c["copy_ver"], c["csum"], c["off"], rows.copy(), 2,
                np.empty(4, np.int32), np.empty(4, "V16"), np.empty(4, np.uint64),
                np.empty(4, np.uint64), np.empty(4, np.uint32), np.empty(4, np.int64)]

    def room_rows():
        c = _lease_columns()
        return [c["version"], c["copy_ver"], c["slot"], c["pool"],
                np.array([0, -1, 4, 5, 4, 0], np.int64), 6, 1, np.empty(6, np.int64)]

    def victims_covered():
        c = _lease_columns()
        return [c["copy_ver"], np.array([0, 4, 5, -1, 2, 3, 1], np.int64),
                np.array([1, 2, 0, 6], np.int64), 1, 1 << 2]

    def must_bring():
        c = _lease_columns()
        return [c["version"], c["copy_ver"], np.array([0, -1, 4, 5, 4], np.int64), 6, 1]

    def nvme_hits():
        c = _lease_columns()
        return [c["version"], c["copy_ver"], np.array([0, -1, 4, 5, 4], np.int64),
                np.array([0, 2, 3, 4], np.int64), 6, 2, np.ones(5, bool),
                np.empty(4, np.int64), np.empty(4, np.int64)]

    def set_copies():
        c = _lease_columns()
        return [c["slot"], c["copy_ver"], np.full(8, -1, np.int64), rows[:3].copy(), 1,
                np.array([6, 7, 1], np.int64), np.array([1, 2, 3], np.uint64)]

    def touch_rows():
        c = _lease_columns()
        return [c["last"], c["prev"], c["freq"], rows.copy(), 7]

    from kvtier.coherence import _gets
    cases = [(nvme_hits, _gets.nvme_hits, {6, 7, 8}),
             (set_copies, _gets.set_copies, set()),
             (touch_rows, _gets.touch_rows, set()),
             (victims_covered, _gets.victims_covered, set()),
             (must_bring, _gets.must_bring, set()),
             (room_rows, _gets.room_rows, {7}),(lease_rows, _fast.lease_rows, {13, 14, 15}),
             (unlease_one, _fast.unlease_one, set()),
             (split_rows, _gets.split_rows, {8, 9, 10, 11, 12}),
             (read_installable, _gets.read_installable, set()),
             (lease_current, _gets.lease_current, {6}),
             (plan_columns, _gets.plan_columns, {7, 8, 9, 10, 11, 12})]
    for build, fn, outputs in cases:
        fn(*build())                              # the valid call first
        assert _fuzz(build, fn, outputs) > 20, fn.__name__


# ------------------------------------------------------------------ what a get serves

def _served_while_rows_move(tmp: Path, seed: int) -> list:
    """Random puts, flushes, evictions, deletes and gets; between an NVMe read and its install
    (where the server's loop runs other requests), the get's keys are rewritten (then maybe
    flushed and evicted), deleted and
    their rows reused by other keys (delete, then new keys: the free rows are taken again; then
    flushed and evicted, so that no host copy tells the install that the row moved on), or
    deleted and put back (new rows, new versions). Every block served must be the bytes put at
    the version served, under the checksum served; once its lease ends nothing stays pinned.
    Returns what a C-or-numpy comparison needs: results, columns, slot arrays, counters."""
    from kvtier.checksums import block_checksums
    from kvtier.errors import CapacityError

    bb = 4096
    eng = Engine(make_settings({"data_dir": str(tmp), "host_capacity": "64KiB",
                                "hbm_capacity": "0", "nvme_capacity": "4MiB",
                                "segment_bytes": "1MiB", "write_policy": "write_back"}))
    eng.create_namespace("m", bb)
    ns = eng.namespace("m")
    pool, pins = ns.slots[Tier.HOST].pool.array, ns.slots[Tier.HOST].leases
    rng = np.random.default_rng(seed)
    made: dict[tuple[int, int], bytes] = {}
    fresh = iter(range(10_000, 1_000_000))
    seen: list = []

    def put(ids: list[int], salt: int) -> None:
        ids = list(dict.fromkeys(ids))
        data = blocks(len(ids), bb, salt)
        try:
            versions = eng.put("m", keys(ids), data)
        except CapacityError:
            seen.append("put full")
            return
        for i, v, d in zip(ids, versions.tolist(), data):
            made[(i, v)] = d.tobytes()

    for step in range(160):
        op = int(rng.integers(0, 10))
        ids = [int(i) for i in rng.integers(0, 30, int(rng.integers(1, 9)))]
        if op < 3:
            put(ids, step)
        elif op < 4:
            eng.flush()
            seen.append(eng.evict(Tier.HOST, int(rng.integers(1, 12))))
        elif op < 5:
            seen.append(eng.delete("m", keys(ids)))
        else:
            steps = eng.get_steps("m", keys(ids), 0, room_first=bool(rng.integers(0, 2)))

            def meanwhile(p, ids=ids, step=step) -> None:
                some = ids[: int(rng.integers(1, len(ids) + 1))]
                what = int(rng.integers(0, 6))
                if what in (0, 4):
                    put(some, 1000 + step)
                elif what in (1, 3):                # their rows taken by other keys
                    eng.delete("m", keys(some))
                    put([next(fresh) for _ in some], 2000 + step)
                elif what == 2:                     # gone and back: new rows, new versions
                    eng.delete("m", keys(some))
                    put(some, 3000 + step)
                if what in (3, 4):                  # and the new copies only on NVMe
                    eng.flush()
                    eng.evict(Tier.HOST, 16)

            out = drive_get(eng, steps, meanwhile)
            for i, key_id in enumerate(ids):
                if out.found[i]:
                    got = pool[int(out.slots[i])]
                    assert got.tobytes() == made[(key_id, int(out.versions[i]))], (step, i)
                    assert int(block_checksums(got[np.newaxis])[0]) == int(out.checksums[i])
            seen.append([out.found.tolist(), out.versions.tolist(), out.checksums.tolist()])
            eng.release(out.lease_id)
        assert not eng.leases and int(pins.sum()) == 0, step
        t = ns.table
        seen.append({name: col[: t.n_rows].tolist() for name, col in t.cols.items()
                     if name != "key"})
        seen.append((ns.slots[Tier.HOST].slot_row.tolist(), ns.slots[Tier.HOST].pool.free_count))
    seen.append({k.label: v.as_dict() for k, v in eng.counters.tiers.items()})
    eng.close(flush=False)
    return seen


@pytest.mark.parametrize("seed", [1, 2])
def test_gets_serve_the_bytes_of_the_version_they_name_while_rows_move(tmp_path: Path,
                                                                       seed: int, monkeypatch):
    # The C install (read_installable, lease_current, plan_columns) and the numpy one, each
    # checked against the bytes put, then against each other.
    from kvtier.coherence import persist

    with_c = _served_while_rows_move(tmp_path / "c", seed)
    monkeypatch.setattr(gets, "_read_installable", None)
    monkeypatch.setattr(gets, "_lease_current", None)
    monkeypatch.setattr(persist, "_plan_columns", None)
    assert _served_while_rows_move(tmp_path / "numpy", seed) == with_c


def test_lease_one_answers_its_own_engine_s_block_beside_another_engine(tmp_path: Path):
    # lease_one's scratch outputs were one set per process: another engine's lease_one, run
    # between this one's C call and its reads of them (another thread, at a GIL switch), made
    # this one answer that engine's slot, version and checksum. The other call is made where
    # a switch may fall (the lease id's draw), so that the test needs no thread.
    a, b = _host_engine(tmp_path / "a"), _host_engine(tmp_path / "b")
    a.put("m", keys([1]), blocks(1, 64, 1))
    b.put("m", keys([7, 8, 9]), blocks(3, 64, 2))
    b.put("m", keys([9]), blocks(1, 64, 3))
    na, nb = a.namespace("m"), b.namespace("m")
    theirs: list = []
    draw = a.fast._new_id

    def new_id() -> int:
        with b.lock:
            theirs.append(b.lease_one(nb, keys([9]), 0))
        return draw()

    a.fast._new_id = new_id
    with a.lock:
        hit = a.lease_one(na, keys([1]), 0)
    row = int(na.table.lookup(keys([1]))[0])
    c = na.table.cols
    assert hit[1:] == (int(c["slot"][row, Tier.HOST]), int(c["version"][row]),
                       int(c["checksum"][row]))
    assert theirs[0][1:] != hit[1:]
    a.release(hit[0])
    b.release(theirs[0][0])
    a.close(flush=False)
    b.close(flush=False)


# ------------------------------------------------------------------ releases, C against numpy

def _holds_workload(tmp: Path, seed: int) -> list:
    """Gets whose leases are held across steps (one key, through lease_one or get, and
    several), rewrites and deletes of leased blocks (their slots retired until the last
    release), evictions, and releases in any order, whole or in part: after every step the
    leases' state, the table's reader counts and the slot arrays."""
    eng = _host_engine(tmp, host="4KiB")
    ns = eng.namespace("m")
    st = ns.slots[Tier.HOST]
    rng = np.random.default_rng(seed)
    held: list[int] = []
    seen: list = []
    for step in range(300):
        op = int(rng.integers(0, 10))
        ids = list(dict.fromkeys(int(i) for i in rng.integers(0, 40, int(rng.integers(1, 5)))))
        try:
            if op < 3:
                eng.put("m", keys(ids), blocks(len(ids), 64, step))
            elif op < 5:
                if len(ids) == 1 and op == 3:
                    with eng.lock:
                        hit = eng.lease_one(ns, keys(ids), 0)
                    if hit is not None:
                        held.append(hit[0])
                    seen.append(hit)
                else:
                    res = eng.get("m", keys(ids + ids[:1]))     # a repeat: two pins of one slot
                    held.append(res.lease_id)
                    seen.append([res.found.tolist(), res.slots.tolist()])
            elif op < 8 and held:
                lid = held.pop(int(rng.integers(0, len(held))))
                lease = eng.leases[lid]
                if lease.slots.size > 1 and op == 7:            # a part first, then the rest
                    eng.release(lid, slots=lease.slots[:1])
                eng.release(lid)
            elif op == 8:
                seen.append(eng.delete("m", keys(ids)))
            else:
                seen.append(eng.evict(Tier.HOST, int(rng.integers(1, 6))))
        except Exception as exc:                          # full, and such: the same both ways
            seen.append(type(exc).__name__)
        t = ns.table
        seen.append([t.cols["leases"][: t.n_rows].tolist(), t.cols["version"][: t.n_rows].tolist(),
                     st.leases.tolist(), st.retired.tolist(), st.slot_row.tolist(),
                     st.pool.free_count, sorted(eng.leases)])
    for lid in held:
        eng.release(lid)
    assert int(st.leases.sum()) == 0 and not st.retired.any()
    eng.close(flush=False)
    return seen


@pytest.mark.parametrize("seed", [3, 4])
def test_the_c_releases_leave_what_the_numpy_releases_leave(tmp_path: Path, seed: int,
                                                           monkeypatch):
    # unlease_one (a one-slot lease), unlease_rows (the others), lease_rows (lease_one's and
    # the resident get's) and the get's C split and lease, against their numpy versions.
    from kvtier.coherence import leases
    with_c = _holds_workload(tmp_path / "c", seed)
    for mod, name in ((leases, "_fast"), (fastpath, "_fast"), (gets, "_split"),
                      (gets, "_lease_current"), (gets, "_read_installable")):
        monkeypatch.setattr(mod, name, None)
    assert _holds_workload(tmp_path / "numpy", seed) == with_c
