"""Prefix KV reuse through a real kvtier serve gives the same logits as full recompute
(float32, CPU): from the host tier, from NVMe after a restart, and with a block missing."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvtier  # noqa: E402
from kvtier.kvcache import (BlockLayout, blocks_to_layer_kv, cache_to_blocks, chain_keys,  # noqa: E402
                            model_salt)
from tests.service import Service  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from hf_worker import PrefixWorker, build_model  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return build_model(layers=2, hidden=64, heads=4, kv_heads=2)


def _prompts(n_shared: int, tails: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 1000, n_shared).tolist()
    return [shared + rng.integers(0, 1000, t).tolist() for t in tails]


def test_block_layout_round_trip(model):
    layout = BlockLayout.from_model(model, 16)
    assert layout.block_bytes == 2 * 2 * 2 * 16 * 16 * 4
    kv = [(torch.randn(1, 2, 48, 16), torch.randn(1, 2, 48, 16)) for _ in range(2)]
    blocks = cache_to_blocks(kv, layout, 1, 2)
    assert tuple(blocks.shape) == (2, layout.block_bytes)
    back = blocks_to_layer_kv(blocks, layout)
    assert torch.equal(back[1][0], kv[1][0][:, :, 16:48]) and torch.equal(back[0][1],
                                                                          kv[0][1][:, :, 16:48])


def test_chain_keys_share_exactly_the_shared_prefix():
    salt = model_salt("tiny", "r1")
    a = chain_keys(list(range(64)), 16, salt)
    b = chain_keys(list(range(40)) + [999] * 24, 16, salt)
    assert a[:2] == b[:2] and a[2] != b[2] and len(a) == 4
    assert chain_keys(list(range(64)), 16, model_salt("tiny", "r2"))[0] != a[0]


def test_reuse_gives_the_logits_of_full_recompute(tmp_path, model):
    svc = Service(tmp_path / "svc", admin=False, host_capacity="64MiB").start()
    try:
        with kvtier.Client(svc.socket) as c:
            w = PrefixWorker(c, model, "llama-tiny")
            p1, p2, p3 = _prompts(200, [37, 5, 90])
            logits1, st1 = w.prefill(p1)
            # 14 full blocks and the partial last page (13 tokens)
            assert st1["reused_blocks"] == 0 and st1["stored_blocks"] == (200 + 37) // 16 + 1
            assert float((logits1 - w.recompute(p1)).abs().max()) <= TOL
            for p in (p2, p3):
                logits, st = w.prefill(p)
                assert st["reused_blocks"] == 200 // 16          # the shared full blocks
                assert float((logits - w.recompute(p)).abs().max()) <= TOL
    finally:
        svc.stop()


def test_reuse_from_nvme_after_a_restart(tmp_path, model):
    svc = Service(tmp_path / "svc", admin=False, host_capacity="64MiB").start()
    p1, p2 = _prompts(160, [20, 33], seed=4)
    try:
        with kvtier.Client(svc.socket) as c:
            PrefixWorker(c, model, "llama-tiny").prefill(p1)
        svc.stop()
        svc.start()                               # host tier empty: blocks come from NVMe
        with kvtier.Client(svc.socket) as c:
            w = PrefixWorker(c, model, "llama-tiny")
            logits, st = w.prefill(p2)
            assert st["reused_blocks"] == 10
            assert c.stats()["tiers"]["host"]["promotions"] >= 10
            assert float((logits - w.recompute(p2)).abs().max()) <= TOL
    finally:
        svc.stop()


def test_a_missing_middle_block_limits_reuse_to_the_leading_run(tmp_path, model):
    svc = Service(tmp_path / "svc", admin=False, host_capacity="64MiB").start()
    p1, p2 = _prompts(160, [20, 45], seed=7)
    try:
        with kvtier.Client(svc.socket) as c:
            w = PrefixWorker(c, model, "llama-tiny")
            w.prefill(p1)
            keys = chain_keys(p1, 16, w.salt)
            assert w.ns.delete(keys[4]) == 1          # block 4 of 11 is gone
            logits, st = w.prefill(p2)
            assert st["reused_blocks"] == 4
            assert float((logits - w.recompute(p2)).abs().max()) <= TOL
    finally:
        svc.stop()
