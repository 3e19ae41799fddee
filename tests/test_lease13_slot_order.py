"""A sorted get's order of its keys by host slot in C (kvtier.coherence._fast.slot_order, called
by kvtier.api.sortedgets.slot_order; lease13): the same positions as the numpy reference on
random tables (misses, stale and empty rows, keys asked twice, dense and sparse slots), the
right order on a real engine's table whichever path runs, bad arguments refused with a clear
error, and a sorted get of many pieces (the first request's ends checked on Python ints or,
past 64 pieces, in numpy) served and refused as before, against a real `kvtier serve`."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest

import kvtier
from kvtier.api import pipeline
from kvtier.api.sortedgets import slot_order, slot_order_numpy
from kvtier.errors import BadRequest
from kvtier.types import Tier
from tests.conftest import blocks, keys
from tests.test_sorted_gets import BB, _held, _release

_fast = pytest.importorskip("kvtier.coherence._fast")
HOST = int(Tier.HOST)


class Table:
    """What slot_order_numpy reads of a page table: its columns."""

    def __init__(self, cols: dict) -> None:
        self.cols = cols


def random_table(rng: np.random.Generator, cap: int, pool: int) -> dict:
    """Columns of cap rows: some empty (version 0), some with a stale host copy (copy_ver not
    the version), the rest current in distinct slots of a pool of pool slots."""
    version = rng.integers(1, 5, cap).astype(np.uint64)
    version[rng.random(cap) < 0.1] = 0
    copy_ver = np.zeros((cap, 4), np.uint64)
    copy_ver[:, HOST] = version
    stale = rng.random(cap) < 0.15
    copy_ver[stale, HOST] = version[stale] + 1
    slot = np.full((cap, 3), -1, np.int32)
    slot[:, HOST] = rng.permutation(pool)[:cap]
    return {"version": version, "copy_ver": copy_ver, "slot": slot}


def c_order(cols: dict, rows: np.ndarray, n_rows: int) -> tuple[int, np.ndarray]:
    out = np.full(rows.size, 0xFFFFFFFF, np.uint32)
    k = _fast.slot_order(cols["version"], cols["copy_ver"], cols["slot"], rows, n_rows, HOST,
                         out)
    return k, out


@pytest.mark.parametrize("seed", range(40))
def test_the_c_order_is_numpys_wherever_the_slots_are_dense(seed):
    rng = np.random.default_rng(seed)
    cap = int(rng.integers(1, 600))
    pool = cap + int(rng.choice([0, cap // 3, 8 * cap]))   # dense, loose or sparse slots
    cols = random_table(rng, cap, pool)
    n = int(rng.integers(0, 2 * cap))
    rows = rng.integers(-1, cap, n).astype(np.int64)       # misses, and rows asked twice
    k, out = c_order(cols, rows, cap)
    cur = (rows >= 0) & (cols["version"][rows] > 0) & (
        cols["copy_ver"][rows, HOST] == cols["version"][rows])
    slots = cols["slot"][rows[cur], HOST].astype(np.int64)
    span = int(slots.max()) - int(slots.min()) + 1 if slots.size else 0
    if k < 0:
        assert span > 4 * slots.size            # refused only where sparse
        return
    assert k == int(cur.sum())
    assert (out == slot_order_numpy(Table(cols), rows)).all()
    # And what it promises, apart from numpy: current first by slot (ties in their order),
    # then the others in theirs.
    assert sorted(out.tolist()) == list(range(n))
    first = out[:k].astype(np.int64)
    assert cur[first].all() and not cur[out[k:].astype(np.int64)].any()
    key = cols["slot"][rows[first], HOST].astype(np.int64) * (n + 1) + first
    assert (np.diff(key) > 0).all()
    assert (np.diff(out[k:].astype(np.int64)) > 0).all()


def test_no_current_copy_leaves_the_keys_in_their_order():
    cols = random_table(np.random.default_rng(0), 16, 16)
    k, out = c_order(cols, np.full(5, -1, np.int64), 16)
    assert k == 0 and out.tolist() == [0, 1, 2, 3, 4]
    k, out = c_order(cols, np.zeros(0, np.int64), 16)
    assert k == 0 and out.size == 0


@pytest.fixture
def engine():
    from kvtier.coherence.engine import Engine
    from kvtier.config import make_settings
    eng = Engine(make_settings({"data_dir": tempfile.mkdtemp(prefix="kvtier-l13-"),
                                "host_capacity": "16MiB", "nvme_capacity": "0"}))
    eng.create_namespace("s", 1024)
    yield eng
    eng.close()


def _check_order(eng, ids: list[int]) -> np.ndarray:
    """slot_order of keys(ids) on eng's table against a sort by (current?, slot, position)."""
    ns = eng.namespace("s")
    karr = ns.table.keys_array(keys(ids))
    with eng.lock:
        got = slot_order(eng, "s", karr)
    rows = ns.table.lookup(karr)
    cols = ns.table.cols
    big = np.iinfo(np.int64).max // 4
    pos = np.arange(len(ids))
    cur = (rows >= 0) & (cols["version"][rows] > 0) & (
        cols["copy_ver"][rows, HOST] == cols["version"][rows])
    slot = np.where(cur, cols["slot"][rows, HOST].astype(np.int64), big)
    want = np.lexsort((pos, slot))
    assert got.dtype == np.uint32 and (got == want).all()
    return got


