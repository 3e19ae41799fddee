"""The vLLM connector's engine-free parts (kvtier.integrations.connector, planner, mover)
against a real `kvtier serve`, without vLLM: settings garbage, namespace identity, the
scheduler's lookups and plans (tensor parallelism included), the worker's moves, and kvtier
down. The same parts run inside a real vLLM engine in tests/test_vllm.py."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvtier.api.client import Client
from kvtier.api.layouts import Pages
from kvtier.errors import ConfigError
from kvtier.integrations.connector import (
    ConnectorSettings,
    ConnectorStats,
    EngineIdentity,
    Link,
    connector_markdown_table,
    key_width,
    weights_digest,
)
from kvtier.integrations.mover import BackgroundLoads, Mover, SpoiledStores, union_failures
from kvtier.integrations.planner import LoadSpec, Planner, TransferPlan

BS = 32
IDENT = EngineIdentity(model="/models/llama", revision="", model_config='{"layers": 2}',
                       weights="w", dtype="float32", kv_cache_dtype="auto", block_size=BS,
                       hash_algo="sha256", tp_size=2)


def _hashes(n: int, salt: bytes = b"") -> list[bytes]:
    return [hashlib.sha256(salt + i.to_bytes(4, "little")).digest() for i in range(n)]


def _settings(socket: Path | str, **extra) -> ConnectorSettings:
    return ConnectorSettings.parse({"socket": str(socket), "retry_s": 0.0, "report_s": 0.01,
                                    **extra})


@pytest.mark.parametrize("extra, message", [
    ("socket.sock", "JSON object"),
    ({"sockett": "/x"}, "unknown key 'sockett'"),
    ({"timeout_s": "soon"}, "timeout_s: expected a number"),
    ({"timeout_s": 0}, "timeout_s: must be greater than 0"),
    ({"retry_s": -1}, "retry_s: must not be negative"),
    ({"timeout_s": "nan"}, "timeout_s: expected a finite number"),     # settimeout: ValueError
    ({"timeout_s": float("inf")}, "timeout_s: expected a finite number"),
    ({"retry_s": "inf"}, "retry_s: expected a finite number"),         # never retried
    ({"socket": 5}, "socket: expected a string"),
    ({"namespace_prefix": "a/b"}, "namespace_prefix"),
    ({"namespace_prefix": ""}, "namespace_prefix"),
    ({"engine_id": "x" * 101}, "engine_id"),
    ({"background_loads": "yes please"}, "background_loads: expected true or false"),
])
def test_garbage_connector_settings_are_refused_at_start(extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ConnectorSettings.parse(extra)


def test_settings_defaults_and_the_readme_table():
    s = ConnectorSettings.parse({})
    assert s.timeout_s == 2.0 and s.socket.endswith("kvtier.sock") and s.engine_id
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert connector_markdown_table() in readme


def test_block_hashes_must_be_stable_across_processes():
    assert key_width("sha256", {}) == 32 and key_width("sha256_cbor", {}) == 32
    assert key_width("xxhash", {"PYTHONHASHSEED": "0"}) == 16
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        key_width("xxhash_cbor", {})
    with pytest.raises(ConfigError, match="not known"):
        key_width("md5", {})


def test_namespace_names_everything_the_bytes_depend_on(tmp_path):
    base = IDENT.namespace("vllm", 0)
    assert base.startswith("vllm/llama/") and base.endswith("/tp0of2")
    assert IDENT.namespace("vllm", 1) != base
    for change in ({"model_config": '{"layers": 3}'}, {"weights": "v"}, {"dtype": "bfloat16"},
                   {"kv_cache_dtype": "fp8"}, {"block_size": 64}, {"hash_algo": "sha256_cbor"},
                   {"revision": "abc"}, {"tp_size": 4}):
        assert replace(IDENT, **change).namespace("vllm", 0) != base, change
    a, b = tmp_path / "a", tmp_path / "b"
    for d, byte in ((a, b"\1"), (b, b"\2")):
        d.mkdir()
        (d / "model.safetensors").write_bytes(byte * 4096)
        (d / "config.json").write_text("{}")
    assert weights_digest(str(a)) != weights_digest(str(b)) and weights_digest(str(a))
    assert weights_digest("org/hub-model", cache_dir=str(tmp_path / "hub")) == ""


def test_a_hub_models_weights_are_read_from_the_snapshot_the_engine_downloaded(tmp_path):
    # The Hugging Face cache's layout: refs/main names the snapshot (a commit) main is at.
    repo = tmp_path / "hub" / "models--org--tiny"
    for commit, byte in (("a" * 40, b"\1"), ("b" * 40, b"\2")):
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        (snap / "model.safetensors").write_bytes(byte * 4096)
        (snap / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    cache = str(tmp_path / "hub")
    old = weights_digest("org/tiny", cache_dir=cache)
    assert old == weights_digest(str(repo / "snapshots" / ("a" * 40)))
    assert weights_digest("org/tiny", "b" * 40, cache) not in ("", old)
    (repo / "refs" / "main").write_text("b" * 40)        # main moved upstream: new weights
    assert weights_digest("org/tiny", cache_dir=cache) not in ("", old)
    assert replace(IDENT, weights=old).namespace("vllm", 0) != replace(
        IDENT, weights=weights_digest("org/tiny", cache_dir=cache)).namespace("vllm", 0)


@pytest.fixture
def link():
    """Links to make (socket, part="scheduler", **settings), closed after the test."""
    made: list[Link] = []

    def make(socket, part: str = "scheduler", **extra) -> Link:
        made.append(Link(_settings(socket, **extra), part, ConnectorStats()))
        return made[-1]
    yield make
    for lk in made:
        lk.close()


def test_an_unexpected_error_in_a_call_is_a_miss_on_a_fresh_connection(service, link, caplog):
    # a bug (or an error type the link does not know) must cost a recompute, never the engine
    lk = link(service.socket)
    assert lk.call(lambda c: c.stats()["tiers"] is not None, "lookup_errors") is True
    first = lk._client

    def broken(c):
        c.stats()
        raise ZeroDivisionError("a bug")
    with caplog.at_level("WARNING", logger="kvtier"):
        assert lk.call(broken, "lookup_errors") is None
        assert lk.call(broken, "lookup_errors") is None
    assert lk.stats.counts["lookup_errors"] == 2
    assert sum("ZeroDivisionError" in (r.exc_text or "") for r in caplog.records) == 1
    assert lk.call(lambda c: c.stats()["tiers"] is not None, "lookup_errors") is True
    assert lk._client is not first                   # the old connection was dropped


def _planner(lk: Link, names: list[str]) -> Planner:
    return Planner(lk, names, BS, 32)


def _planner_over_stored(service, link, n: int, stored: int, salt: bytes
                         ) -> tuple[Planner, list[bytes]]:
    """A planner of rank 0's namespace where the first `stored` of n chained hashes are kept."""
    name = IDENT.namespace("vllm", 0)
    h = _hashes(n, salt)
    with Client(service.socket) as c:
        c.namespace(name, block_bytes=64, key_width=32).put(h[:stored],
                                                            np.zeros((stored, 64), np.uint8))
    return _planner(link(service.socket), [name]), h


