"""kvtier.coherence.fastpath's socket-facing paths against the general get: a one-key lease
(lease_one) and a resident batch of any tier (try_get_resident) leave every field as the
general path does, and refuse, changing nothing, what they do not serve."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.coherence import fastpath
from kvtier.coherence.engine import Engine
from kvtier.config import make_settings
from kvtier.types import Tier
from tests.conftest import blocks, hbm_standin, key, keys
from tests.test_engine import BB, _state


def _engine(path: Path, hbm: bool = False) -> Engine:
    values = {"data_dir": str(path), "host_capacity": "64KiB", "nvme_capacity": "0"}
    if hbm:
        values["hbm_capacity"] = "64KiB"
    eng = Engine(make_settings(values), hbm_pool_factory=hbm_standin if hbm else None)
    eng.create_namespace("m", BB)
    return eng


@pytest.fixture(params=[True, False], ids=["c-helper", "numpy"])
def native(request, monkeypatch) -> bool:
    if request.param and fastpath._fast is None:
        pytest.skip("kvtier.coherence._fast was not built here")
    if not request.param:
        monkeypatch.setattr(fastpath, "_fast", None)
    return request.param


def test_lease_one_leaves_the_state_the_general_get_leaves(tmp_path: Path, native: bool):
    # Engine a leases key 0 by lease_one, engine b by a get of key 0 and an absent key (the
    # general path): the same answer and the same fields after the get, after a rewrite that
    # retires the leased slot, and after the release that frees it.
    engines = []
    for name in ("a", "b"):
        eng = _engine(tmp_path / name)
        eng.put("m", keys(range(3)), blocks(3, BB, 1))
        eng.release(eng.get("m", key(0)).lease_id)        # an earlier access moves prev_access
        engines.append(eng)
    a, b = engines
    lid, slot, version, checksum = a.lease_one(a.namespace("m"), key(0), 7)
    rb = b.get("m", key(0) + key(99), owner=7)
    assert rb.found.tolist() == [True, False]
    assert (slot, version, checksum) == (int(rb.slots[0]), int(rb.versions[0]),
                                         int(rb.checksums[0]))
    assert _state(a, [key(0)]) == _state(b, [key(0)])
    for eng in engines:
        eng.put("m", key(0), blocks(1, BB, 2))            # the leased slot retires
    assert _state(a, [key(0)]) == _state(b, [key(0)])
    assert a.release_many([lid], 7) == 0
    b.release(rb.lease_id, 7)
    assert _state(a, [key(0)]) == _state(b, [key(0)])
    assert a.namespace("m").slots[Tier.HOST].retired.sum() == 0
    for eng in engines:
        eng.close(flush=False)


def test_lease_one_refuses_absent_and_stale_keys_changing_nothing(tmp_path: Path, native: bool):
    eng = _engine(tmp_path)
    eng.put("m", key(0), blocks(1, BB))
    ns = eng.namespace("m")
    before = _state(eng, [key(0)])
    assert eng.lease_one(ns, key(5), 1) is None           # never stored
    assert _state(eng, [key(0)]) == before
    eng.delete("m", key(0))
    eng.put("m", key(1), blocks(1, BB))
    before = _state(eng, [key(1)])
    assert eng.lease_one(ns, key(0), 1) is None           # deleted
    assert _state(eng, [key(1)]) == before
    eng.close(flush=False)


def _hbm_state(eng: Engine, ks: bytes) -> dict:
    ns = eng.namespace("m")
    cols = ns.table.cols
    rows = ns.table.lookup(ks)
    st = ns.slots[Tier.HBM]
    return {"rows": {name: cols[name][rows].tolist() for name in
                     ("leases", "last_access", "prev_access", "freq")},
            "slot_leases": st.leases[cols["slot"][rows, Tier.HBM]].tolist(),
            "clock": eng.clock, "hits": eng.counters.tiers[Tier.HBM].hits,
            "leases": len(eng.leases)}


def test_try_get_resident_of_the_hbm_tier_leaves_the_state_of_the_general_get(
        tmp_path: Path, native: bool):
    engines = []
    for name in ("a", "b"):
        eng = _engine(tmp_path / name, hbm=True)
        eng.put("m", keys(range(4)), blocks(4, BB, 3), tier=Tier.HBM)
        engines.append(eng)
    a, b = engines
    ks = keys([2, 0, 3, 0])                               # a repeat: two pins, one touch
    ra = a.try_get_resident("m", ks, 1, Tier.HBM)
    rb = b.get("m", ks, 1, Tier.HBM)
    assert ra is not None and ra.tier is Tier.HBM
    for field in ("found", "slots", "versions", "checksums"):
        assert np.array_equal(getattr(ra, field), getattr(rb, field)), field
    assert _hbm_state(a, ks) == _hbm_state(b, ks)
    a.release(ra.lease_id, 1)
    b.release(rb.lease_id, 1)
    assert _hbm_state(a, ks) == _hbm_state(b, ks)
    for eng in engines:
        eng.close(flush=False)


def test_try_get_resident_refuses_a_block_the_tier_does_not_hold(tmp_path: Path, native: bool):
    # Key 1 is only in host memory: an HBM get of it must bring it up (the general path, on a
    # thread), so the resident path refuses the whole batch and leases nothing.
    eng = _engine(tmp_path, hbm=True)
    eng.put("m", key(0), blocks(1, BB), tier=Tier.HBM)
    eng.put("m", key(1), blocks(1, BB))
    before = _hbm_state(eng, key(0))
    assert eng.try_get_resident("m", key(0) + key(1), 1, Tier.HBM) is None
    assert eng.try_get_resident("m", key(0) + key(9), 1, Tier.HBM) is None
    assert _hbm_state(eng, key(0)) == before
    eng.close(flush=False)


def test_a_full_reader_count_stays_full_on_both_paths(tmp_path: Path, native: bool):
    # The page table's reader count is uint16: a lease at 65,535 keeps it there (the C
    # helpers saturate; the numpy fallback wrapped to 0, and an admin eviction could then
    # take a row that still had readers). Slot pins are uint32 and keep the bytes regardless.
    eng = _engine(tmp_path)
    eng.put("m", keys(range(3)), blocks(3, BB, 1))
    ns = eng.namespace("m")
    rows = ns.table.lookup(ns.table.keys_array(keys(range(3))))
    ns.table.cols["leases"][rows] = [65_535, 65_535, 7]
    lid = eng.lease_one(ns, key(0), 1)[0]
    res = eng.try_get_resident("m", keys([1, 2]), 1, Tier.HOST)
    assert res is not None and res.found.all()
    assert ns.table.cols["leases"][rows].tolist() == [65_535, 65_535, 8]
    eng.release_many([lid, res.lease_id], 1)
    eng.close(flush=False)
