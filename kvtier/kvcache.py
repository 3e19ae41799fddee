"""Mapping between an inference engine's KV cache and kvtier blocks (client side).

One kvtier block is one engine page: ``tokens_per_block`` tokens of every layer's keys and
values. Its bytes are laid out as [layer][K, V][kv head][token][head dim] in the namespace's
dtype, and the layout travels as the namespace's metadata, so any worker can read another's
blocks. Keys are chained hashes: block i's key is xxh3-128 of block i-1's key and block i's
token ids, so a key names the whole prefix up to and including its block, and two prompts share
keys exactly as long as they share tokens.

torch (and transformers, for ``to_dynamic_cache``) are imported lazily: the service never needs
them. Functions work on CPU tensors; the GPU data path moves the same bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import xxhash

from kvtier.errors import BadRequest

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class BlockLayout:
    layers: int
    kv_heads: int
    head_dim: int
    tokens_per_block: int = 16
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in _ITEMSIZE:
            raise BadRequest(f"dtype {self.dtype!r}: use one of {', '.join(_ITEMSIZE)}")
        if min(self.layers, self.kv_heads, self.head_dim, self.tokens_per_block) <= 0:
            raise BadRequest("layers, kv_heads, head_dim and tokens_per_block must be positive")

    @property
    def block_bytes(self) -> int:
        return (self.layers * 2 * self.kv_heads * self.tokens_per_block * self.head_dim
                * _ITEMSIZE[self.dtype])

    def as_layout(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_layout(cls, layout: dict[str, Any]) -> "BlockLayout":
        try:
            return cls(**{k: layout[k] for k in ("layers", "kv_heads", "head_dim",
                                                 "tokens_per_block", "dtype")})
        except (KeyError, TypeError) as exc:
            raise BadRequest(f"namespace layout is not a KV block layout: {exc}") from None

    @classmethod
    def from_config(cls, config: Any, tokens_per_block: int = 16,
                    dtype: str = "float32") -> "BlockLayout":
        """From a transformers config (Llama-style attention)."""
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, kv, head_dim, tokens_per_block, dtype)

    def torch_dtype(self) -> Any:
        import torch
        return getattr(torch, self.dtype)


def chain_keys(token_ids: Sequence[int] | np.ndarray, tokens_per_block: int,
               salt: bytes = b"") -> list[bytes]:
    """16-byte keys of the full blocks of a prompt. ``salt`` separates models or adapters that
    would otherwise share token ids (put the namespace name or model revision in it)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    out = []
    prev = xxhash.xxh3_128_digest(b"kvtier-chain-v1" + salt)
    for b in range(ids.size // tokens_per_block):
        chunk = ids[b * tokens_per_block:(b + 1) * tokens_per_block].astype("<i8").tobytes()
        prev = xxhash.xxh3_128_digest(prev + chunk)
        if prev == bytes(16):            # the all-zero key is reserved; 2^-128 odds
            prev = xxhash.xxh3_128_digest(prev + b"\x01")
        out.append(prev)
    return out


def parents_of(keys: Sequence[bytes], first_parent: bytes | None = None) -> bytes:
    """The packed parent buffer for a chain: keys[i-1] for i > 0, first_parent (or none)."""
    return (first_parent or bytes(16)) + b"".join(keys[:-1])


def cache_to_blocks(layer_kv: Sequence[tuple[Any, Any]], layout: BlockLayout, first_block: int,
                    n_blocks: int, device: Any = "cpu") -> Any:
    """Blocks [first_block, first_block + n_blocks) of a cache given as per-layer (K, V)
    tensors of shape [1, kv_heads, tokens, head_dim]. Returns a uint8 tensor
    (n_blocks, block_bytes) on ``device`` (a CUDA tensor goes to kvtier by one launch)."""
    import torch
    t = layout.tokens_per_block
    lo, hi = first_block * t, (first_block + n_blocks) * t
    per_layer = []
    for k, v in layer_kv:
        if k.shape[0] != 1:
            raise BadRequest("cache_to_blocks takes a batch of one sequence")
        kv = torch.stack([k[0, :, lo:hi], v[0, :, lo:hi]])          # [2, H, T, D]
        kv = kv.reshape(2, layout.kv_heads, n_blocks, t, layout.head_dim)
        per_layer.append(kv.permute(2, 0, 1, 3, 4))                   # [n, 2, H, t, D]
    blocks = torch.stack(per_layer, dim=1)                            # [n, L, 2, H, t, D]
    blocks = blocks.to(device=device, dtype=layout.torch_dtype()).contiguous()
    return blocks.view(n_blocks, -1).view(torch.uint8)


def blocks_to_layer_kv(blocks: Any, layout: BlockLayout, device: Any = "cpu",
                       dtype: Any = None) -> list[tuple[Any, Any]]:
    """The inverse: per-layer (K, V) of shape [1, kv_heads, n * tokens_per_block, head_dim]."""
    import torch
    b = torch.as_tensor(blocks)
    if b.dtype != torch.uint8:
        b = b.view(torch.uint8)
    n = b.shape[0]
    if b.numel() != n * layout.block_bytes:
        raise BadRequest(f"{b.numel()} bytes for {n} blocks of {layout.block_bytes}")
    x = b.reshape(n, -1).view(layout.torch_dtype()).reshape(
        n, layout.layers, 2, layout.kv_heads, layout.tokens_per_block, layout.head_dim)
    x = x.permute(1, 2, 3, 0, 4, 5).reshape(
        layout.layers, 2, layout.kv_heads, n * layout.tokens_per_block, layout.head_dim)
    x = x.to(device=device, dtype=dtype or layout.torch_dtype())
    return [(x[i, 0][None].contiguous(), x[i, 1][None].contiguous())
            for i in range(layout.layers)]


def to_dynamic_cache(layer_kv: Sequence[tuple[Any, Any]], config: Any) -> Any:
    """A transformers DynamicCache holding the given per-layer keys and values."""
    from transformers import DynamicCache
    cache = DynamicCache(config=config)
    for i, (k, v) in enumerate(layer_kv):
        cache.update(k, v, i)
    return cache


def from_dynamic_cache(cache: Any) -> list[tuple[Any, Any]]:
    """Per-layer (K, V) of a transformers DynamicCache (new layered API or the legacy one)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(cache.key_cache[i], cache.value_cache[i]) for i in range(len(cache.key_cache))]