def test_lookup_takes_the_shortest_rank_and_leaves_a_token_to_compute(service, link):
    names = [IDENT.namespace("vllm", r) for r in (0, 1)]
    h = _hashes(8)
    with Client(service.socket) as c:
        for r, n in ((0, 8), (1, 5)):              # rank 1 lacks blocks 5..7
            c.namespace(names[r], block_bytes=64, key_width=32).put(h[:n], np.zeros((n, 64),
                                                                                    np.uint8))
    p = _planner(link(service.socket), names)
    assert p.lookup("r1", h, 8 * BS + 1, 0) == (5 * BS, False)  # a miss on one rank: for all
    p1 = _planner(link(service.socket), names[:1])
    assert p1.lookup("r1", h, 8 * BS + 1, 0) == (8 * BS, False)
    assert p1.lookup("r2", h, 8 * BS, 0) == (7 * BS, False)   # the last token is computed
    assert p1.lookup("r3", h, 8 * BS + 1, 8 * BS) == (0, False)   # all local already
    assert p1.lookup("r4", h[:3], 8 * BS + 1, 0) == (3 * BS, False)   # only hashed blocks
    assert p1.lookup("r5", h, 8 * BS + 1, 2 * BS) == (6 * BS, False)  # past the local hit
    assert p1.link.stats.counts["hit_tokens"] == (8 + 7 + 3 + 6) * BS


