"""How a batch of blocks lies in the caller's memory, for ``Namespace.get(out=...)`` and ``put``.

A kvtier block is ``block_bytes`` opaque bytes. An engine's KV cache keeps those bytes in one of
two shapes, and the client moves both without a staging copy:

- **Rows** (vLLM's block-outermost BLHNC, or any buffer of whole blocks): block b is row b of one
  contiguous buffer. A plain tensor or array passed as ``out``/``blocks`` means this; ``rows[i]``
  names the row of key i.
- **Pages** (vLLM's per-layer tensors, LBHNC / LBNHC, K and V split or not): block b is the
  concatenation, in order, of P pages, page p of block b being ``Pages.views[p][b]``. Each view is
  a 2-D ``(num_blocks, page_bytes[p])`` uint8 view (numpy or torch; CPU or CUDA; rows may be
  strided, each row is contiguous), so page p of every block sits at ``base[p] + b * stride[p]``.
  ``sum(page_bytes) == block_bytes``. ``rows[i]`` names the engine block id of key i.

The bytes are the engine's, in its own order (vLLM's CPU backend, for instance, stores keys
transposed): kvtier never interprets them, so a namespace must name the layout it holds
(DESIGN.md, "Inside an inference engine") and a reader with another layout is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvtier.errors import BadRequest


def _page_view(t: Any, block_dim: int) -> Any:
    """t (numpy or torch) as a (t.shape[block_dim], page_bytes) uint8 view, no copy.

    Every dimension after block_dim must be contiguous (a page is one run of bytes); the ones
    before it are split off into separate pages by ``Pages.from_layers``.
    """
    mod = type(t).__module__
    if mod.startswith("torch"):
        import torch
        if t.dim() < 2:
            raise BadRequest("a page tensor needs a block dimension and a page")
        exp = 1
        for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
            if size != 1 and stride != exp:
                raise BadRequest("each page must be one contiguous run of bytes: the dimensions "
                                 "after the block dimension must be contiguous")
            exp *= size
        flat = t.reshape(t.shape[0], -1)         # a view: the inner dimensions are contiguous
        return flat.view(torch.uint8) if t.dtype != torch.uint8 else flat
    import numpy as np
    a = np.asarray(t)
    u8 = a.view(np.uint8) if a.dtype != np.uint8 else a
    inner = u8[0] if u8.shape[0] else u8.reshape(u8.shape[1:])
    if not inner.flags.c_contiguous:
        raise BadRequest("each page must be one contiguous run of bytes: the dimensions after "
                         "the block dimension must be contiguous")
    return u8.reshape(u8.shape[0], -1)


@dataclass(frozen=True, slots=True)
class Pages:
    """Blocks as P pages in P places (see the module docstring). Build with ``from_layers``."""

    views: tuple[Any, ...]

    def __post_init__(self) -> None:
        if not self.views:
            raise BadRequest("Pages needs at least one page view")
        nb = {int(v.shape[0]) for v in self.views}
        if len(nb) != 1:
            raise BadRequest(f"every page view must cover the same blocks, got counts {sorted(nb)}")
        for v in self.views:
            if len(v.shape) != 2:
                raise BadRequest("a page view is 2-D: (num_blocks, page_bytes)")

    @property
    def num_blocks(self) -> int:
        return int(self.views[0].shape[0])

    @property
    def page_bytes(self) -> tuple[int, ...]:
        return tuple(int(v.shape[1]) for v in self.views)

    @property
    def block_bytes(self) -> int:
        return sum(self.page_bytes)

    @property
    def is_cuda(self) -> bool:
        return bool(getattr(self.views[0], "is_cuda", False))

    @classmethod
    def from_layers(cls, tensors: Sequence[Any], block_dim: int = 0) -> "Pages":
        """One page per layer and per index of the dimensions before block_dim.

        vLLM's per-layer caches: ``(num_blocks, ...)`` is block_dim=0 (one page per layer);
        ``(2, num_blocks, ...)`` with K and V apart is block_dim=1 (two pages per layer, K then
        V). Pages are ordered layer by layer, then by the leading indices.
        """
        views: list[Any] = []
        for t in tensors:
            lead = tuple(t.shape[:block_dim])
            for idx in _indices(lead):
                views.append(_page_view(t[idx] if idx else t, 0))
        return cls(tuple(views))


def _indices(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in shape:
        out = [i + (j,) for i in out for j in range(n)]
    return out