def test_a_real_table_is_ordered_by_slot_dense_or_sparse(engine):
    engine.put("s", keys(range(300)), blocks(300, 1024))
    ids = np.random.default_rng(3).permutation(300).tolist() + [5, 7, 10_000]   # twice, a miss
    got = _check_order(engine, ids)
    assert got[-1] == len(ids) - 1              # the miss last
    engine.delete("s", keys(range(0, 300, 7)))   # holes
    engine.put("s", keys(range(1000, 1800)), blocks(800, 1024, seed=1))
    engine.put("s", keys(range(20)), blocks(20, 1024, seed=2))   # rewritten: new slots, far
    _check_order(engine, list(range(0, 40)) + [1700, 1701])      # sparse: numpy's path
    _check_order(engine, list(range(1000, 1800, 3)))             # dense again


@pytest.mark.parametrize("bad,error,says", [
    (dict(rows=np.array([0, 16], np.int64)), ValueError, "past n_rows"),
    (dict(out=np.zeros(1, np.uint32)), ValueError, "shorter"),
    (dict(tier=5), ValueError, "tier"),
    (dict(rows=np.array([0, 1], np.int32)), TypeError, "8-byte"),
    (dict(out=np.zeros(2, np.uint64)), TypeError, "4-byte"),
    (dict(n_rows=-1), ValueError, "negative"),
])
def test_bad_arguments_are_refused_with_what_is_wrong(bad, error, says):
    cols = random_table(np.random.default_rng(0), 16, 16)
    args = dict(rows=np.array([0, 1], np.int64), n_rows=16, tier=HOST,
                out=np.zeros(2, np.uint32))
    args.update(bad)
    with pytest.raises(error, match=says):
        _fast.slot_order(cols["version"], cols["copy_ver"], cols["slot"], args["rows"],
                         args["n_rows"], args["tier"], args["out"])
    with pytest.raises(TypeError, match="7 arguments"):
        _fast.slot_order(cols["version"])


@pytest.fixture
def ns(service):
    with kvtier.Client(str(service.socket)) as c:
        yield c.namespace("s", block_bytes=BB)


def test_a_sorted_get_of_many_pieces_is_served_and_its_bad_ends_refused(ns):
    data = blocks(200, BB)
    ns.put(keys(range(200)), data)
    ids = np.random.default_rng(5).permutation(200)
    got = []
    found, leases, error, _moved = pipeline.lease_sorted(
        ns, keys(ids.tolist()), 200, lambda rep, at: got.append((rep, at)), None, 2)
    assert error is None and found.all() and len(got) == 101       # pipeline.chunks(200, 2)
    view = ns._view()
    for rep, at in got:
        pos = np.arange(rep.found.size) if type(at) is int else at
        assert (view[rep.slots.astype(np.int64)] == data[ids[pos]]).all()
    _release(ns, leases)
    for ends in (list(range(2, 202, 2))[:-1] + [199],       # past 64 pieces: not to n
                 list(range(2, 200, 2)) + [198, 200],       # ... not strictly rising
                 list(range(2, 66, 2)) + [64, 200]):        # 34 pieces, one repeated
        with pytest.raises(BadRequest, match="rise strictly"):
            ns._client._call("get", ns="s", keys=keys(range(200)),
                             sort=np.array(ends, "<u4").tobytes())
    assert _held(ns) == 0
    assert ns.get(keys(range(200)))[0].all()                  # the connection goes on