def test_plan_loads_the_hit_and_stores_each_block_that_fills_with_its_parent(service, link):
    names = [IDENT.namespace("vllm", 0)]
    h = _hashes(6)
    with Client(service.socket) as c:
        c.namespace(names[0], block_bytes=64, key_width=32).put(h[:2], np.zeros((2, 64),
                                                                                np.uint8))
    p = _planner(link(service.socket), names)
    hashes = h[:4]                                 # the engine's list grows with the tokens
    assert p.lookup("r", hashes, 4 * BS + 10, BS) == (BS, False)   # block 0 is a local hit
    p.allocated("r", [10, 11, 12, 13, 14], BS)
    p.scheduled("r", [10, 11, 12, 13, 14], 2 * BS, 4 * BS + 10)   # the prefill: blocks 2, 3
    plan = p.take_plan()
    assert plan.loads == [LoadSpec("r", [h[1]], [11])]
    assert plan.store_keys == h[2:4] and plan.store_block_ids == [12, 13]
    assert plan.store_parents == [h[1], h[2]] and plan.store_req_ids == ["r", "r"]
    hashes.extend(h[4:6])                          # decode fills blocks 4 and 5
    p.scheduled("r", [10, 11, 12, 13, 14, 15], 4 * BS + 10, 6 * BS)
    plan = p.take_plan()
    assert not plan.loads and plan.store_keys == h[4:6] and plan.store_parents == h[3:5]
    assert p.take_plan().empty()
    p.finished("r")
    p.scheduled("r", [10], 0, 10 * BS)             # unknown now: nothing planned
    assert p.take_plan().empty()


def test_a_running_requests_block_ids_are_looked_up_only_in_a_step_that_fills_a_block(
        service, link):
    # vLLM's get_block_ids builds a list of the request's whole context every call: the
    # connector hands the planner a function, called only where a block fills.
    h = _hashes(4)
    p = _planner(link(service.socket), [IDENT.namespace("vllm", 0)])
    hashes = h[:2]
    assert p.lookup("r", hashes, 2 * BS + 1, 0) == (0, False)
    p.allocated("r", [10, 11, 12], 0)
    p.scheduled("r", [10, 11, 12], 0, 2 * BS + 1)          # the prefill stores blocks 0, 1
    assert p.take_plan().store_block_ids == [10, 11]
    calls = []

    def ids():
        calls.append(1)
        return [10, 11, 12, 13]
    for t in range(2 * BS + 1, 3 * BS - 1):                # decode inside block 2
        p.scheduled("r", ids, t, t + 1)
        assert p.take_plan().empty()
    assert calls == []
    hashes.append(h[2])
    p.scheduled("r", ids, 3 * BS - 1, 3 * BS)              # block 2 fills
    plan = p.take_plan()
    assert calls == [1] and plan.store_keys == [h[2]] and plan.store_block_ids == [12]
    assert plan.store_parents == [h[1]]


def test_fewer_blocks_than_the_hit_needs_fail_loudly_not_unloaded(service, link):
    # vLLM counts the external tokens computed once it has allocated; no load would mean
    # wrong tokens, so a short allocation (a broken invariant) raises.
    p, h = _planner_over_stored(service, link, 4, 3, b"short")
    assert p.lookup("r", h, 4 * BS, 0) == (3 * BS, False)
    with pytest.raises(RuntimeError, match="fewer than the 3"):
        p.allocated("r", [7, 8], 3 * BS)
    assert not p.take_plan().loads


