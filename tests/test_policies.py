"""Eviction order, told as scenarios: which blocks go, in which order."""

from __future__ import annotations

from kvtier.types import Tier
from tests.conftest import blocks, key, keys

BB = 4096


def _host_keys(eng) -> set[int]:
    ns = eng.namespace("m")
    st = ns.slots[Tier.HOST]
    rows = st.slot_row[st.slot_row >= 0]
    return {int.from_bytes(ns.table.key_of(int(r)), "big") - 1 for r in rows}


def test_lru_store_0_to_3_touch_0_then_store_4_evicts_1(make_engine):
    eng = make_engine(host_capacity=4 * BB, eviction="lru")
    eng.create_namespace("m", BB)
    eng.put("m", keys(range(4)), blocks(4, BB))
    eng.read("m", key(0))
    eng.put("m", key(4), blocks(1, BB))
    assert _host_keys(eng) == {0, 2, 3, 4}


def test_leaf_first_a_parent_outlives_its_cached_child(make_engine):
    eng = make_engine(host_capacity=4 * BB, eviction="lru")
    eng.create_namespace("m", BB)
    eng.put("m", key(0), blocks(1, BB))                           # oldest, but a parent
    eng.put("m", keys([1, 2]), blocks(2, BB), parents=key(0) + key(1))
    eng.put("m", key(3), blocks(1, BB))
    eng.put("m", key(4), blocks(1, BB))            # evicts: the oldest leaf is 2
    assert _host_keys(eng) == {0, 1, 3, 4}
    eng.put("m", key(5), blocks(1, BB))            # 1 is a leaf now and the oldest
    assert _host_keys(eng) == {0, 3, 4, 5}


def test_lru_k_lfu_keeps_the_frequently_used_block(make_engine):
    eng = make_engine(host_capacity=4 * BB, eviction="lru_k_lfu")
    eng.create_namespace("m", BB)
    eng.put("m", keys(range(4)), blocks(4, BB))
    for _ in range(5):
        eng.read("m", key(0))
    eng.read("m", keys([1, 2, 3]))                 # more recent, but used twice only
    eng.put("m", key(4), blocks(1, BB))
    assert 0 in _host_keys(eng)


def test_s3fifo_evicts_one_hit_blocks_before_reused_ones(make_engine):
    eng = make_engine(host_capacity=4 * BB, eviction="s3fifo")
    eng.create_namespace("m", BB)
    eng.put("m", keys(range(2)), blocks(2, BB))
    eng.read("m", keys(range(2)))                  # 0 and 1 are reused
    eng.put("m", keys(range(2, 4)), blocks(2, BB))
    eng.read("m", keys([0, 1]))
    eng.put("m", key(4), blocks(1, BB))            # 2 is the oldest one-hit block
    assert _host_keys(eng) == {0, 1, 3, 4}


def test_per_tier_policy_settings(make_engine):
    eng = make_engine(eviction="lru", eviction_host="s3fifo")
    from kvtier.coherence.policies import POLICIES
    assert eng.policies[Tier.HOST] is POLICIES["s3fifo"]
    assert eng.policies[Tier.NVME] is POLICIES["lru"]
