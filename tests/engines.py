"""Small engines for the gets' and evictions' differential tests (tests/test_gets.py,
tests/test_eviction.py): tiers of a few slots, so that random batches fill them, evict and
read NVMe within a few hundred steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.coherence.engine import Engine
from kvtier.config import make_settings
from tests.conftest import hbm_standin

BB = 4096


def small_engine(tmp: Path, hbm: bool, **settings: Any) -> Engine:
    """Namespace m of BB-byte blocks, a host tier of 16 slots (an HBM stand-in of 8 above
    it), write-back onto 1 MiB segments; settings (eviction, for one) override these."""
    values = {"data_dir": str(tmp), "host_capacity": "64KiB",
              "hbm_capacity": "32KiB" if hbm else "0", "nvme_capacity": "4MiB",
              "segment_bytes": "1MiB", "write_policy": "write_back", **settings}
    eng = Engine(make_settings(values), hbm_pool_factory=hbm_standin if hbm else None)
    eng.create_namespace("m", BB)
    return eng


def put_or_evict(eng: Engine, rng: Any, op: int, ids: list[int], step: int, seen: list,
                 evict_below: int) -> bool:
    """One random step's put (op < 3: ids made distinct, blocks of seed step; a tier with no
    room noted on seen) or flush and admin eviction (op < evict_below: the count evicted
    onto seen). False, with nothing done, for any other op (the caller's get)."""
    from kvtier.errors import CapacityError
    from kvtier.types import Tier
    from tests.conftest import blocks, keys

    if op < 3:
        ids = list(dict.fromkeys(ids))
        try:
            eng.put("m", keys(ids), blocks(len(ids), BB, step))
        except CapacityError:
            seen.append("put full")
    elif op < evict_below:
        eng.flush()
        seen.append(eng.evict(Tier.HOST, int(rng.integers(1, 12))))
    else:
        return False
    return True