def test_blocks_recomputed_after_a_failed_load_are_stored_again(service, link):
    p, h = _planner_over_stored(service, link, 6, 4, b"re")
    ids = [20, 21, 22, 23, 24, 25]
    assert p.lookup("r", h, 6 * BS, 0) == (4 * BS, False)
    p.allocated("r", ids, 4 * BS)
    p.scheduled("r", ids, 4 * BS, 5 * BS)          # loads 0..3, computes block 4
    plan = p.take_plan()
    assert plan.loads == [LoadSpec("r", h[:4], ids[:4])] and plan.store_keys == [h[4]]
    # Block 2 failed to load: the worker drops the step's stores of "r", and the engine
    # computes again from block 2 (its computed tokens fall back to 2 blocks).
    p.scheduled("r", ids, 2 * BS, 6 * BS - 1)
    plan = p.take_plan()
    assert plan.store_keys == h[2:5] and plan.store_block_ids == ids[2:5]
    assert plan.store_parents == h[1:4]


def test_a_request_sharing_a_block_loaded_in_its_step_lists_it_among_its_reads(service, link):
    name = IDENT.namespace("vllm", 0)
    h, hb = _hashes(5, b"sh"), _hashes(4, b"shb")
    with Client(service.socket) as c:
        c.namespace(name, block_bytes=64, key_width=32).put(h[:4], np.zeros((4, 64), np.uint8))
    p = _planner(link(service.socket), [name])
    ids_a = [20, 21, 22, 23, 24]
    assert p.lookup("a", h, 5 * BS + 1, 0) == (4 * BS, False)
    p.allocated("a", ids_a, 4 * BS)
    # "b" has the same first two blocks: the engine's prefix cache hands it a's blocks 20
    # and 21 in the same step, before a's load has filled them.
    hashes_b = h[:2] + hb[2:4]
    ids_b = [20, 21, 30, 31]
    assert p.lookup("b", hashes_b, 4 * BS + 1, 2 * BS) == (0, False)
    p.allocated("b", ids_b, 0)
    assert p.lookup("c", hashes_b[:2], 2 * BS + 1, 2 * BS) == (0, False)
    p.allocated("c", ids_b[:2] + [40], 0)          # shares them too, stores nothing yet
    p.scheduled("a", ids_a, 4 * BS, 5 * BS)
    p.scheduled("b", ids_b, 2 * BS, 4 * BS + 1)
    p.scheduled("c", ids_b[:2] + [40], 2 * BS, 2 * BS + 1)
    p.lookup("r", h[:2], 2 * BS + 1, 2 * BS)         # admitted in an earlier step, running:
    p.scheduled("r", [20, 21], 2 * BS, 2 * BS + 1)  # not scanned (it cannot hold 20 or 21)
    plan = p.take_plan()
    assert plan.store_req_ids == ["a", "b", "b"] and plan.store_block_ids == [24, 30, 31]
    assert plan.reads == {"a": ids_a[:4], "b": [20, 21], "c": [20, 21]}
    p.scheduled("b", ids_b + [32], 4 * BS + 1, 5 * BS)  # a step without loads: no reads
    assert p.take_plan().reads == {}


def test_a_hit_partly_on_nvme_is_staged_and_loaded_in_the_background(service, link):
    name = IDENT.namespace("vllm", 0)
    h, h2 = _hashes(5, b"bg"), _hashes(5, b"bg2")
    with Client(service.socket) as c:
        ns = c.namespace(name, block_bytes=64, key_width=32)
        ns.put(h, np.zeros((5, 64), np.uint8))
        ns.put(h2, np.zeros((5, 64), np.uint8))
    service.stop()                                 # flushed; the host copies are gone
    service.start()
    off = Planner(link(service.socket), [name], BS, 32, background=False)
    assert off.lookup("q", h2, 5 * BS + 1, 0) == (5 * BS, False)   # background_loads=false
    p = _planner(link(service.socket), [name])
    assert p.lookup("r", h, 5 * BS + 1, 0) == (5 * BS, True)
    p.allocated("r", [1, 2, 3, 4, 5], 5 * BS)
    assert p.take_plan().loads == [LoadSpec("r", h, [1, 2, 3, 4, 5], background=True)]
    assert p.link.stats.counts["background_loads"] == 1
    # One rank failed block 3 a step before every rank was done: vLLM frees the blocks and
    # asks again, and the hit that failed is not offered again (it would fail for ever).
    p.loads_done(set(), {3, 99})
    p.loads_done({"r"}, set())
    assert p.lookup("r", h, 5 * BS + 1, 0) == (0, False)
    p.finished("r")
    deadline = time.monotonic() + 20               # the lookups staged them up to host
    while (p.lookup("r", h, 5 * BS + 1, 0)[1] or p.lookup("q", h2, 5 * BS + 1, 0)[1]) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p.lookup("r", h, 5 * BS + 1, 0) == (5 * BS, False)
    assert p.lookup("q", h2, 5 * BS + 1, 0) == (5 * BS, False)


