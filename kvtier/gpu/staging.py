"""Pinned host buffers for a transfer's index arrays (ARENA) and their upload to the GPU on the
transfer's stream (Staging), kept until the transfer has completed.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from kvtier.gpu.copies import _H2D
from kvtier.gpu.streams import Stream

SLAB_BYTES = 1 << 20          # a transfer's first device allocation for its index uploads


class _Arena:
    """Pinned host buffers for staged indices, reused once the transfer that staged into them
    has completed (never earlier: its copies may still read them). Locked: the vLLM
    connector's background loads and the engine's stores stage from two threads, and an
    unlocked search-then-pop could hand one of them a smaller buffer than it found."""

    def __init__(self) -> None:
        self._free: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> tuple[int, int]:
        with self._lock:
            for i, (addr, cap) in enumerate(self._free):
                if cap >= nbytes:
                    return self._free.pop(i)
        import cupy
        cap = max(1 << 20, 1 << (nbytes - 1).bit_length())
        return cupy.cuda.runtime.hostAlloc(cap, 0), cap

    def give(self, bufs: list[tuple[int, int]]) -> None:
        with self._lock:
            self._free.extend(bufs)


ARENA = _Arena()

# Device slabs of finished transfers, per device, for the next transfer's uploads (cupy.empty
# of SLAB_BYTES was 10-20 us of a get's first chunk). Handed back by release() only, which
# runs once the transfer has completed (or, after a failure, once nothing of it can still run).
_slabs: dict[int, list[Any]] = {}
SLABS_KEPT = 8                # per device; more go back to cupy's pool


class Staging:
    """Index arrays of one transfer on their way to the GPU: written to pinned memory and copied
    on the transfer's stream (a pageable copy would block the host behind the stream's earlier
    work). Kept until the transfer has completed; release() then returns the pinned buffers."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self._bufs: list[tuple[int, int]] = []
        self._outs: list[tuple[int, int]] = []
        self._off = 0
        self._keep: list[Any] = []
        self._slab = self._slab_cap = self._slab_off = 0     # device memory for uploads
        self._slabs: list[tuple[int, Any]] = []              # (device, array) taken for them

    def _device_bytes(self, nbytes: int) -> int:
        """nbytes of device memory (256-byte aligned) cut from a slab of SLAB_BYTES: one
        allocation for a transfer's index uploads, not one per chunk (cupy.empty is ~10-20 us
        of the client's thread between a chunk's reply and its launch)."""
        import cupy
        nbytes = -(-nbytes // 256) * 256
        if self._slab_off + nbytes > self._slab_cap:
            device = cupy.cuda.runtime.getDevice()
            dev = None
            if nbytes <= SLAB_BYTES:
                try:
                    dev = _slabs.get(device, []).pop()    # one call: atomic across threads
                except IndexError:
                    pass
            if dev is None:
                dev = cupy.empty(max(SLAB_BYTES, nbytes) // 8, dtype=cupy.int64)
            self._slabs.append((device, dev))
            self._slab, self._slab_cap, self._slab_off = int(dev.data.ptr), dev.nbytes, 0
        addr = self._slab + self._slab_off
        self._slab_off += nbytes
        return addr

    def upload(self, a: np.ndarray, stream: Stream | None = None) -> int:
        """Device address of a copy of a (int64), valid on the stream (default: the
        transfer's) from now on."""
        import cupy
        a = np.ascontiguousarray(a, dtype=np.int64)
        nbytes = max(8, a.nbytes)
        if not self._bufs or self._off + nbytes > self._bufs[-1][1]:
            self._bufs.append(ARENA.take(nbytes))
            self._off = 0
        addr = self._bufs[-1][0] + self._off
        if a.size:
            ctypes.memmove(addr, a.ctypes.data, a.nbytes)
        dev = self._device_bytes(nbytes)
        cupy.cuda.runtime.memcpyAsync(dev, addr, nbytes, _H2D, (stream or self.stream).ptr)
        self._off += -(-nbytes // 256) * 256
        return dev

    def device(self, words: int) -> int:
        """Device address of words uninitialised int64 words, kept as long as the staging."""
        import cupy
        dev = cupy.empty(max(1, words), dtype=cupy.int64)
        self._keep.append(dev)
        return int(dev.data.ptr)

    def pinned(self, nbytes: int) -> int:
        """A pinned host buffer of nbytes of its own, kept as long as the staging."""
        buf = ARENA.take(nbytes)
        self._outs.append(buf)
        return buf[0]

    def keep(self, obj: Any) -> None:
        """Hold obj (device memory a launch reads) until release()."""
        self._keep.append(obj)

    def release(self) -> None:
        ARENA.give(self._bufs + self._outs)
        for device, dev in self._slabs:
            free = _slabs.setdefault(device, [])
            if dev.nbytes == SLAB_BYTES and len(free) < SLABS_KEPT:
                free.append(dev)
        self._bufs, self._outs, self._keep, self._slabs = [], [], [], []
        self._slab = self._slab_cap = self._slab_off = 0
