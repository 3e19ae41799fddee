"""rev13: what the room step's second slice (stall12) evicts when, between the two slices,
another get brought up blocks of the batch: only what is still missing. Real engine (the
stall12 tests' full host tier: 64 slots, all held; blocks 0-63 on NVMe only)."""

from __future__ import annotations

from kvtier.types import Tier
from tests.conftest import keys
from tests.test_get_slices import _drive
from tests.test_stall12_slices import BATCH, _accounted, _all_readable, _full_host


def test_the_second_room_slice_evicts_only_for_blocks_still_missing(tmp_path):
    eng, data = _full_host(tmp_path)
    try:
        _another_get_between_the_slices(eng, data)
    finally:
        eng.close(flush=False)


def _another_get_between_the_slices(eng, data) -> None:
    host = eng.counters.tiers[Tier.HOST]
    marks = {}

    def between(name):
        if name == "_room_for_get":     # 24 evicted; another get brings up 0-23 (24 free)
            o = eng.get("m", keys(range(24)), 0)
            assert o.found.all()
            eng.release(o.lease_id)
            marks["before_rest"] = host.evictions
        elif name == "_room_rest":
            marks["after_rest"] = host.evictions
    names, res = _drive(eng, eng.get_steps("m", keys(BATCH), 0), between)
    assert names[:2] == ["_room_for_get", "_room_rest"]
    assert res.found.all()
    eng.release(res.lease_id)
    # 24 of the batch are still missing (24-47) and no slot is free: 24 evictions at most.
    # main: 48 (the first slice's want), 24 blocks dropped from the host tier for nothing.
    assert marks["after_rest"] - marks["before_rest"] <= 24
    _accounted(eng)
    _all_readable(eng, data)
