"""What a namespace handle holds on the worker's side, shared by the sync and async clients:
the mapped segment, the decoded get reply, the copy out of leased slots and the Lease.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from kvtier.api.buffers import checksums
from kvtier.api.segment import SegmentMap
from kvtier.errors import ChecksumError

if TYPE_CHECKING:
    from kvtier.api.client import Namespace


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """A match_prefix answer: n leading keys held, ``below`` of them neither in HBM nor in
    host memory (on NVMe or Redis only)."""

    n: int
    below: int


@dataclass(slots=True)
class GetReply:
    found: np.ndarray
    slots: np.ndarray
    versions: np.ndarray
    checksums: np.ndarray
    lease: int

    @classmethod
    def decode(cls, r: dict[str, Any]) -> "GetReply":
        return cls(np.frombuffer(r["found"], np.uint8).astype(bool),
                   np.frombuffer(r["slots"], "<i4"), np.frombuffer(r["versions"], "<u8"),
                   np.frombuffer(r["checksums"], "<u8"), int(r["lease"]))


def copy_out(view: np.ndarray, rep: GetReply, out: np.ndarray, verify: bool) -> None:
    """Copy leased slots into out's rows (zero where missing); verify checksums if asked."""
    n = rep.found.size
    if n == 1 and rep.found[0]:
        # A single block, the latency case: a dozen numpy calls fewer than the batch path.
        out[0] = view[int(rep.slots[0])]
        if verify and xxhash.xxh3_64_intdigest(out[0]) != int(rep.checksums[0]):
            raise ChecksumError("1 block did not match its checksum after the copy out of "
                                "shared memory (a writer outside kvtier's protocol?)")
        return
    idx = np.flatnonzero(rep.found)
    if idx.size == n and n and rep.slots[-1] - rep.slots[0] == n - 1 and (
            n == 1 or (np.diff(rep.slots) == 1).all()):
        # Consecutive slots (a batch put together): one straight copy, no gather.
        np.copyto(out, view[rep.slots[0]: rep.slots[0] + n])
    elif idx.size == n:
        np.take(view, rep.slots.astype(np.intp), axis=0, out=out)
    else:
        out[~rep.found] = 0
        out[idx] = view[rep.slots[idx]]
    if verify and idx.size:
        got = checksums(out) if idx.size == n else checksums(out[idx])   # no gather copy
        bad = np.flatnonzero(got != rep.checksums[idx])
        if bad.size:
            raise ChecksumError(f"{bad.size} blocks did not match their checksum after the copy "
                                "out of shared memory (a writer outside kvtier's protocol?)")


class Lease:
    """Blocks held in shared memory. views[i] is a read-only array of block i (found ones)."""

    def __init__(self, ns: "Namespace", rep: GetReply) -> None:
        self._ns = ns
        self.found = rep.found
        self.versions = rep.versions
        self.checksums = rep.checksums
        self.lease_id = rep.lease
        view = ns._view()
        self.views = [view[s] if f else None for s, f in zip(rep.slots.tolist(),
                                                            rep.found.tolist())]
        for v in self.views:
            if v is not None:
                v.flags.writeable = False

    def release(self) -> None:
        if self.lease_id:
            self._ns._client._call("release", lease=self.lease_id)
            self.lease_id = 0
            self.views = []

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class NamespaceHandle:
    """What the sync and async namespace handles share: the layout and the mapped segment."""

    def __init__(self, client: Any, info: dict[str, Any], inline: bool) -> None:
        self._client = client
        self.name: str = info["name"]
        self.block_bytes: int = info["block_bytes"]
        self.key_width: int = info["key_width"]
        self.layout: dict[str, Any] = info.get("layout") or {}
        self.inline = inline
        self._seg: SegmentMap | None = None
        self._arr: np.ndarray | None = None
        self._mapped: Any = None           # kvtier.gpu.slots.MappedSegment, on first CUDA use
        self._ipc: Any = None              # kvtier.gpu.slots.IpcPool: the service's HBM pools
        self._inflight: list[Any] = []     # kvtier.gpu.transfer.Transfer not yet finished
        self._whole_skip = 0               # gets left in chunks after a sparse whole one
        self._hbm_info: dict[str, Any] | None = None
        self._generation = -1
        self._credits: Any = None          # kvtier.api.credits.Credits, on the first GPU put

    def _stale(self) -> bool:
        """True when there is no mapping yet, or it belongs to an earlier connection."""
        return self._arr is None or self._generation != self._client.generation

    def _attach(self, size: int, fd: int) -> np.ndarray:
        """Map the namespace's segment from fd (which the mapping then owns): read-only, with
        write windows for reserved slots (kvtier.api.segment)."""
        self.close()
        try:
            self._seg = SegmentMap(fd, size, self.block_bytes)
        except BaseException:
            os.close(fd)
            raise
        self._arr = self._seg.view
        self._generation = self._client.generation
        return self._arr

    def _write(self, slots: np.ndarray, src: np.ndarray) -> None:
        """Copy src into the reserved slots, through the segment's write windows."""
        self._seg.write(slots, src)

    def close(self) -> None:
        if self._inflight:               # no copy may run into memory about to be unregistered
            from kvtier.gpu.transfer import drain
            drain(self)
        if self._credits is not None:
            # wait: a put's completion asks for the next credit (PutTransfer._complete), so
            # one asked is often in flight here; read its reply now and give it back, or it
            # stays reserved, pinned and in the connection's share until reserve_timeout.
            self._credits.drop(wait=True)
        for dev in (self._mapped, self._ipc):
            if dev is not None:
                dev.close()
        self._mapped = self._ipc = None
        self._arr = None
        if self._seg is not None:
            self._seg.close()
            self._seg = None
