"""A real inference worker (Hugging Face transformers) that reuses prefix KV through kvtier.

    python examples/hf_worker.py --check --json          # starts its own kvtier serve
    python examples/hf_worker.py --check --socket PATH   # or uses a running one

The model is a small Llama-architecture causal LM with random weights (fixed seed; nothing is
downloaded). For each prompt the worker:

1. splits the tokens into blocks of 16 and computes chained block keys (kvtier.kvcache);
2. asks kvtier how many leading blocks are cached (match_prefix) and fetches them (get), with
   the fullest cached partial page after them (kvtier.kvcache.load_prefix);
3. turns those blocks into the model's KV cache and runs the forward pass only on the rest;
4. stores the new blocks, each with its parent key, and the partly filled last page, so the
   next prompt can reuse them (kvtier.kvcache.store_blocks).

--check runs one prompt of --prompt-tokens tokens whose first --cached-tokens tokens were stored
by an earlier prompt, and prints the reused block count, the largest absolute difference of the
next-token logits between reuse and full recompute, and both times to first token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvtier  # noqa: E402
from kvtier.kvcache import BlockLayout, load_prefix, model_salt, store_blocks  # noqa: E402


def build_model(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                vocab: int = 1000, dtype: torch.dtype = torch.float32, device: str = "cpu",
                seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=65536)
    torch.manual_seed(seed)
    with torch.device(device):                 # initialise on the device: no host round trip
        model = LlamaForCausalLM(cfg)
    return model.to(dtype=dtype).eval()


class PrefixWorker:
    """Prefill with prefix reuse through one kvtier namespace (kvtier.kvcache's helpers)."""

    def __init__(self, client: kvtier.Client, model: Any, namespace: str,
                 tokens_per_block: int = 16, revision: str = "random-seed-0") -> None:
        self.model = model
        self.layout = BlockLayout.from_model(model, tokens_per_block)
        self.ns = client.namespace(namespace, block_bytes=self.layout.block_bytes,
                                   layout=self.layout.as_layout())
        # The namespace names the model here; a real worker gives its hub id and commit.
        self.salt = model_salt(namespace, revision)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, cache: Any = None) -> tuple[torch.Tensor, Any]:
        # transformers 5 takes the cache as `cache`; earlier releases as `past_key_values`
        # (and silently ignore an unknown keyword, which would drop the prefix).
        import inspect
        kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters \
            else "past_key_values"
        out = self.model(ids, use_cache=True, **({kw: cache} if cache is not None else {}))
        # transformers 5 names the returned cache `cache`; older releases `past_key_values`.
        return out.logits[0, -1], out["cache"] if "cache" in out else out["past_key_values"]

    def recompute(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor([token_ids], device=self.model.device)
        return self.forward(ids)[0]

    def prefill(self, token_ids: list[int], store: bool = True) -> tuple[torch.Tensor, dict]:
        """Next-token logits for the prompt, reusing cached prefix blocks. Returns (logits,
        stats: reused_blocks, reused_tokens, stored_blocks)."""
        prefix = load_prefix(self.ns, self.layout, self.model.config, token_ids, self.salt,
                             device=self.model.device)
        ids = torch.tensor([token_ids[prefix.tokens:]], device=self.model.device)
        logits, cache = self.forward(ids, prefix.cache)
        stored = 0
        if store:
            stored = store_blocks(self.ns, self.layout, cache, token_ids, self.salt,
                                  first_block=prefix.blocks)
        return logits, {"reused_blocks": prefix.blocks, "reused_tokens": prefix.tokens,
                        "stored_blocks": stored}


def _ms(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1000


def check(args: argparse.Namespace) -> dict[str, Any]:
    svc = None
    sock = args.socket
    if not sock:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from tests.service import Service
        svc = Service(tempfile.mkdtemp(prefix="kvtier-hf-") + "/svc", admin=False,
                      host_capacity="2GiB", nvme_capacity="8GiB").start()
        sock = str(svc.socket)
    try:
        dtype = getattr(torch, args.dtype)
        model = build_model(layers=args.layers, hidden=args.hidden, heads=args.heads,
                            kv_heads=args.kv_heads, dtype=dtype, device=args.device)
        rng = np.random.default_rng(1)
        prompt = rng.integers(0, 1000, args.prompt_tokens).tolist()
        with kvtier.Client(sock, timeout=300) as c:
            worker = PrefixWorker(c, model, f"hf-check/{args.layers}x{args.hidden}/{args.dtype}")
            worker.prefill(prompt[: args.cached_tokens])           # an earlier prompt
            full, ttft_full = _ms(lambda: worker.recompute(prompt))
            full, ttft_full = _ms(lambda: worker.recompute(prompt))   # warm
            (reused, stats), ttft_reuse = _ms(lambda: worker.prefill(prompt, store=False))
        diff = float((full.float() - reused.float()).abs().max())
        return {"prompt_tokens": args.prompt_tokens, "cached_tokens": args.cached_tokens,
                "reused_blocks": stats["reused_blocks"], "max_abs_diff": diff,
                "ttft_recompute_ms": round(ttft_full, 2), "ttft_reuse_ms": round(ttft_reuse, 2),
                "speedup": round(ttft_full / ttft_reuse, 2), "dtype": args.dtype,
                "device": args.device, "layers": args.layers, "hidden": args.hidden}
    finally:
        if svc is not None:
            svc.stop()


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    """TTFT of recompute vs reuse from the host tier vs reuse from NVMe (after a restart),
    for each prompt length; the cached prefix is the prompt less --tail tokens."""
    from tests.service import Service
    svc = Service(tempfile.mkdtemp(prefix="kvtier-hf-") + "/svc", admin=False,
                  host_capacity=args.host_capacity, nvme_capacity="48GiB").start()
    dtype = getattr(torch, args.dtype)
    model = build_model(layers=args.layers, hidden=args.hidden, heads=args.heads,
                        kv_heads=args.kv_heads, dtype=dtype, device=args.device, vocab=32000)
    rows = []
    try:
        for length in args.lengths:
            prompt = np.random.default_rng(length).integers(0, 32000, length).tolist()
            name = f"hf-sweep/{length}"
            with kvtier.Client(svc.socket, timeout=600) as c:
                w = PrefixWorker(c, model, name)
                w.prefill(prompt[: length - args.tail])
                full, t_full = _ms(lambda: w.recompute(prompt))
                full, t_full = _ms(lambda: w.recompute(prompt))
                (host_logits, st), t_host = _ms(lambda: w.prefill(prompt, store=False))
                (host_logits, st), t_host = _ms(lambda: w.prefill(prompt, store=False))
            svc.stop()
            svc.start()                          # host tier empty: the prefix is on NVMe
            with kvtier.Client(svc.socket, timeout=600) as c:
                w = PrefixWorker(c, model, name)
                if args.device == "cuda":
                    w.ns._gpu()                  # map and pin the segment before timing
                (nvme_logits, st2), t_nvme = _ms(lambda: w.prefill(prompt, store=False))
            rows.append({"prompt_tokens": length, "reused_blocks": st["reused_blocks"],
                         "ttft_recompute_ms": round(t_full, 1),
                         "ttft_reuse_host_ms": round(t_host, 1),
                         "ttft_reuse_nvme_ms": round(t_nvme, 1),
                         "max_abs_diff_host": float((full.float() - host_logits.float())
                                                    .abs().max()),
                         "max_abs_diff_nvme": float((full.float() - nvme_logits.float())
                                                    .abs().max())})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        svc.stop()
    return {"dtype": args.dtype, "device": args.device, "layers": args.layers,
            "hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads,
            "tail_tokens": args.tail, "rows": rows}


def main() -> None:
    import faulthandler
    faulthandler.enable()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--sweep", action="store_true",
                    help="TTFT table: recompute vs reuse from host vs from NVMe")
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--tail", type=int, default=512)
    ap.add_argument("--host-capacity", default="8GiB")
    ap.add_argument("--socket", default="")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--cached-tokens", type=int, default=3584)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not (args.check or args.sweep):
        ap.error("give --check or --sweep")
    res = sweep(args) if args.sweep else check(args)
    print(json.dumps(res) if args.json else "\n".join(f"{k}: {v}" for k, v in res.items()))


if __name__ == "__main__":
    main()
