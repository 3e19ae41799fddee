"""Host-side moves between a namespace's slots and an engine's own blocks, without staging.

``Namespace.get(out=..., rows=...)`` and ``put(blocks, rows=...)`` with host memory (numpy
arrays, CPU torch tensors) name where each key's block lives in the caller's memory:

- a row buffer (any array or tensor of ``num_rows x block_bytes`` bytes): key i is row rows[i];
- a ``kvtier.api.layouts.Pages`` (vLLM's per-layer KV tensors): key i is engine block rows[i],
  made of one page in each view.

A move is cut into runs where both the engine rows and the slots are consecutive (a prefill's
blocks are allocated together, a batch put takes a run of slots), and each run of each page is
one strided numpy copy between the caller's memory and the mapped segment: no intermediate
buffer, and ``P x runs`` copy calls per batch. Only when the runs are short (scattered rows or
slots, fewer than ~4 blocks a run) does it switch to one fancy-indexed copy per page, which
numpy makes through a temporary: fewer Python calls win there.

Thread safety: none needed; the caller's buffers are read or written by the calling thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.api import pipeline
from kvtier.api import protocol as P
from kvtier.api.buffers import as_u8, pack_keys
from kvtier.api.layouts import Pages
from kvtier.checksums import block_checksums
from kvtier.errors import BadRequest, ChecksumError

if TYPE_CHECKING:
    from kvtier.api.client import GetReply, Namespace

_SHORT_RUN = 4          # mean blocks per run below which one fancy copy per page is cheaper


def _numpy_u8(view: Any) -> np.ndarray:
    """A 2-D uint8 page view (numpy or CPU torch) as numpy, sharing memory."""
    if type(view).__module__.startswith("torch"):
        if view.device.type != "cpu":
            raise BadRequest("these pages are on a CUDA device; the host path takes CPU ones")
        return view.detach().numpy()
    return np.asarray(view)


@dataclass(frozen=True, slots=True)
class HostBlocks:
    """Where blocks lie in host memory: parts[p] = (view (num_blocks, nbytes), offset of the
    part inside a kvtier block). A row buffer is one part at offset 0."""

    parts: tuple[tuple[np.ndarray, int], ...]
    num_blocks: int

    @classmethod
    def of(cls, obj: Any, block_bytes: int, writable: bool) -> "HostBlocks":
        if isinstance(obj, Pages):
            if obj.block_bytes != block_bytes:
                raise BadRequest(f"these pages make blocks of {obj.block_bytes} bytes; the "
                                 f"namespace's blocks are {block_bytes}: open the namespace "
                                 "that matches this KV layout")
            parts, off = [], 0
            for v in obj.views:
                a = _numpy_u8(v)
                if writable and not a.flags.writeable:
                    raise BadRequest("a page view is read-only; pass writable KV tensors")
                parts.append((a, off))
                off += a.shape[1]
            return cls(tuple(parts), obj.num_blocks)
        if writable and not (obj.is_contiguous() if type(obj).__module__.startswith("torch")
                             else isinstance(obj, np.ndarray) and obj.flags.c_contiguous):
            # A copy would be filled instead of the caller's memory.
            raise BadRequest("the output is not one contiguous array or tensor; rows= needs "
                             "a contiguous buffer (or a Pages for strided KV layouts)")
        arr = as_u8(obj)
        if arr.size % block_bytes or not arr.size:
            raise BadRequest(f"a buffer of {arr.size} bytes is not whole blocks of "
                             f"{block_bytes} bytes")
        if writable and not arr.flags.writeable:
            raise BadRequest("the output buffer is read-only; pass a writable array or tensor")
        return cls(((arr.reshape(-1, block_bytes), 0),), arr.size // block_bytes)

    def rows(self, rows: Any, n: int) -> np.ndarray:
        """rows as int64 engine block ids, one per key, each inside this buffer."""
        if rows is None:
            if n > self.num_blocks:
                raise BadRequest(f"{n} keys for a buffer of {self.num_blocks} blocks")
            return np.arange(n, dtype=np.int64)
        try:
            r = np.asarray(rows)
        except (TypeError, ValueError):
            raise BadRequest("rows must be a sequence of block ids") from None
        if r.ndim != 1 or r.size != n or (r.size and r.dtype.kind not in "iu"):
            raise BadRequest(f"rows must be {n} integer block ids, one per key")
        r = r.astype(np.int64, copy=False)
        if r.size and (r.min() < 0 or r.max() >= self.num_blocks):
            raise BadRequest(f"a row is outside 0..{self.num_blocks - 1}, the blocks of "
                             "this buffer")
        return r

    def load(self, rows: np.ndarray, src: np.ndarray, src_rows: np.ndarray) -> None:
        """self[rows[i]] = src[src_rows[i]] (src: (m, block_bytes), the mapped segment)."""
        for dst, off in self.parts:
            width = dst.shape[1]
            _move(dst, rows, src[:, off:off + width], src_rows)

    def store(self, rows: np.ndarray, dst: np.ndarray, dst_rows: np.ndarray) -> None:
        """dst[dst_rows[i]] = self[rows[i]] (dst: the writable segment view)."""
        for src, off in self.parts:
            width = src.shape[1]
            _move(dst[:, off:off + width], dst_rows, src, rows)

    def gather(self, rows: np.ndarray, block_bytes: int) -> np.ndarray:
        """The blocks at rows as one (n, block_bytes) array (for the inline data path)."""
        out = np.empty((rows.size, block_bytes), dtype=np.uint8)
        self.store(rows, out, np.arange(rows.size))
        return out


def _runs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Starts in a, starts in b and lengths of the runs where both a and b step by one."""
    breaks = np.flatnonzero((np.diff(a) != 1) | (np.diff(b) != 1)) + 1
    starts = np.r_[0, breaks]
    lengths = np.diff(np.r_[starts, a.size])
    return a[starts], b[starts], lengths


