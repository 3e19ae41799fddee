"""pagetable.store's Catalog.commit with many operations (a checkpoint's): consecutive puts into
one namespace are committed as one (one bindings() hash and one cursor, issue 17, fio7), and
LMDB then holds exactly what the operations one at a time leave."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvtier.pagetable import store
from kvtier.pagetable.store import Catalog, record_dtype
from tests.conftest import key

W = 16


def _put(ns_id: int, ids: list[int], version: int):
    keys = np.frombuffer(b"".join(key(i, W) for i in ids), dtype=f"V{W}").copy()
    recs = np.zeros(len(ids), dtype=record_dtype(W))
    recs["seg"], recs["off"], recs["size"] = 1, np.arange(len(ids)), 4096
    recs["version"], recs["checksum"] = version, np.array(ids, np.uint64) * 7 + version
    return (ns_id, keys, recs)


def _ops() -> list:
    # Rewrites of one key within a run, a delete between runs, another namespace between
    # puts of the first, and a put after the delete bringing a deleted key back.
    return [_put(1, [1, 2, 3], 1), _put(1, [3, 4], 2), _put(1, [4, 5, 6], 3),
            (1, [key(2, W), key(5, W)], None), _put(1, [6, 7], 4), _put(2, [1, 2], 1),
            _put(1, [2, 8], 5), _put(1, [8], 6), (2, [key(1, W)], None), _put(2, [1, 9], 2)]


def _contents(cat: Catalog) -> dict:
    out = {}
    for ns_id in (1, 2):
        keys, recs, bad = cat.load(ns_id, W)
        assert bad == 0
        out[ns_id] = sorted((keys[i].tobytes(), recs[i].tobytes()) for i in range(len(keys)))
    return out


def _catalog(path: Path) -> Catalog:
    cat = Catalog(path)
    cat.add_namespace("a", 4096, W, {})
    cat.add_namespace("b", 4096, W, {})
    return cat


def test_a_checkpoints_puts_joined_leave_what_the_puts_one_by_one_leave(tmp_path: Path):
    one = _catalog(tmp_path / "one")
    for op in _ops():
        one.commit([op], {})
    joined = _catalog(tmp_path / "joined")
    joined.commit(_ops(), {})
    assert _contents(joined) == _contents(one)
    got = dict(_contents(joined)[1])
    assert key(2, W) in got and key(5, W) not in got         # deleted, then put again
    assert np.frombuffer(got[key(8, W)], record_dtype(W))["version"][0] == 6
    one.close()
    joined.close()


def test_runs_join_only_consecutive_puts_of_one_namespace():
    ops = _ops()
    runs = store._runs(ops)
    shape = [(ns, len(keys), recs is None) for ns, keys, recs in runs]
    assert shape == [(1, 8, False), (1, 2, True), (1, 2, False), (2, 2, False), (1, 3, False),
                     (2, 1, True), (2, 2, False)]
    assert store._runs(ops[:1])[0] is ops[0]                  # a lone put as it was
    assert store._runs([]) == []
