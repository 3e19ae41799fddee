"""A client's mappings of a namespace's shared host segment: read-only, with write windows.

The segment holds every committed block of the namespace, and every worker that maps it could
once write anywhere in it: a stray write in one worker would change another's blocks (the
checksum on get caught it, after the fact). Here a worker maps it once, writable, and keeps the
mapping PROT_READ with mprotect, except for the pages of the slots a put has reserved, which
are opened for the few microseconds the copy in takes (``write``) and closed again. ``view``,
the array that gets copy out of and leases point into, is marked read-only as well, so a write
through it is refused by numpy with an error, and any other write faults in the MMU.

One mapping, not a read-only one beside a writable one: with two, a slot written through one
was read for the first time through the other, a minor fault per page (16 per 64 KiB block),
which cost a tenth of bench/api.py's get throughput while slots were still fresh.

So only the slots a worker has reserved (not yet committed, so no reader sees them) are ever
writable in it, and only during its own copy. What remains possible is deliberate: a process
that maps the memfd afresh can write it, as a process of the service's uid could also attach a
debugger to the service. The service hashes every block at commit, and every NVMe or Redis read
is checked against that hash; a host-tier get re-hashes only when asked (verify=True).

Windows are whole pages: where block_bytes is not a multiple of the page size, the bytes of a
neighbouring slot that share a page with a reserved one are writable during the copy too.
GPU workers register a second, writable mapping with CUDA (gpu_view; kvtier.gpu.slots.MappedSegment):
the kernels write only the reserved slots the service names. Costs: two mprotect calls per run
of reserved slots (gaps of up to 256 KiB closed into the window), and per page: on the dev VM a
4 MiB put of consecutive slots took 0.65-0.87 ms through its window against 0.40-0.45 ms without,
and one of 64 scattered slots 1.7-1.9 ms against 0.42 ms. The free list hands a rewrite's
batch back its predecessor's run of slots, so puts are mostly the first case.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from typing import Iterator

import numpy as np

from kvtier.memory import advise_huge_pages

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_PAGE = mmap.PAGESIZE
_MERGE_GAP = 256 << 10


class SegmentMap:
    """The mappings of one segment: size bytes of fd, which this object owns and closes."""

    def __init__(self, fd: int, size: int, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.size = size
        self._fd = fd
        self._gpu: mmap.mmap | None = None
        self._rw = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        advise_huge_pages(self._rw)
        self._wview = np.frombuffer(self._rw, dtype=np.uint8).reshape(-1, block_bytes)
        self.view = self._wview.view()
        self.view.flags.writeable = False
        self._base = self._wview.ctypes.data
        self._protect(0, size, mmap.PROT_READ)

    def _protect(self, start: int, end: int, prot: int) -> None:
        lo = start // _PAGE * _PAGE
        hi = min(-(-end // _PAGE) * _PAGE, -(-self.size // _PAGE) * _PAGE)
        if _libc.mprotect(self._base + lo, hi - lo, prot) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mprotect of the namespace segment: {os.strerror(err)}")

    def _runs(self, slots: np.ndarray) -> list[tuple[int, int]]:
        """Byte ranges covering slots: runs of consecutive slots, with gaps of up to
        _MERGE_GAP bytes merged into one window. mprotect costs a syscall (~10 us on the dev
        VM) plus ~0.13 us per page, so closing a gap of fewer than ~64 pages costs less than a
        second pair of calls; a span over a whole scattered batch (64 slots in a 128 MiB
        segment: 8.5 ms against 0.43 ms for the copy itself) costs far more."""
        s = np.unique(slots.astype(np.int64))
        if s.size == 0:
            return []
        gap_slots = max(0, _MERGE_GAP // self.block_bytes)
        breaks = np.flatnonzero(np.diff(s) > gap_slots + 1)
        starts = np.r_[s[0], s[breaks + 1]]
        ends = np.r_[s[breaks], s[-1]] + 1
        return [(int(a) * self.block_bytes, int(b) * self.block_bytes)
                for a, b in zip(starts, ends)]

    def write(self, slots: np.ndarray, src: np.ndarray) -> None:
        """segment[slots[i]] = src[i], through windows opened for these slots only."""
        with self.writable(slots) as view:
            view[slots.astype(np.intp)] = src

    @contextlib.contextmanager
    def writable(self, slots: np.ndarray) -> Iterator[np.ndarray]:
        """The writable (n_slots, block_bytes) view, with windows open for slots only, for
        writers that fill a slot from several places (kvtier.api.hostpages: a block's pages)."""
        opened = []
        try:
            for a, b in self._runs(slots):
                self._protect(a, b, mmap.PROT_READ | mmap.PROT_WRITE)
                opened.append((a, b))
            yield self._wview
        finally:
            for a, b in opened:
                self._protect(a, b, mmap.PROT_READ)

    def gpu_view(self) -> np.ndarray:
        """A writable mapping for CUDA to register (made on first use); CPU code never writes
        through it."""
        if self._gpu is None:
            self._gpu = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        return np.frombuffer(self._gpu, dtype=np.uint8).reshape(-1, self.block_bytes)

    def close(self) -> None:
        self.view = self._wview = None
        for m in (self._rw, self._gpu):
            if m is None:
                continue
            try:
                m.close()
            except BufferError:
                pass          # a caller still holds a view; the mapping goes with it
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