def _move(dst: np.ndarray, dst_rows: np.ndarray, src: np.ndarray, src_rows: np.ndarray) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for 2-D views of equal width."""
    if dst_rows.size == 0:
        return
    da, sa, ln = _runs(dst_rows, src_rows)
    if ln.size * _SHORT_RUN > dst_rows.size:
        dst[dst_rows] = src[src_rows]
        return
    for d, s, k in zip(da.tolist(), sa.tolist(), ln.tolist()):
        dst[d:d + k] = src[s:s + k]


def put(ns: "Namespace", kb: bytes, n: int, blocks: Any, parents: Any, rows: Any,
        verify: bool) -> np.ndarray:
    """Host blocks named by rows (a row buffer or a Pages), copied
    straight into the reserved slots. With verify the slots are hashed once written (the
    source blocks are not contiguous), so the commit still catches a torn write."""
    src = HostBlocks.of(blocks, ns.block_bytes, writable=False)
    idx = src.rows(rows, n)
    pb = None if parents is None else pack_keys(parents, ns.key_width)
    c = ns._client
    c._ensure()
    if ns.inline:              # bytes go in the frame anyway: gathered once for it
        return ns.put(kb, src.gather(idx, ns.block_bytes), parents=pb, verify=verify)
    view = ns._view()

    def write(slots: np.ndarray, lo: int, hi: int) -> bytes | None:
        with ns._seg.writable(slots) as seg:
            src.store(idx[lo:hi], seg, slots.astype(np.int64))
        return P.arr(block_checksums(view, slots), "<u8") if verify else None
    if len(pipeline.chunks(n)) > 1:
        return pipeline.put(ns, kb, n, pb, write)
    r = c._call("reserve", ns=ns.name, keys=kb, parents=pb)
    try:
        sums = write(np.frombuffer(r["slots"], "<i4"), 0, n)
    except BaseException:
        c._call("abort", rid=r["rid"])
        raise
    return np.frombuffer(c._call("commit", rid=r["rid"], checksums=sums)["versions"], "<u8")

def get(ns: "Namespace", kb: bytes, n: int, out: Any, rows: Any, verify: bool) -> np.ndarray:
    """Leased slots copied straight into host blocks named by rows (a row buffer or a
    Pages); missing keys leave their blocks untouched. verify re-hashes the leased slots
    (which cannot change while leased) rather than the scattered copy."""
    dst = HostBlocks.of(out, ns.block_bytes, writable=True)
    idx = dst.rows(rows, n)
    c = ns._client
    c._ensure()
    if ns.inline:
        found, data = ns.get(kb, verify=verify)
        hit = np.flatnonzero(found)
        dst.load(idx[hit], data, hit)
        return found
    view = ns._view()

    def move(rep: "GetReply", lo: int) -> None:
        hit = np.flatnonzero(rep.found)
        slots = rep.slots[hit].astype(np.int64)
        if verify and hit.size and (block_checksums(view, slots)
                                    != rep.checksums[hit]).any():
            raise ChecksumError("a leased block did not match its checksum (a writer "
                                "outside kvtier's protocol?)")
        dst.load(idx[lo + hit], view, slots)
    if len(pipeline.chunks(n)) > 1:
        return pipeline.get(ns, kb, n, move)
    from kvtier.api.client import GetReply
    rep = GetReply.decode(c._call("get", ns=ns.name, keys=kb))
    try:
        move(rep, 0)
    finally:
        c._release_later(rep.lease)
    return rep.found
