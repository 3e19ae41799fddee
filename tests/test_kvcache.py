"""kvtier.kvcache with tiny seeded random-weight transformers models built here (nothing is
downloaded), against a real kvtier serve: GQA with an unusual head dim, a sliding-window
Mistral and a Qwen2 with YaRN RoPE and mixed full/sliding layers, in bf16, fp16 and fp32.
Blocks written by prefill give the logits of full recompute bit for bit; blocks written during
decode give those of transformers' own in-memory cache bit for bit, and differ from recompute
by what the decode-time matmuls round differently (measured, README "Reuse and the logits")."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvtier  # noqa: E402
from kvtier.errors import BadRequest  # noqa: E402
from kvtier.kvcache import (BlockLayout, cache_to_blocks, chain_keys, check_model,  # noqa: E402
                            from_dynamic_cache, load_prefix, model_salt, new_cache,
                            partial_key, store_blocks)
from tests.service import Service  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from reuse_numerics import DTYPES, FAMILIES, T, Worker, build, measure, tokens  # noqa: E402

# Blocks written off a 16-token boundary or during decode, against recompute: max |logit
# difference|, about 10x what examples/reuse_numerics.py measured on the dev VM (README).
NOT_BITWISE_TOL = {"bfloat16": 0.02, "float16": 0.003, "float32": 2e-6}


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    s = Service(tmp_path_factory.mktemp("kvcache") / "svc", admin=False,
                host_capacity="64MiB", nvme_capacity="256MiB").start()
    yield s
    s.stop()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_reused_logits_by_how_the_blocks_were_written(svc: Service, family: str, dtype: str):
    with kvtier.Client(svc.socket) as c:
        row = measure(c, family, dtype)
    # kvtier returns the bytes it was given: the logits of transformers' own cache, exactly.
    assert row["prefill_vs_in_memory"] == row["offset_vs_in_memory"] == 0.0
    assert row["decode_vs_in_memory"] == 0.0
    assert row["prefill"] == 0.0                     # prefill-written: recompute's, exactly
    assert row["offset"] <= NOT_BITWISE_TOL[dtype]
    assert row["decode"] <= NOT_BITWISE_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_layout_and_a_short_run_after_the_prefix(svc: Service, dtype: str):
    model = build("llama-gqa-hd24", dtype)
    shared = tokens(64, 1)
    with kvtier.Client(svc.socket) as c:
        w = Worker(c, model, f"short/{dtype}")
        assert w.layout == BlockLayout(3, 2, 24, T, dtype)          # dtype from the model
        assert w.layout.block_bytes == 3 * 2 * 2 * T * 24 * (4 if dtype == "float32" else 2)
        _, _, written = w.run(shared + tokens(9, 2))
        tail = tokens(3, 4)
        logits, prefix, _ = w.run(shared + tail, store=False)
        assert (prefix.tokens, prefix.blocks, prefix.partial) == (64, 4, 0)
        assert torch.equal(logits, w.continue_in_memory(written, 64, tail))
        recompute = w.recompute(shared + tail)
        if dtype == "float32":
            # fp32 matmuls of so few rows take another CPU kernel than recompute's (measured
            # on the dev VM: up to 2.1e-7); README "Reuse and the logits".
            assert float((logits - recompute).abs().max()) <= 1e-6
        else:
            assert torch.equal(logits, recompute)


def test_the_partial_last_page_is_stored_reused_and_replaced_as_it_fills(svc: Service):
    model = build("llama-gqa-hd24", "bfloat16")
    tol = NOT_BITWISE_TOL["bfloat16"]
    p1 = tokens(37, 5)                               # 2 full blocks and 5 tokens
    with kvtier.Client(svc.socket) as c:
        w = Worker(c, model, "partial")

        def check(p: list[int], writer: object, want: tuple[int, int, int]) -> None:
            logits, prefix, _ = w.run(p, store=False)
            assert (prefix.tokens, prefix.blocks, prefix.partial) == want
            assert torch.equal(logits, w.continue_in_memory(writer, prefix.tokens,
                                                            p[prefix.tokens:]))
            assert float((logits.float() - w.recompute(p).float()).abs().max()) <= tol

        _, _, c1 = w.run(p1)
        check(p1, c1, (36, 2, 4))                    # the same prompt: all but its last token
        keys = chain_keys(p1, T, w.salt)
        k5 = partial_key(keys[1], p1[32:], w.salt)
        assert w.ns.match_prefix(k5) == 1
        p2 = p1 + tokens(10, 6)                      # the page fills to 15 tokens
        check(p2, c1, (37, 2, 5))
        whole = load_prefix(w.ns, w.layout, model.config, p2, w.salt, partial=False)
        assert (whole.tokens, whole.blocks, whole.partial) == (32, 2, 0)
        _, _, c2 = w.run(p2)
        k15 = partial_key(keys[1], p2[32:], w.salt)
        assert w.ns.match_prefix(k5) == 0 and w.ns.match_prefix(k15) == 1   # replaced
        p3 = p2 + tokens(20, 7)
        check(p3, c2, (47, 2, 15))
        _, _, c3 = w.run(p3)
        # Same full blocks, another tail: the key names the page's tokens, so it is not used.
        p4 = p1[:33] + tokens(12, 8)
        logits, prefix, _ = w.run(p4, store=False)
        assert (prefix.tokens, prefix.partial) == (32, 0)
        assert torch.equal(logits, w.recompute(p4))  # prefill-written blocks only
        # A prompt that is all cached reuses all but its last token.
        check(p3[:64], c3, (63, 4, 0))
        for short in ([], p1[:1]):
            empty = load_prefix(w.ns, w.layout, model.config, short, w.salt)
            assert (empty.tokens, empty.blocks, empty.partial) == (0, 0, 0)


# ---------------------------------------------------------------------- bad input

def test_models_it_cannot_store_are_refused_by_name():
    linear = transformers.Qwen3NextConfig(num_hidden_layers=4, hidden_size=64,
                                          num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(BadRequest, match="linear_attention"):
        BlockLayout.from_config(linear, T, "bfloat16")
    dynamic = transformers.LlamaConfig(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                        "rope_theta": 10000.0})
    with pytest.raises(BadRequest, match="'dynamic' RoPE"):
        check_model(dynamic)
    with pytest.raises(BadRequest, match="'dynamic' RoPE"):
        new_cache(dynamic)
    with pytest.raises(BadRequest, match="dtype 'int8'"):
        BlockLayout.from_config(transformers.LlamaConfig(), T, "int8")


def test_a_salt_must_name_the_model_and_revision():
    with pytest.raises(BadRequest, match="salt"):
        chain_keys(list(range(32)), T, b"")
    with pytest.raises(BadRequest, match="salt"):
        chain_keys(list(range(32)), T, None)
    for bad in (("", "r"), ("m", ""), ("m", None), (b"m", "r")):
        with pytest.raises(BadRequest, match="model_salt"):
            model_salt(*bad)
    assert model_salt("m", "r1") != model_salt("m", "r2")
    salt = model_salt("m", "r1")
    for bad_t in (0, -16, 1.5):
        with pytest.raises(BadRequest, match="tokens_per_block"):
            chain_keys(list(range(32)), bad_t, salt)
    for bad in ([1.5, 2.0], [[1, 2]], ["a", "b"], [object()]):
        with pytest.raises(BadRequest, match="token_ids must be a 1-D sequence of integers"):
            chain_keys(bad, T, salt)
        with pytest.raises(BadRequest, match="token_ids"):
            partial_key(None, bad, salt)


def test_caches_that_cannot_fill_blocks_are_refused():
    model = build("mistral-sliding", "float32")
    layout = BlockLayout.from_model(model, T)
    with torch.no_grad():
        own = model(torch.tensor([tokens(40, 11)]), use_cache=True).cache   # window-1 kept
    with pytest.raises(BadRequest, match="DynamicSlidingWindowLayer.*new_cache"):
        from_dynamic_cache(own)
    kv = [(torch.zeros(1, 2, 32, 16), torch.zeros(1, 2, 32, 16))] * 3
    with pytest.raises(BadRequest, match="bfloat16"):
        cache_to_blocks(kv, BlockLayout(3, 2, 16, T, "bfloat16"), 0, 2)
    with pytest.raises(BadRequest, match="2 layers, the layout 3"):
        cache_to_blocks(kv[:2], layout, 0, 2)
    with pytest.raises(BadRequest, match="expected"):
        cache_to_blocks([(torch.zeros(2, 2, 32, 16),) * 2] * 3, layout, 0, 2)
    with pytest.raises(BadRequest, match="too few"):
        cache_to_blocks(kv, layout, 2, 1)


def test_store_blocks_refuses_tokens_the_cache_was_not_run_on(svc: Service):
    model = build("llama-gqa-hd24", "float32")
    with kvtier.Client(svc.socket) as c:
        w = Worker(c, model, "mismatch")
        _, _, cache = w.run(tokens(20, 12), store=False)
        with pytest.raises(BadRequest, match="holds 20 tokens and token_ids 21"):
            store_blocks(w.ns, w.layout, cache, tokens(21, 12), w.salt)