def _pages(seed: int) -> tuple[list[np.ndarray], Pages]:
    layers = [np.random.default_rng(seed + i).integers(0, 256, (8, 2, 32, 16), dtype=np.uint8)
              for i in range(2)]
    return layers, Pages.from_layers(layers)


def test_mover_stores_and_loads_engine_blocks_and_reports_the_missing(service, link):
    name = IDENT.namespace("vllm", 0)
    src_layers, src = _pages(1)
    dst_layers, dst = _pages(2)
    layout = {"kv_layout": "LBHNC", "pages": [[2, 32, 16]] * 2}
    w = Mover(link(service.socket, "worker0"), name, 32, src, src.block_bytes, layout)
    stats = w.link.stats
    w.open()
    h = _hashes(3, b"m")
    w.save(TransferPlan(store_keys=h[:2], store_parents=[bytes(32), h[0]],
                        store_block_ids=[5, 6], store_req_ids=["a", "a"]))
    r = Mover(link(service.socket, "worker0"), name, 32, dst, dst.block_bytes, layout)
    failed = r.load([LoadSpec("x", h[:1], [0]), LoadSpec("y", [h[1], h[2]], [1, 2])])
    assert failed == {2}                           # h[2] was never stored
    for s, d in zip(src_layers, dst_layers):
        assert (d[0] == s[5]).all() and (d[1] == s[6]).all()
    assert r.link.stats.counts["loaded_blocks"] == 2 and r.link.stats.counts["load_errors"] == 1
    assert stats.counts["stored_blocks"] == 2
    other = Mover(link(service.socket, "worker0"), name, 32, dst, dst.block_bytes,
                  {**layout, "kv_layout": "BLHNC"})
    with pytest.raises(ConfigError, match="BLHNC"):
        other.open()                               # same bytes per block, another layout


def test_save_drops_the_stores_of_a_request_whose_load_failed_and_stores_a_block_once(
        service, link):
    name = IDENT.namespace("vllm", 0)
    layers, pages = _pages(4)
    w = Mover(link(service.socket, "worker0"), name, 32, pages, pages.block_bytes, {})
    w.open()
    h = _hashes(4, b"s")
    # "a" and "b" both filled h[0] (rows 1 and 3); "c" had a failed load in this step.
    w.save(TransferPlan(store_keys=[h[0], h[1], h[0], h[2]],
                        store_parents=[bytes(32), h[0], bytes(32), h[1]],
                        store_block_ids=[1, 2, 3, 4], store_req_ids=["a", "a", "b", "c"]),
           failed_reqs={"c"})
    assert w.link.stats.counts["stored_blocks"] == 2
    with Client(service.socket) as c:
        ns = c.namespace(name)
        assert ns.match_prefix(b"".join(h)) == 2             # h[2] was not stored
        found, got = ns.get(b"".join(h[:2]))
    assert found.all()
    for i, row in ((0, 1), (1, 2)):
        assert bytes(got[i]) == b"".join(layer[row].tobytes() for layer in layers)


