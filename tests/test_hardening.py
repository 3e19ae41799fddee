"""Issue 20: what a bad record, a damaged file or a greedy peer must not do to the service.

Each test drives the real thing: a `kvtier serve` subprocess (tests/service.py), a real LMDB
environment damaged on disk, real HTTP requests. Each failed before its fix (see the commit
that added it).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import lmdb
import msgpack
import pytest

import kvtier
from kvtier.api import protocol as P
from kvtier.check import check
from kvtier.errors import BadRequest
from kvtier.pagetable.store import Catalog
from tests.conftest import blocks, keys
from tests.service import Service
from tests.test_api import raw_call

BB = 4096


def _svc(tmp_path: Path, name: str = "svc", **settings) -> Service:
    base = {"host_capacity": "8MiB", "nvme_capacity": "64MiB", "segment_bytes": "1MiB"}
    return Service(tmp_path / name, **{**base, **settings})


def _ns_create(sock: Path, **args) -> dict:
    return raw_call(sock, [P.pack({"id": 1, "op": "ns_create", **args})])[0]


# ---------------------------------------------------------------------- item 2: layouts

@pytest.mark.parametrize("layout", [
    {1: 2},                                   # a non-string map key (msgpack allows it)
    {"layers": {b"k": 1}},                    # a nested bytes key
    {"x" * 300: 1},                           # a key longer than the schema allows
    {"blob": "v" * 20000},                    # a value larger than the record may be
    {f"k{i}": i for i in range(500)},         # too many entries
    {"deep": [[[[[[[[[[1]]]]]]]]]]},          # nesting beyond the limit
    {"f": float("nan")},                      # not representable in JSON
    {"b": b"raw"},                            # bytes are not JSON-like
])
def test_a_layout_outside_the_schema_is_refused_and_the_directory_stays_usable(tmp_path, layout):
    svc = _svc(tmp_path).start()
    try:
        reply = _ns_create(svc.socket, name="bad", block_bytes=BB, layout=layout)
        assert reply["ok"] is False and reply["error"]["code"] == "bad_request"
        assert "layout" in reply["error"]["message"]
        good = _ns_create(svc.socket, name="good", block_bytes=BB,
                          layout={"dtype": "bf16", "layers": 32, "rope": [1.0, 2.5]})
        assert good["ok"] is True
    finally:
        svc.stop()
    svc.start()                                # the directory still opens
    try:
        with kvtier.Client(svc.socket) as c:
            assert c.namespace("good").layout["layers"] == 32
            assert _ns_create(svc.socket, name="other", block_bytes=BB)["ok"] is True
    finally:
        svc.stop()
    rep = check(svc.data_dir)
    assert rep.namespaces == 2 and not rep.damage


def test_a_record_written_with_integer_map_keys_still_reads(tmp_path):
    """Records an older service stored (layout {1: 2}, accepted before the schema) read back
    with the rules they were written with, and do not block the other namespaces."""
    data_dir = tmp_path / "svc"
    svc = _svc(tmp_path).start()
    with kvtier.Client(svc.socket) as c:
        c.namespace("a", block_bytes=BB).put(keys(range(3)), blocks(3, BB))
    svc.stop()
    cat = Catalog(data_dir / "meta")
    cat._write(lambda txn: txn.put(b"old", msgpack.packb(
        {"id": 7, "block_bytes": BB, "key_width": 16, "layout": {1: 2}}), db=cat._ns_db))
    cat.close()
    svc.start()
    try:
        with kvtier.Client(svc.socket) as c:
            assert c.namespace("old").layout == {"1": 2} or c.namespace("old").layout == {1: 2}
            found, _ = c.namespace("a").get(keys(range(3)))
            assert found.all()
            assert _ns_create(svc.socket, name="new", block_bytes=BB)["ok"] is True
    finally:
        svc.stop()


def test_one_garbage_namespace_record_does_not_block_the_others(tmp_path):
    data_dir = tmp_path / "svc"
    svc = _svc(tmp_path).start()
    data = blocks(3, BB)
    with kvtier.Client(svc.socket) as c:
        c.namespace("a", block_bytes=BB).put(keys(range(3)), data)
    svc.stop()
    cat = Catalog(data_dir / "meta")
    cat._write(lambda txn: txn.put(b"junk", b"\xc1\xff\x00", db=cat._ns_db))
    cat.close()
    svc.start()
    try:
        with kvtier.Client(svc.socket) as c:
            found, out = c.namespace("a").get(keys(range(3)))
            assert found.all() and (out == data).all()
            b = _ns_create(svc.socket, name="b", block_bytes=BB)
            assert b["ok"] is True and b["ns_id"] == 2     # the damaged record's id is not reused
            junk = _ns_create(svc.socket, name="junk", block_bytes=BB)
            assert junk["ok"] is False and "check --repair" in junk["error"]["message"]
        assert "junk" in svc.output() and "kvtier check --repair" in svc.output()
    finally:
        svc.stop()
    rep = check(data_dir)
    assert [d["problem"] for d in rep.damage] == ["namespace_record"]
    rep = check(data_dir, repair=True)
    assert rep.repaired == 1
    assert not check(data_dir).damage
    cat = Catalog(data_dir / "meta")               # quarantined, not deleted
    with cat.env.begin(db=cat.env.open_db(b"quarantine")) as txn:
        assert txn.get(b"namespaces/junk") == b"\xc1\xff\x00"
    cat.close()


# ---------------------------------------------------------------------- item 4: 1,000 namespaces

def test_the_documented_thousand_namespaces_survive_a_restart(tmp_path):
    """max_dbs must count the catalog's own databases too (MDB_DBS_FULL before)."""
    import numpy as np
    from kvtier.pagetable.store import MAX_NAMESPACES, record_dtype
    assert MAX_NAMESPACES >= 1000
    path = tmp_path / "meta"
    cat = Catalog(path)
    key = np.frombuffer(keys([5]), dtype="V16")
    for i in range(MAX_NAMESPACES):
        rec = cat.add_namespace(f"ns{i}", BB, 16, {})
        if i == MAX_NAMESPACES - 1:
            row = np.zeros(1, dtype=record_dtype(16))
            row["seg"], row["version"], row["size"] = 1, 1, BB
            cat.put_records(rec.ns_id, key, row)
    cat.close()
    cat = Catalog(path)
    try:
        names = cat.namespaces()
        assert len(names) == MAX_NAMESPACES
        last = max(names, key=lambda r: r.ns_id)
        k, r, bad = cat.load(last.ns_id, 16)
        assert k.size == 1 and bad == 0
        with pytest.raises(kvtier.errors.NamespaceError, match="max_namespaces|at most"):
            cat.add_namespace("one-too-many", BB, 16, {})
    finally:
        cat.close()
