"""How far prefix reuse through kvtier moves the next-token logits from a full recompute, by
how the reused blocks were written (README "Reuse and the logits").

    python examples/reuse_numerics.py --json      # starts its own kvtier serve (CPU, ~1 min)

Tiny causal LMs with seeded random weights, built here (nothing is downloaded): Llama with GQA
and head_dim 24, Mistral with a 24-token sliding window, Qwen2 with YaRN RoPE and mixed
full/sliding layers; each in bfloat16, float16 and float32. For each it reports the largest
absolute logit difference against recompute when the reused blocks were written

- by a prefill from token 0 (``prefill``),
- by a forward that began after a reused partial page, off a 16-token boundary (``offset``),
- during greedy decode, one token per forward (``decode``),

and, for the same cases, against transformers' own in-memory cache holding the K/V the writer
computed (``*_vs_in_memory``: 0.0 means kvtier returned exactly the bytes it was given).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvtier  # noqa: E402
from kvtier.kvcache import (BlockLayout, from_dynamic_cache, load_prefix, model_salt,  # noqa: E402
                            new_cache, store_blocks, to_dynamic_cache)

FAMILIES = ("llama-gqa-hd24", "mistral-sliding", "qwen2-yarn")
DTYPES = ("bfloat16", "float16", "float32")
T = 16


def build(family: str, dtype: str, seed: int = 0) -> Any:
    """A tiny causal LM of the family with seeded random weights, in dtype."""
    import transformers
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    if family == "llama-gqa-hd24":           # GQA 4:2 and head_dim 24, not hidden / heads
        cfg = transformers.LlamaConfig(**common, head_dim=24)
        cls = transformers.LlamaForCausalLM
    elif family == "mistral-sliding":        # every layer slides over 24 tokens
        cfg = transformers.MistralConfig(**common, sliding_window=24)
        cls = transformers.MistralForCausalLM
    elif family == "qwen2-yarn":             # YaRN; layer 0 full, layers 1-2 sliding
        cfg = transformers.Qwen2Config(
            **{**common, "max_position_embeddings": 256},
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                             "original_max_position_embeddings": 64},
            use_sliding_window=True, sliding_window=24, max_window_layers=1)
        cls = transformers.Qwen2ForCausalLM
    else:
        raise SystemExit(f"unknown family {family!r}: one of {', '.join(FAMILIES)}")
    torch.manual_seed(seed)
    return cls(cfg).to(getattr(torch, dtype)).eval()


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, n).tolist()


class Worker:
    """kvtier.kvcache's two calls around a forward pass."""

    def __init__(self, client: kvtier.Client, model: Any, name: str) -> None:
        self.model = model
        self.layout = BlockLayout.from_model(model, T)
        self.ns = client.namespace(name, block_bytes=self.layout.block_bytes,
                                   layout=self.layout.as_layout())
        self.salt = model_salt(name, "seed-0")

    @torch.no_grad()
    def run(self, token_ids: list[int], store: bool = True) -> tuple[Any, Any, Any]:
        """(next-token logits, the kvtier.kvcache.Prefix reused, the cache after the run)."""
        prefix = load_prefix(self.ns, self.layout, self.model.config, token_ids, self.salt)
        out = self.model(torch.tensor([token_ids[prefix.tokens:]]), cache=prefix.cache,
                         use_cache=True)
        if store:
            store_blocks(self.ns, self.layout, out.cache, token_ids, self.salt,
                         first_block=prefix.blocks)
        return out.logits[0, -1], prefix, out.cache

    @torch.no_grad()
    def recompute(self, token_ids: list[int]) -> Any:
        return self.model(torch.tensor([token_ids])).logits[0, -1]

    @torch.no_grad()
    def continue_in_memory(self, cache: Any, n: int, rest: list[int]) -> Any:
        """The logits of running rest after the first n tokens of cache, without kvtier."""
        own = to_dynamic_cache([(k[:, :, :n], v[:, :, :n]) for k, v in from_dynamic_cache(cache)],
                               self.model.config)
        return self.model(torch.tensor([rest]), cache=own, use_cache=True).logits[0, -1]

    @torch.no_grad()
    def decode(self, token_ids: list[int], steps: int) -> tuple[list[int], Any]:
        """Greedy decode, one token per forward; (all tokens, the cache holding them)."""
        cache = new_cache(self.model.config)
        logits = self.model(torch.tensor([token_ids]), cache=cache, use_cache=True).logits[0, -1]
        ids = list(token_ids)
        for _ in range(steps):
            ids.append(int(logits.argmax()))
            out = self.model(torch.tensor([ids[-1:]]), cache=cache, use_cache=True)
            logits, cache = out.logits[0, -1], out.cache
        return ids, cache


def _diff(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).abs().max())


def measure(client: kvtier.Client, family: str, dtype: str) -> dict[str, Any]:
    model = build(family, dtype)
    w = Worker(client, model, f"numerics/{family}/{dtype}")
    row: dict[str, Any] = {"family": family, "dtype": dtype}
    # prefill: blocks of an earlier 79-token prompt; 36 tokens run after the 64 reused.
    shared, tail = tokens(70, 1), tokens(30, 3)
    _, _, written = w.run(shared + tokens(9, 2))
    logits, prefix, _ = w.run(shared + tail, store=False)
    row["prefill"] = _diff(logits, w.recompute(shared + tail))
    row["prefill_vs_in_memory"] = _diff(logits, w.continue_in_memory(
        written, prefix.tokens, (shared + tail)[prefix.tokens:]))
    # offset: a 37-token prompt leaves a 5-token page; the next forward begins at token 37.
    p1 = tokens(37, 5)
    w.run(p1)
    p2 = p1 + tokens(43, 6)
    _, _, written = w.run(p2)
    p3 = p2 + tokens(20, 7)
    logits, prefix, _ = w.run(p3, store=False)
    row["offset"] = _diff(logits, w.recompute(p3))
    row["offset_vs_in_memory"] = _diff(logits, w.continue_in_memory(
        written, prefix.tokens, p3[prefix.tokens:]))
    # decode: 40 prompt tokens, 30 decoded, then 7 more tokens run after them.
    ids, cache = w.decode(tokens(40, 9), 30)
    store_blocks(w.ns, w.layout, cache, ids, w.salt)
    extra = tokens(7, 10)
    logits, prefix, _ = w.run(ids + extra, store=False)
    recompute = w.recompute(ids + extra)
    row["decode"] = _diff(logits, recompute)
    row["decode_vs_in_memory"] = _diff(logits, w.continue_in_memory(cache, prefix.tokens,
                                                                    extra))
    row["decode_same_greedy_token"] = int(logits.argmax()) == int(recompute.argmax())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--machine", default=platform.node())
    args = ap.parse_args()
    from tests.service import Service
    svc = Service(tempfile.mkdtemp(prefix="kvtier-numerics-") + "/svc", admin=False,
                  host_capacity="256MiB", nvme_capacity="1GiB").start()
    try:
        with kvtier.Client(svc.socket, timeout=300) as c:
            rows = [measure(c, f, d) for f in FAMILIES for d in DTYPES]
    finally:
        svc.stop()
    import transformers
    res = {"machine": args.machine, "torch": torch.__version__,
           "transformers": transformers.__version__, "threads": torch.get_num_threads(),
           "rows": rows}
    print(json.dumps(res) if args.json else "\n".join(json.dumps(r) for r in rows))


if __name__ == "__main__":
    main()