def _found_after_save(service, link, seed: int, salt: bytes, reads: dict[str, list[int]],
                      failed_reqs: set[str], failed_blocks: set[int]) -> list[bool]:
    """Save h[0], h[1], h[2] of requests a, b, c (rows 4, 5, 6) with those reads and this
    step's failures; which of the three kvtier holds after."""
    name = IDENT.namespace("vllm", 0)
    _layers, pages = _pages(seed)
    w = Mover(link(service.socket, "worker0"), name, 32, pages, pages.block_bytes, {})
    w.open()
    h = _hashes(3, salt)
    w.save(TransferPlan(store_keys=h, store_parents=[bytes(32)] * 3,
                        store_block_ids=[4, 5, 6], store_req_ids=["a", "b", "c"],
                        reads=reads), failed_reqs, failed_blocks)
    with Client(service.socket) as c:
        found, _ = c.namespace(name).get(b"".join(h))
    return found.tolist()


def test_save_drops_the_stores_of_a_request_that_read_a_block_whose_load_failed(service, link):
    # Block 1 was "a"'s load and failed; "b" computed h[1] over it (a shared prefix block),
    # "c" read block 2, which loaded.
    reads = {"a": [1], "b": [1, 2], "c": [2]}
    assert Mover.spoiled(TransferPlan(reads=reads), {"a"}, {1}) == {"a", "b"}
    assert _found_after_save(service, link, 5, b"rd", reads, {"a"}, {1}) == [False, False, True]


def test_under_async_scheduling_the_next_steps_stores_of_a_spoiled_request_are_dropped():
    # "a"'s load failed in step 1; "d" read its block and stored nothing in that step.
    one = TransferPlan(reads={"a": [1], "d": [1]})
    later = TransferPlan()
    lag = SpoiledStores(async_scheduling=True)
    assert lag.step(one, {"a"}, {1}) == {"a", "d"}
    assert lag.step(later, set(), set()) == {"a", "d"}   # planned before the engine knew
    assert lag.step(later, set(), set()) == set()        # planned from the rolled-back counts
    sync = SpoiledStores(async_scheduling=False)
    assert sync.step(one, {"a"}, {1}) == {"a", "d"}
    assert sync.step(later, set(), set()) == set()       # step 2 is the recompute: kept


def test_each_rank_drops_the_stores_that_a_failed_load_on_another_rank_spoiled(service, link):
    # Rank 0 loaded everything; rank 1's load of "a"'s block 1 failed. Rank 0's new KV of
    # "a" and "b" was computed over rank 1's garbage (the layers' all-reduce).
    failed_reqs, failed_blocks = union_failures([(set(), set()), ({"a"}, {1})])
    assert (failed_reqs, failed_blocks) == ({"a"}, {1})
    reads = {"a": [1], "b": [1], "c": [2]}
    assert _found_after_save(service, link, 6, b"tp", reads, failed_reqs,
                             failed_blocks) == [False, False, True]


def test_background_loads_report_each_request_once_with_its_failed_blocks(service, link):
    name = IDENT.namespace("vllm", 0)
    src_layers, src = _pages(5)
    dst_layers, dst = _pages(6)
    w = Mover(link(service.socket, "worker0"), name, 32, src, src.block_bytes, {})
    w.open()
    h = _hashes(3, b"bgl")
    w.save(TransferPlan(store_keys=h[:2], store_parents=[bytes(32), h[0]],
                        store_block_ids=[0, 1], store_req_ids=["w", "w"]))
    front = link(service.socket, "worker0")
    bg = BackgroundLoads(Mover(front.sibling("worker0/background"), name, 32, dst,
                               dst.block_bytes, {}))
    assert bg.take() == (set(), set())
    bg.submit([LoadSpec("x", h[:2], [4, 5], True), LoadSpec("y", [h[2]], [6], True)])
    deadline = time.monotonic() + 20
    done: set[str] = set()
    failed: set[int] = set()
    while done != {"x", "y"} and time.monotonic() < deadline:
        bg.wait(1.0)                                          # returns once a batch is done
        d, f = bg.take()
        done |= d
        failed |= f
    assert done == {"x", "y"} and failed == {6}              # h[2] was never stored
    for s_, d_ in zip(src_layers, dst_layers):
        assert (d_[4] == s_[0]).all() and (d_[5] == s_[1]).all()
    assert front.stats.counts["loaded_blocks"] == 2 and front.stats.counts["load_errors"] == 1
    assert bg.take() == (set(), set())                       # each reported once
    bg.close()
    bg.mover.link.close()
    assert not bg._thread.is_alive()


