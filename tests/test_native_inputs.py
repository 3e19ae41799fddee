"""The C fast paths of round 5 (rcpu5, stall5) under bad and adversarial input (rev7's review):
kvtier.pagetable._native.put_rows, kvtier.coherence._fast.lease_rows / unlease_one and
kvtier.coherence._gets.read_installable / lease_current / plan_columns. Garbage is a typed
error that writes nothing; the limits (65,535 readers of a row, batches past them) hold; and
each C path leaves what its Python path leaves on random input.
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
from tests.conftest import blocks, keys

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
