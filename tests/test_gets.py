"""kvtier.coherence.gets: a get's split into ready and to-bring-up blocks in one C call
(coherence/_gets.c) leaves what the numpy split leaves; a bad key pins nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.coherence import gets
from kvtier.coherence.engine import Engine
from kvtier.config import make_settings
from kvtier.errors import BadRequest
from kvtier.types import Tier
from tests.conftest import blocks, hbm_standin, keys

BB = 4096

pytestmark = pytest.mark.skipif(gets._split is None, reason="kvtier.coherence._gets not built")


def _state_after_gets(tmp: Path, seed: int, hbm: bool) -> list:
    """Random puts, evictions into NVMe and gets (repeated keys, missing keys, resident and
    NVMe blocks mixed): after every get its result, the page table, the slot arrays and the
    counters."""
    eng = Engine(make_settings({"data_dir": str(tmp), "host_capacity": "64KiB",
                                "hbm_capacity": "32KiB" if hbm else "0",
                                "nvme_capacity": "4MiB", "segment_bytes": "1MiB",
                                "write_policy": "write_back"}),
                 hbm_pool_factory=hbm_standin if hbm else None)
    eng.create_namespace("m", BB)
    rng = np.random.default_rng(seed)
    seen: list = []
    for step in range(150):
        op = rng.integers(0, 10)
        ids = [int(i) for i in rng.integers(0, 60, int(rng.integers(1, 12)))]
        if op < 3:
            ids = list(dict.fromkeys(ids))
            eng.put("m", keys(ids), blocks(len(ids), BB, step))
        elif op < 4:
            eng.flush()
            seen.append(eng.evict(Tier.HOST, int(rng.integers(1, 10))))
        else:
            if op == 9:
                ids = ids + [1000 + step]          # a key never stored: a miss
            res = eng.get("m", keys(ids))
            seen.append([res.found.tolist(), res.slots.tolist(), res.versions.tolist(),
                         res.checksums.tolist()])
            eng.release(res.lease_id)
        ns = eng.namespace("m")
        t = ns.table
        seen.append({name: col[: t.n_rows].tolist() for name, col in t.cols.items()
                     if name != "key"})
        for st in ns.slots.values():
            seen.append((st.slot_row.tolist(), st.leases.tolist(), st.pool.free_count))
        seen.append({k.label: v.as_dict() for k, v in eng.counters.tiers.items()})
    eng.close(flush=False)
    return seen


@pytest.mark.parametrize("hbm", [False, True], ids=["host", "hbm-above"])
def test_the_c_split_leaves_the_state_the_numpy_split_leaves(tmp_path: Path, hbm: bool,
                                                             monkeypatch):
    with_c = _state_after_gets(tmp_path / "c", 3, hbm)
    monkeypatch.setattr(gets, "_split", None)
    assert _state_after_gets(tmp_path / "numpy", 3, hbm) == with_c


def test_a_missing_all_zero_key_is_refused_before_anything_is_pinned(tmp_path: Path):
    eng = Engine(make_settings({"data_dir": str(tmp_path), "host_capacity": "64KiB",
                                "nvme_capacity": "4MiB"}))
    try:
        eng.create_namespace("m", BB)
        eng.put("m", keys(range(4)), blocks(4, BB))
        eng.flush()
        eng.evict(Tier.HOST, 2)                    # two on NVMe only: the split path
        st = eng.namespace("m").slots[Tier.HOST]
        before = st.leases.copy()
        with pytest.raises(BadRequest, match="all-zero key"):
            eng.get("m", keys(range(4)) + bytes(16))
        assert (st.leases == before).all() and not eng.leases
    finally:
        eng.close(flush=False)


def test_split_rows_refuses_a_broken_table_before_it_pins(tmp_path: Path):
    # A current copy whose slot lies outside the pool (never made by the engine): a typed
    # error, and no pin written.
    n = 4
    version = np.array([1, 1, 1, 0], dtype=np.uint64)
    copy_ver = np.zeros((n, 4), dtype=np.uint64)
    copy_ver[:3, Tier.HOST] = 1
    slot = np.full((n, 4), -1, dtype=np.int32)
    slot[:3, Tier.HOST] = [0, 1, 9]                # 9: past a pool of 4
    sums = np.arange(n, dtype=np.uint64)
    pool = np.zeros(4, dtype=np.uint32)
    rows = np.array([0, 1, 2, 3, -1], dtype=np.int64)
    outs = [np.empty(5, dtype=d) for d in (bool, np.int64, np.uint64, np.uint64, np.int64)]
    with pytest.raises(ValueError, match="outside the pool"):
        gets._split(version, copy_ver, slot, sums, pool, rows, n, int(Tier.HOST), *outs)
    assert not pool.any()
    slot[2, Tier.HOST] = 2
    copy_ver[1, Tier.HOST] = 0                     # row 1 must be brought up
    k, hits, repeats = gets._split(version, copy_ver, slot, sums, pool, np.array(
        [0, 1, 2, 3, -1, 1], dtype=np.int64), n, int(Tier.HOST),
        *[np.empty(6, dtype=o.dtype) for o in outs])
    assert (k, hits, repeats) == (2, 2, True) and pool.tolist() == [1, 0, 1, 0]