def test_kvtier_down_is_a_miss_and_a_load_error_never_an_exception(tmp_path, link):
    dead = tmp_path / "no.sock"
    p = _planner(link(dead), [IDENT.namespace("vllm", 0)])
    assert p.lookup("r", _hashes(4), 4 * BS + 1, 0) == (0, False)
    assert p.link.stats.counts["lookup_errors"] == 1
    _, pages = _pages(3)
    w = Mover(link(dead, "worker0"), "ns", 32, pages, pages.block_bytes, {})
    w.open()                                       # logs, does not raise
    assert w.load([LoadSpec("r", _hashes(2), [3, 4])]) == {3, 4}
    w.save(TransferPlan(store_keys=_hashes(1), store_parents=[bytes(32)], store_block_ids=[0],
                        store_req_ids=["r"]))
    assert w.link.stats.counts["load_errors"] == 2 and w.link.stats.counts["store_errors"] == 1


def _reported(service, engine: str, name: str) -> float:
    with Client(service.socket) as c:
        return c.stats()["connectors"].get(engine, {}).get(name, 0.0)


def test_reports_reach_stats_and_metrics_and_garbage_reports_are_refused(service, link):
    sched = link(service.socket, engine_id="eng-1")
    sched.stats.add("hit_tokens", 64)
    sched.report()
    worker = link(service.socket, "worker0", engine_id="eng-1")
    worker.stats.add("loaded_blocks", 2)
    worker.start_reports()                          # every report_s (0.01 s) from a thread
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _reported(service, "eng-1", "loaded_blocks") < 2:
        time.sleep(0.02)
    with Client(service.socket) as c:
        got = c.stats()["connectors"]["eng-1"]
        assert got["hit_tokens"] == 64 and got["loaded_blocks"] == 2
        from kvtier.errors import BadRequest
        for bad in ({"engine": "e", "part": "p", "counters": {"bogus": 1}},
                    {"engine": "e", "part": "p", "counters": {"hit_tokens": -1}},
                    {"engine": "e", "part": "p", "counters": {"hit_tokens": "many"}},
                    {"engine": "", "part": "p", "counters": {}},
                    {"engine": "e", "part": "p", "counters": [1]}):
            with pytest.raises(BadRequest):
                c._call("report", **bad)
    with urllib.request.urlopen(service.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert 'kvtier_connector_hit_tokens_total{engine="eng-1"} 64.0' in text
    table = subprocess.run([sys.executable, "-m", "kvtier.cli", "stats", "--socket",
                            str(service.socket)], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "COLUMNS": "200"})
    assert table.returncode == 0, table.stderr
    assert "engine connectors" in table.stdout and "eng-1" in table.stdout


def test_warming_a_gpu_cache_that_fails_is_a_warning_not_a_failed_start(monkeypatch, caplog):
    # register_kv_caches warms the CUDA path (kernels, the mapped-read probe) for a KV cache
    # on a GPU. A GPU host without cupy cannot be made here, so the failure is injected
    # (kvtier.gpu.warm raising as its cupy import would) and the KV cache is declared on a GPU.
    import kvtier.gpu
    from kvtier.integrations import mover
    calls = []
    monkeypatch.setattr(kvtier.gpu, "warm", lambda device: calls.append(device))
    _arrays, host = _pages(0)
    assert mover.warm(host, 0) and calls == []                 # host memory: nothing to warm
    monkeypatch.setattr(Pages, "is_cuda", property(lambda self: True))
    assert mover.warm(host, 3) and calls == [3]

    def no_cupy(device):
        raise ModuleNotFoundError("No module named 'cupy'")
    monkeypatch.setattr(kvtier.gpu, "warm", no_cupy)
    with caplog.at_level("WARNING", logger="kvtier.integrations"):
        assert not mover.warm(host, 0)
    assert "could not be warmed (ModuleNotFoundError: No module named 'cupy')" in caplog.text
