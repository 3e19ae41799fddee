"""A flush's pick and apply in C (kvtier.coherence._flush, issue 17, fio7) against their numpy
references (Flushes._pick_numpy, Flushes._apply_numpy): the same rows, versions, slots, keys
and LMDB records picked, and the same page-table columns, states, dead and live records and
Members after an apply, on random tables; garbage is a typed error that writes nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.coherence import flushes
from kvtier.coherence.engine import Engine
from kvtier.coherence.states import BlockState, Event, IllegalTransition, transition_array
from kvtier.config import make_settings
from kvtier.pagetable.store import FLAG_PARENT, record_dtype
from kvtier.types import Tier
from tests.conftest import blocks, keys

_flush = flushes._flush
pytestmark = pytest.mark.skipif(_flush is None, reason="kvtier.coherence._flush was not built")
BB = 4096
_COLS = ("state", "version", "copy_ver", "slot", "checksum", "key", "parent", "nvme_off",
         "nvme_checksum")


def _engine(tmp: Path, n: int = 200, seed: int = 0) -> Engine:
    """n keys put under write_back (DIRTY, host copies), a third of them with parents, a
    quarter flushed once and rewritten (their old NVMe copies stale), a few deleted."""
    eng = Engine(make_settings({"data_dir": str(tmp), "host_capacity": "4MiB",
                                "nvme_capacity": "64MiB", "write_policy": "write_back"}))
    eng.create_namespace("m", BB)
    ids = list(range(1, n + 1))
    for lo in range(0, n, 50):
        part = ids[lo:lo + 50]
        par = keys([i - 1 if i % 3 == 0 and i > 1 else 0 for i in part])
        eng.put("m", keys(part), blocks(len(part), BB, lo), parents=par)
    eng.flush("m")
    rng = np.random.default_rng(seed)
    again = sorted(rng.choice(ids, n // 4, replace=False).tolist())
    eng.put("m", keys(again), blocks(len(again), BB, 99))
    eng.delete("m", keys(sorted(rng.choice(ids, 5, replace=False).tolist())))
    return eng


def _scramble(ns, rng: np.random.Generator) -> None:
    """Random states and host copy versions, so that some DIRTY rows have no copy to write
    and some CLEAN rows are asked for; versions shuffled so that the order by version is not
    the order by row."""
    cols, n = ns.table.cols, ns.table.n_rows
    live = np.flatnonzero(cols["version"][:n] > 0)
    cols["version"][live] = rng.permutation(cols["version"][live]) + 1
    cols["copy_ver"][live, Tier.HOST] = cols["version"][live]
    gone = rng.choice(live, live.size // 10, replace=False)
    cols["copy_ver"][gone, Tier.HOST] = 0
    cols["state"][rng.choice(live, live.size // 5, replace=False)] = BlockState.CLEAN


def _snapshot(ns) -> dict[str, np.ndarray]:
    return {c: ns.table.cols[c].copy() for c in _COLS}


def _restore(ns, snap: dict[str, np.ndarray]) -> None:
    for c, a in snap.items():
        ns.table.cols[c][...] = a


@pytest.mark.parametrize("seed", range(6))
def test_the_c_pick_picks_what_numpy_picks(tmp_path: Path, seed: int):
    eng = _engine(tmp_path, seed=seed)
    ns = eng.namespace("m")
    rng = np.random.default_rng(seed)
    _scramble(ns, rng)
    f = eng.nvme.flushes
    n = ns.table.n_rows
    asks = [np.flatnonzero(ns.table.cols["state"][:n] == BlockState.DIRTY),
            rng.integers(0, n, 40),                         # repeats, unsorted
            rng.integers(-3, n + 5, 60),                    # and out of range
            np.arange(n)[::-1].copy(), np.empty(0, dtype=np.int64)]
    for rows in asks:
        got, want = f._pick_c(ns, rows.copy()), f._pick_numpy(ns, rows.copy())
        if want is None:
            assert got is None
            continue
        assert got is not None and len(got) == len(want) == 8
        for g, w in zip(got[:5], want[:5]):
            assert g.dtype == w.dtype and np.array_equal(g, w)
        assert got[5].dtype == w_dt(ns) and got[5].tobytes() == want[5].tobytes()
        assert got[6:] == want[6:]
    assert int(ns.slots[Tier.HOST].leases.sum()) == 0       # picks pin nothing themselves
    eng.close(flush=False)


def w_dt(ns) -> np.dtype:
    return record_dtype(ns.key_width)


def test_a_pick_orders_by_version_then_row_and_sets_each_records_parent(tmp_path: Path):
    eng = _engine(tmp_path, n=60)
    ns = eng.namespace("m")
    cols = ns.table.cols
    rows = np.flatnonzero(cols["state"][:ns.table.n_rows] == BlockState.DIRTY)
    got = eng.nvme.flushes._pick_c(ns, rows[::-1].copy())
    r, v, recs = got[0], got[1], got[5]
    assert list(zip(v.tolist(), r.tolist())) == sorted(zip(v.tolist(), r.tolist()))
    par = cols["parent"][r]
    assert ((recs["flags"] == FLAG_PARENT) == (par >= 0)).all() and par.max() >= 0
    for i in np.flatnonzero(par >= 0).tolist():
        assert recs["parent"][i] == cols["key"][par[i]]
    assert (recs["size"] == BB).all() and (recs["checksum"] == cols["checksum"][r]).all()
    assert (recs["seg"] == 0).all() and (recs["binding"] == 0).all()
    eng.close(flush=False)


def _apply_both(eng: Engine, ns, batch, segs, offs) -> list:
    """The batch applied by C and by numpy from the same state: what each left (columns,
    the store's nvme_moved calls, the keys returned, an IllegalTransition)."""
    f, store = eng.nvme.flushes, eng.nvme
    before = _snapshot(ns)
    out = []
    for way in (f._apply_flush, f._apply_numpy):
        _restore(ns, before)
        moved = []
        store.nvme_moved = lambda ns_, old, rows, sg: moved.append(
            (sorted(np.asarray(old).tolist()), np.asarray(rows).tolist(),
             np.asarray(sg).tolist()))
        try:
            res = way(ns, batch, segs, offs)
        except IllegalTransition as exc:
            res = str(exc)
        finally:
            del store.nvme_moved
        out.append((_snapshot(ns), moved, res))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_c_apply_leaves_what_numpy_leaves(tmp_path: Path, seed: int):
    eng = _engine(tmp_path, seed=seed)
    ns = eng.namespace("m")
    cols, n = ns.table.cols, ns.table.n_rows
    rng = np.random.default_rng(seed + 10)
    batch = eng.nvme.flushes._pick(ns, None)
    eng.nvme.flushes._unpin(ns, batch)
    k = batch.rows.size
    segs = rng.integers(0, 3, k).astype(np.int32)
    offs = rng.integers(0, 1 << 20, k).astype(np.uint32)
    # While the batch was "in flight": rewrites (a newer version: installed, stays DIRTY),
    # keys gone (their records orphans), a row reused by another key.
    r = batch.rows
    cols["version"][r[: k // 5]] += 1
    cols["version"][r[k // 5: k // 4]] = 0
    cols["key"][r[k // 4]] = np.frombuffer(b"\xee" * ns.key_width, dtype=cols["key"].dtype)[0]
    cols["version"][r[k // 4 + 1]] = batch.versions[k // 4 + 1] - 1   # older: not installed
    (c_cols, c_moved, c_res), (p_cols, p_moved, p_res) = _apply_both(eng, ns, batch, segs, offs)
    for c in _COLS:
        assert np.array_equal(c_cols[c][:n], p_cols[c][:n]), c
    assert c_moved == p_moved and c_res == p_res
    assert len(c_res) == k // 4 - k // 5 + 2        # the gone keys, the reused and older rows
    assert (c_cols["state"][r[k // 4 + 2:]] == BlockState.CLEAN).all()
    eng.close(flush=False)


def test_an_apply_to_a_row_with_no_flushed_move_raises_and_writes_no_state(tmp_path: Path):
    eng = _engine(tmp_path, n=60)
    ns = eng.namespace("m")
    batch = eng.nvme.flushes._pick(ns, None)
    eng.nvme.flushes._unpin(ns, batch)
    k = batch.rows.size
    ns.table.cols["state"][batch.rows[3]] = BlockState.EMPTY     # EMPTY has no FLUSHED move
    segs, offs = np.zeros(k, dtype=np.int32), np.arange(k, dtype=np.uint32)
    (c_cols, c_moved, c_res), (p_cols, p_moved, p_res) = _apply_both(eng, ns, batch, segs, offs)
    assert isinstance(c_res, str) and c_res == p_res and "EMPTY" in c_res
    for c in _COLS:
        assert np.array_equal(c_cols[c], p_cols[c]), c
    assert (c_cols["state"][batch.rows] != BlockState.CLEAN).all()
    assert c_moved == p_moved
    eng.close(flush=False)


def _pick_args(ns, rows=None, **over):
    cols, m = ns.table.cols, 8
    rows = np.arange(m, dtype=np.int64) if rows is None else rows
    a = dict(rows=rows, n_rows=ns.table.n_rows, dirty=1, host=1, hbm=0, flag=FLAG_PARENT,
             bb=BB, state=cols["state"], version=cols["version"], copy_ver=cols["copy_ver"],
             slot=cols["slot"], checksum=cols["checksum"], key=cols["key"],
             parent=cols["parent"], o_rows=np.empty(m, np.int64), o_ver=np.empty(m, np.uint64),
             o_slots=np.empty(m, np.int64), o_sums=np.empty(m, np.uint64),
             o_keys=np.empty(m, cols["key"].dtype), o_recs=np.zeros(m, record_dtype(16)), w=16)
    a.update(over)
    return list(a.values())


def test_the_c_pick_refuses_garbage_and_writes_nothing(tmp_path: Path):
    eng = _engine(tmp_path, n=60)
    ns = eng.namespace("m")
    cols = ns.table.cols
    bad = [dict(rows=np.arange(8, dtype=np.int32)),            # 4-byte rows
           dict(rows=[0, 1]), dict(n_rows=10**9), dict(n_rows=-1), dict(host=7),
           dict(hbm=9), dict(dirty=300), dict(w=0), dict(w=8), dict(bb=-4),
           dict(o_rows=np.empty(3, np.int64)), dict(o_recs=np.zeros(8, record_dtype(8))),
           dict(state=cols["state"][:5].copy()), dict(slot=cols["slot"][:, 1].copy()),
           dict(key=b"x" * 64), dict(o_ver=np.empty(8, np.uint64)[::2])]
    for over in bad:
        args = _pick_args(ns, **over)
        outs = [a.copy() for a in args[14:20] if isinstance(a, np.ndarray)]
        with pytest.raises((TypeError, ValueError, BufferError)):
            _flush.pick(*args)
        assert all(np.array_equal(a, b) or a.dtype.names for a, b in
                   zip([a for a in args[14:20] if isinstance(a, np.ndarray)], outs))
    with pytest.raises(TypeError):
        _flush.pick(*_pick_args(ns)[:-1])
    # A parent row past the key column: refused before any out array is written.
    par = cols["parent"].copy()
    cols["parent"][:8] = cols["key"].size + 5
    args = _pick_args(ns)
    with pytest.raises(ValueError, match="parent"):
        _flush.pick(*args)
    assert not args[19].view(np.uint8).any()
    cols["parent"][...] = par
    assert _flush.pick(*_pick_args(ns))[0] > 0
    eng.close(flush=False)


def test_the_c_apply_refuses_garbage_and_writes_nothing(tmp_path: Path):
    eng = _engine(tmp_path, n=60)
    ns = eng.namespace("m")
    cols = ns.table.cols
    batch = eng.nvme.flushes._pick(ns, None)
    eng.nvme.flushes._unpin(ns, batch)
    k = batch.rows.size
    good = dict(n_rows=ns.table.n_rows, nvme=2, flushed=transition_array(Event.FLUSHED),
                rows=batch.rows, keys=batch.keys, versions=batch.versions,
                segs=np.zeros(k, np.int32), offs=np.zeros(k, np.uint32), sums=batch.sums,
                key=cols["key"], version=cols["version"], copy_ver=cols["copy_ver"],
                slot=cols["slot"], nvme_off=cols["nvme_off"],
                nvme_checksum=cols["nvme_checksum"], state=cols["state"],
                out_m=np.empty(k, np.int64), out_old=np.empty(k, np.int32), w=16)
    bad = [dict(segs=np.zeros(k, np.int64)), dict(offs=np.zeros(k - 1, np.uint32)),
           dict(nvme=3), dict(nvme=-1), dict(n_rows=10**9), dict(w=4),
           dict(rows=batch.rows.astype(np.int32)), dict(out_old=np.empty(1, np.int32)),
           dict(version=cols["version"].astype(np.uint32)),
           dict(state=np.frombuffer(bytes(cols["state"].size), np.uint8)),   # read-only
           dict(copy_ver=cols["copy_ver"][:, 2].copy()), dict(keys=None)]
    before = _snapshot(ns)
    for over in bad:
        with pytest.raises((TypeError, ValueError, BufferError)):
            _flush.apply(*{**good, **over}.values())
        for c in _COLS:
            assert np.array_equal(cols[c], before[c]), (over, c)
    with pytest.raises(TypeError):
        _flush.apply(*list(good.values())[:-1])
    assert _flush.apply(*good.values())[0] == k
    eng.close(flush=False)


def test_without_the_c_helpers_a_flush_stores_the_same_state(tmp_path: Path, monkeypatch):
    """A whole engine run twice, with and without kvtier.coherence._flush: the same page
    table after its puts, flushes and rewrites, and after a restart."""
    states = []
    for built in (True, False):
        if not built:
            monkeypatch.setattr(flushes, "_flush", None)
        d = tmp_path / str(built)
        eng = _engine(d, n=120, seed=3)
        eng.flush("m")
        ns = eng.namespace("m")
        states.append({c: ns.table.cols[c][:ns.table.n_rows].copy() for c in _COLS})
        eng.close()
        eng = Engine(make_settings({"data_dir": str(d), "host_capacity": "4MiB",
                                    "nvme_capacity": "64MiB", "write_policy": "write_back"}))
        got = eng.get("m", keys(range(1, 121)))
        states.append(got.found.copy())
        eng.release(got.lease_id)
        eng.close(flush=False)
    for c in _COLS:
        assert np.array_equal(states[0][c], states[2][c]), c
    assert np.array_equal(states[1], states[3]) and states[1].sum() == 115
