"""The HBM reserve (coherence.reserve): the alpha-weighted formula by hand, and pools sized from
the demand of earlier runs across real restarts of the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.coherence import reserve
from kvtier.coherence.engine import Engine
from kvtier.config import make_settings
from kvtier.errors import ConfigError
from kvtier.pagetable.store import Catalog
from kvtier.types import Tier
from tests.conftest import blocks, hbm_standin, keys

BB = 4096


def test_alpha_reserve_is_the_weighted_sum_of_peaks_newest_first():
    assert reserve.alpha_reserve([], 0.7) == 0
    assert reserve.alpha_reserve([10, 20, 40], 0.5) == 30            # 10 + 10 + 10
    assert reserve.alpha_reserve([100, 100], 0.7) == 170
    assert reserve.alpha_reserve([3, 1], 0.7) == 4                   # 3.7, rounded up
    steady = [100] * reserve.HISTORY
    assert 330 <= reserve.alpha_reserve(steady, 0.7) <= 334          # -> 100 / (1 - 0.7)


def test_pool_slots_take_capacity_without_history_and_stay_within_bounds():
    assert reserve.pool_slots([], 0.7, 64) == 64
    assert reserve.pool_slots([10], 0.7, 64) == 10
    assert reserve.pool_slots([60, 60], 0.7, 64) == 64               # the cap binds
    assert reserve.pool_slots([0, 0], 0.7, 64) == 1                  # at least one block
    assert reserve.record(list(range(20)), 99)[:3] == [99, 0, 1]
    assert len(reserve.record(list(range(20)), 99)) == reserve.HISTORY


def _engine(tmp_path: Path, mode: str) -> Engine:
    return Engine(make_settings({"data_dir": str(tmp_path / "d"), "host_capacity": "4MiB",
                                 "nvme_capacity": "0", "hbm_capacity": f"{64 * BB}",
                                 "hbm_reserve": mode}), hbm_pool_factory=hbm_standin)


def _run(tmp_path: Path, mode: str, demand: int) -> int:
    """One run of the engine that puts `demand` blocks into HBM at once; returns the HBM pool's
    size it started with."""
    eng = _engine(tmp_path, mode)
    eng.create_namespace("m", BB)
    slots = eng.namespace("m").slots[Tier.HBM].pool.n_slots
    eng.put("m", keys(range(demand)), blocks(demand, BB), tier=Tier.HBM)
    eng.close()
    return slots


def test_history_sizes_each_run_from_the_peaks_of_the_runs_before(tmp_path: Path):
    assert _run(tmp_path, "history", 10) == 64          # no history yet: hbm_capacity
    assert _run(tmp_path, "history", 6) == 10           # 10
    assert _run(tmp_path, "history", 6) == 13           # 6 + 0.7 x 10 = 13
    assert _run(tmp_path, "history", 6) == 16           # 6 + 0.7 x 6 + 0.49 x 10 = 15.1, up


def test_fixed_mode_ignores_the_history(tmp_path: Path):
    _run(tmp_path, "history", 5)
    assert _run(tmp_path, "fixed", 5) == 64
    assert _run(tmp_path, "history", 5) == 9            # 5 + 0.7 x 5 = 8.5 -> 9


def test_alpha_must_be_a_fraction(tmp_path: Path):
    for bad in ("0", "1", "1.5", "-0.1"):
        with pytest.raises(ConfigError, match="hbm_reserve_alpha"):
            make_settings({"data_dir": str(tmp_path), "hbm_reserve_alpha": bad})
    with pytest.raises(ConfigError, match="hbm_reserve"):
        make_settings({"data_dir": str(tmp_path), "hbm_reserve": "sometimes"})


@pytest.mark.parametrize("garbage", [b"\xc1\xff not msgpack", b"\xa3abc"])
def test_a_damaged_history_on_disk_falls_back_to_capacity_and_is_rewritten(tmp_path: Path,
                                                                          garbage: bytes):
    # The history lives in LMDB's meta db; bytes that are not msgpack, or msgpack that is not
    # a list, size the pool at hbm_capacity, and the next close writes a sound history again.
    _run(tmp_path, "history", 7)
    cat = Catalog(tmp_path / "d" / "meta")                 # the engine is closed: edit its LMDB
    with cat.env.begin(write=True, db=cat._meta_db) as txn:
        txn.put(b"hbm_peaks:1", garbage)
    cat.close()
    eng = _engine(tmp_path, "history")
    eng.create_namespace("m", BB)
    assert eng.namespace("m").slots[Tier.HBM].pool.n_slots == 64
    eng.close()
    assert _run(tmp_path, "history", 1) == 1      # the fresh history: the last run's 0 demand
