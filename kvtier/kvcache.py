"""Mapping between a transformers model's KV cache and kvtier blocks (client side).

One kvtier block is one engine page: ``tokens_per_block`` tokens of every layer's keys and
values. Its bytes are laid out as [layer][K, V][kv head][token][head dim] in the model's
dtype, and the layout travels as the namespace's metadata, so any worker can read another's
blocks. Keys are chained hashes: block i's key is xxh3-128 of block i-1's key and block i's
token ids, seeded by a salt that names the model and its revision, so a key names the whole
prefix up to and including its block, and two prompts share keys exactly as long as they share
tokens (and the weights).

A worker's two steps, each one call:

    layout = BlockLayout.from_model(model, 16)
    salt = model_salt("my-org/my-model", revision="abc123")
    prefix = load_prefix(ns, layout, model.config, token_ids, salt)     # match, get, rebuild
    out = model(ids[:, prefix.tokens:], cache=prefix.cache, use_cache=True)
    store_blocks(ns, layout, out.cache, token_ids, salt, first_block=prefix.blocks)

Models. Layers of type ``full_attention`` and ``sliding_attention`` are supported; the cache
the helpers build (``new_cache``) keeps every token of every layer, also for sliding-window
layers (the model's attention mask applies the window), since transformers' own sliding layers
keep only the last window-1 tokens and such a cache cannot fill whole blocks. Other layer types
(linear attention, convolutions, KV sharing) and RoPE whose frequencies depend on the sequence
length (``dynamic``, ``longrope``: a stored key would differ from the recomputed one) are
refused with an error naming them (``check_model``).

The partial last page. The last ``len % tokens_per_block`` tokens go in a page of their own
under a key of those tokens (``partial_key``), so that the key still names exactly its bytes;
as the page fills, the fuller page is put under its new key and the emptier ones are deleted.
``load_prefix`` takes the fullest partial page that matches the prompt's tokens.

What reuse reproduces bit for bit, and what not, is in the README ("Reuse and the logits").

torch and transformers are imported lazily: the service never needs them. Functions work on
CPU tensors; the GPU data path moves the same bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import xxhash

from kvtier.errors import BadRequest

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
# RoPE types whose frequencies transformers recomputes from the current sequence length
# (modeling_rope_utils.dynamic_rope_update): a key stored at one length is not the key
# recompute makes at another (max logit difference 0.2-1.1, greedy tokens diverged; issue 19).
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True, slots=True)
class BlockLayout:
    layers: int
    kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: str

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
    def from_config(cls, config: Any, tokens_per_block: int, dtype: str) -> "BlockLayout":
        """From a transformers config and the dtype the model runs in (its KV cache's dtype;
        ``from_model`` reads it from the model). Refuses models check_model refuses."""
        cfg = check_model(config)
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(cfg.num_hidden_layers, kv, head_dim, tokens_per_block, dtype)

    @classmethod
    def from_model(cls, model: Any, tokens_per_block: int = 16) -> "BlockLayout":
        """From a loaded transformers model: its config and the dtype of its weights."""
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        return cls.from_config(model.config, tokens_per_block, dtype)

    def torch_dtype(self) -> Any:
        import torch
        return getattr(torch, self.dtype)


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def layer_types(config: Any) -> list[str]:
    """Each decoder layer's attention type, as transformers' caches infer it."""
    cfg = _text_config(config)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        kind = ("sliding_attention" if getattr(cfg, "sliding_window", None) is not None
                else "chunked_attention" if getattr(cfg, "attention_chunk_size", None) is not None
                else "full_attention")
        types = [kind] * cfg.num_hidden_layers
    sharing = getattr(cfg, "kv_sharing_modes", None) or ()
    return [f"{t} (KV shared with another layer)" if mode == "reuse" else t
            for t, mode in zip(types, list(sharing) + [None] * len(types))]


def check_model(config: Any) -> Any:
    """The decoder config, if kvtier.kvcache can store this model's KV; else BadRequest naming
    what it cannot (see the module docstring)."""
    cfg = _text_config(config)
    bad = sorted({t for t in layer_types(cfg) if t not in SUPPORTED_LAYER_TYPES})
    if bad:
        raise BadRequest(f"{type(cfg).__name__} has layers of type {', '.join(bad)}: "
                         "kvtier.kvcache stores the KV of full_attention and "
                         "sliding_attention layers only")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    ropes = rope.values() if all(isinstance(v, dict) for v in rope.values()) and rope else [rope]
    for r in ropes:
        kind = r.get("rope_type", r.get("type", "default"))
        if kind in LENGTH_DEPENDENT_ROPE:
            raise BadRequest(f"{type(cfg).__name__} uses {kind!r} RoPE, whose frequencies "
                             "change with the sequence length: stored keys would not be the "
                             "ones recompute makes, so its KV cannot be reused")
    return cfg


def model_salt(model: str, revision: str) -> bytes:
    """The salt of chain_keys for a model: its name (or path) and the revision of its weights,
    so that two models, or two revisions of one, that share a tokenizer never share keys."""
    if not isinstance(model, str) or not model or not isinstance(revision, str) or not revision:
        raise BadRequest("model_salt needs the model's name and the revision of its weights "
                         f"(non-empty strings), not {model!r} and {revision!r}")
    return f"model={model}\0revision={revision}".encode()


def _token_array(token_ids: Any) -> np.ndarray:
    """token_ids as int64, or BadRequest: a 1-D sequence of integers (a float would be
    truncated silently by numpy, and two prompts would share keys they should not)."""
    try:
        arr = np.asarray(token_ids)
    except (ValueError, TypeError) as exc:
        raise BadRequest(f"token_ids must be a 1-D sequence of integers: {exc}") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise BadRequest(f"token_ids must be a 1-D sequence of integers, not an array of "
                         f"shape {arr.shape} and dtype {arr.dtype}")
    return arr.astype(np.int64)


def _root(salt: bytes) -> bytes:
    if not isinstance(salt, (bytes, bytearray)) or not salt:
        raise BadRequest("give a salt that names the model and its weights' revision, e.g. "
                         "kvtier.kvcache.model_salt(name, revision); without one, two models "
                         "that share a tokenizer would read each other's blocks")
    return xxhash.xxh3_128_digest(b"kvtier-chain-v1" + bytes(salt))


def _nonzero(key: bytes) -> bytes:
    """The all-zero key is reserved (no parent); 2^-128 odds."""
    return xxhash.xxh3_128_digest(key + b"\x01") if key == bytes(16) else key


def chain_keys(token_ids: Sequence[int] | np.ndarray, tokens_per_block: int,
               salt: bytes) -> list[bytes]:
    """16-byte keys of the full blocks of a prompt. ``salt``: see model_salt (required)."""
    if not isinstance(tokens_per_block, int) or tokens_per_block <= 0:
        raise BadRequest(f"tokens_per_block must be a positive integer, not {tokens_per_block!r}")
    ids = _token_array(token_ids)
    out = []
    prev = _root(salt)
    for b in range(ids.size // tokens_per_block):
        chunk = ids[b * tokens_per_block:(b + 1) * tokens_per_block].astype("<i8").tobytes()
        prev = _nonzero(xxhash.xxh3_128_digest(prev + chunk))
        out.append(prev)
    return out


def partial_key(parent: bytes | None, token_ids: Sequence[int] | np.ndarray,
                salt: bytes) -> bytes:
    """The key of a partly filled page holding token_ids (fewer than a block's) after the
    full block whose key is parent (None: at the start). Hashed with a marker that makes the
    input's length differ from any full block's, so it is never a full block's key."""
    prev = parent if parent is not None else _root(salt)
    ids = _token_array(token_ids).astype("<i8").tobytes()
    return _nonzero(xxhash.xxh3_128_digest(prev + b"partial" + ids))


def parents_of(keys: Sequence[bytes], first_parent: bytes | None = None) -> bytes:
    """The packed parent buffer for a chain: keys[i-1] for i > 0, first_parent (or none)."""
    return (first_parent or bytes(16)) + b"".join(keys[:-1])


def cache_to_blocks(layer_kv: Sequence[tuple[Any, Any]], layout: BlockLayout, first_block: int,
                    n_blocks: int, device: Any = "cpu") -> Any:
    """Blocks [first_block, first_block + n_blocks) of a cache given as per-layer (K, V)
    tensors of shape [1, kv_heads, tokens, head_dim]; a last block past the cache's tokens is
    a partial page (its missing tokens are zeros). Returns a uint8 tensor (n_blocks,
    block_bytes) on ``device`` (a CUDA tensor goes to kvtier by one launch)."""
    import torch
    t = layout.tokens_per_block
    lo, hi = first_block * t, (first_block + n_blocks) * t
    if len(layer_kv) != layout.layers:
        raise BadRequest(f"the cache has {len(layer_kv)} layers, the layout {layout.layers}")
    per_layer = []
    for i, (k, v) in enumerate(layer_kv):
        want = (1, layout.kv_heads, k.shape[2], layout.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise BadRequest(f"layer {i}: K {tuple(k.shape)} and V {tuple(v.shape)}, expected "
                             f"{want} (a batch of one sequence, in the layout's geometry)")
        if k.dtype != layout.torch_dtype():
            raise BadRequest(f"layer {i}'s KV is {k.dtype}, the layout's dtype {layout.dtype}: "
                             "make the layout with BlockLayout.from_model")
        if k.shape[2] <= lo or k.shape[2] < hi - t + 1:
            raise BadRequest(f"layer {i} holds {k.shape[2]} tokens: too few for blocks "
                             f"{first_block}..{first_block + n_blocks - 1}")
        kv = torch.stack([k[0, :, lo:hi], v[0, :, lo:hi]])          # [2, H, <=T, D]
        if kv.shape[2] < hi - lo:                                    # the partial page
            kv = torch.nn.functional.pad(kv, (0, 0, 0, hi - lo - kv.shape[2]))
        kv = kv.reshape(2, layout.kv_heads, n_blocks, t, layout.head_dim)
        per_layer.append(kv.permute(2, 0, 1, 3, 4))                   # [n, 2, H, t, D]
    blocks = torch.stack(per_layer, dim=1).to(device=device).contiguous()  # [n, L, 2, H, t, D]
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


def new_cache(config: Any) -> Any:
    """An empty transformers DynamicCache that keeps every token of every layer (also of
    sliding-window layers, whose window the model's attention mask applies). Run prefill
    with it (``cache=new_cache(config)``) when its blocks are to be stored."""
    from transformers import DynamicCache
    check_model(config)
    return DynamicCache()        # without a config, every layer is a full-length DynamicLayer


def to_dynamic_cache(layer_kv: Sequence[tuple[Any, Any]], config: Any) -> Any:
    """A full-length DynamicCache (new_cache) holding the given per-layer keys and values."""
    cache = new_cache(config)
    for i, (k, v) in enumerate(layer_kv):
        cache.update(k, v, i)
    return cache


def from_dynamic_cache(cache: Any) -> list[tuple[Any, Any]]:
    """Per-layer (K, V) of a transformers DynamicCache (new layered API or the legacy one).
    Refuses a cache whose layers dropped tokens (transformers' sliding-window layers)."""
    if not hasattr(cache, "layers"):
        return [(cache.key_cache[i], cache.value_cache[i]) for i in range(len(cache.key_cache))]
    for i, layer in enumerate(cache.layers):
        window = getattr(layer, "sliding_window", None)
        if window is not None:
            raise BadRequest(f"layer {i} of the cache is a {type(layer).__name__}: it keeps "
                             f"only the last {window - 1} tokens, so it cannot fill blocks; run "
                             "the forward pass with cache=kvtier.kvcache.new_cache(config)")
    return [(layer.keys, layer.values) for layer in cache.layers]


@dataclass(slots=True)
class Prefix:
    """What load_prefix found: ``tokens`` leading tokens are in ``cache`` (a new_cache, empty
    when nothing was found), from ``blocks`` full blocks and then ``partial`` tokens of a
    partial page (the last one cut by a token where the prompt ends in it: one token is
    always left to run). Run the model on token_ids[tokens:]; store from block ``blocks``."""
    tokens: int
    blocks: int
    partial: int
    cache: Any


def load_prefix(ns: Any, layout: BlockLayout, config: Any, token_ids: Sequence[int],
                salt: bytes, device: Any = "cpu", partial: bool = True) -> Prefix:
    """The longest cached prefix of token_ids, as a cache to run the rest on, leaving at least
    one token to run (the next-token logits come from the last position: a prompt that is
    all cached reuses all but its last token). One match_prefix and one get: only the leading
    run of found blocks is used (a block can be evicted between the two calls), then the
    fullest partial page that follows it, if every block before that page was found
    (partial=False: whole blocks only, so that the forward that follows begins on a block
    boundary; README "Reuse and the logits" says when that matters)."""
    import torch
    t = layout.tokens_per_block
    ids = _token_array(token_ids)
    keys = chain_keys(ids, t, salt)
    if ids.size < 2:                                 # nothing to reuse before the last token
        return Prefix(0, 0, 0, new_cache(config))
    n = ns.match_prefix(b"".join(keys)) if keys else 0
    tail = ids[n * t:min(n * t + t - 1, ids.size)] if partial else ids[:0]
    candidates = [partial_key(keys[n - 1] if n else None, tail[:k], salt)
                  for k in range(1, tail.size + 1)]
    if n == 0 and not candidates:
        return Prefix(0, 0, 0, new_cache(config))
    want = b"".join(keys[:n] + candidates)
    if torch.device(device).type == "cuda":
        data = torch.empty((n + len(candidates), layout.block_bytes), dtype=torch.uint8,
                           device=device)
        found, _ = ns.get(want, out=data)
    else:
        found, data = ns.get(want)
        data = torch.from_numpy(data)
    full = found[:n]
    n = int(np.argmin(full)) if not full.all() else n
    hits = np.flatnonzero(found[len(full):]) if n == len(full) else []
    page = int(hits[-1]) + 1 if len(hits) else 0           # tokens of the partial page
    rows = list(range(n)) + ([len(full) + page - 1] if page else [])
    if not rows:
        return Prefix(0, 0, 0, new_cache(config))
    tokens = min(n * t + page, ids.size - 1)
    kv = blocks_to_layer_kv(data[rows], layout, device=device)
    kv = [(k[:, :, :tokens], v[:, :, :tokens]) for k, v in kv]
    return Prefix(tokens, n, max(0, tokens - n * t), to_dynamic_cache(kv, config))


def store_blocks(ns: Any, layout: BlockLayout, cache: Any, token_ids: Sequence[int],
                 salt: bytes, first_block: int = 0, partial: bool = True) -> int:
    """Put the blocks of token_ids from first_block on, from a cache that holds all of
    token_ids (a new_cache the model ran with), each with its parent; with partial, also the
    partly filled last page, replacing the emptier pages of the same prefix. Returns how many
    blocks were put."""
    t = layout.tokens_per_block
    ids = _token_array(token_ids)
    layer_kv = from_dynamic_cache(cache)
    if layer_kv and layer_kv[0][0].shape[2] != ids.size:
        raise BadRequest(f"the cache holds {layer_kv[0][0].shape[2]} tokens and token_ids "
                         f"{ids.size}: store the tokens the cache was run on")
    keys = chain_keys(ids, t, salt)
    rest = ids[len(keys) * t:] if partial else ids[:0]
    new = keys[first_block:]
    if rest.size:
        new = new + [partial_key(keys[-1] if keys else None, rest, salt)]
    if not new:
        return 0
    blocks = cache_to_blocks(layer_kv, layout, first_block, len(new))
    ns.put(b"".join(new), blocks,
           parents=parents_of(new, keys[first_block - 1] if first_block else None))
    if rest.size > 1:
        ns.delete(b"".join(partial_key(keys[-1] if keys else None, rest[:k], salt)
                           for k in range(1, rest.size)))
    return len(new)
