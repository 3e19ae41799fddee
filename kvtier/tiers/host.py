"""The host tier: fixed-size slots in one shared-memory file per namespace.

Each namespace's slots live in a memfd (``memfd_create``), so that the worker API can pass the file
descriptor to an authorised client once and afterwards move only slot numbers. The file is sized
for the namespace's share of ``host_capacity`` up front; pages are touched only when a slot is
written, so an idle namespace costs address space, not memory. Every slot starts at a multiple of
the page size when block_bytes is a multiple of 4 KiB, which lets the NVMe tier read and write
slots with O_DIRECT and no bounce buffer.

The mapping asks for transparent huge pages (kvtier.memory.advise_huge_pages): where the kernel's
shmem_enabled policy allows them, workers copy out of 2 MiB pages.

When CUDA is present the mapping is registered with cudaHostRegister (pinned), so host<->GPU copies
run at DMA speed; ``pinned`` says whether that happened.

The free list is kvtier.tiers.slots.SlotStack. A pool holds no policy: which slot to free is decided by coherence.
Thread-safety: none; the engine serialises calls.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from kvtier.errors import BadRequest, CapacityError
from kvtier.memory import advise_huge_pages
from kvtier.tiers.slots import SlotStack

try:
    from kvtier.tiers import _slots
except ImportError:                   # not built: numpy's checked fancy assignment
    _slots = None


class SlotPool(SlotStack):
    """``n_slots`` slots of ``block_bytes`` each, in one memfd (or anonymous memory)."""

    def __init__(self, name: str, block_bytes: int, n_slots: int, shared: bool = True) -> None:
        if block_bytes <= 0:
            raise BadRequest(f"block_bytes must be positive, got {block_bytes}")
        if n_slots <= 0:
            raise CapacityError(
                f"a slot pool of {block_bytes}-byte blocks needs at least one slot; raise "
                "host_capacity (or hbm_capacity) above one block")
        self.block_bytes = block_bytes
        size = block_bytes * n_slots
        self.fd: int | None = None
        if shared:
            self.fd = os.memfd_create(f"kvtier:{name}"[:240], os.MFD_CLOEXEC)
            os.ftruncate(self.fd, size)
            self._mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        else:
            self._mm = mmap.mmap(-1, size)
        self.huge_pages = advise_huge_pages(self._mm)   # taken where shmem THP allows it
        self.array = np.frombuffer(self._mm, dtype=np.uint8).reshape(n_slots, block_bytes)
        self._init_slots(name, n_slots)
        self.pinned = _try_pin(self.array)

    def write(self, slots: np.ndarray, data: np.ndarray) -> None:
        """Copy data (n x block_bytes) into slots.

        With kvtier.tiers._slots: one C call that checks every slot and copies the rows (a
        put of 25 small blocks: ~1 us against ~15 for numpy's two reductions, cast and fancy
        assignment on the dev VM). Anything it does not take (other dtypes, strided arrays, a
        broadcast row, data inside this pool) goes the numpy way, which is also the fallback."""
        if _slots is not None:
            try:
                done = _slots.write_rows(self.array, slots, data)
            except (TypeError, ValueError, BufferError):   # not arrays it takes (strided ones
                done = -1                                   # refuse a contiguous buffer)
            if done == 0:
                raise BadRequest(f"slot out of range for pool {self.name} (0..{self.n_slots - 1})")
            if done == 1:
                return
        self._write_numpy(slots, data)

    def _write_numpy(self, slots: np.ndarray, data: np.ndarray) -> None:
        self.array[self.check_slots(slots)] = data

    def read(self, slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Copy slots out (n x block_bytes), into ``out`` when given."""
        idx = self.check_slots(slots)
        if out is None:
            return self.array[idx]
        np.take(self.array, idx, axis=0, out=out)
        return out

    def slot_view(self, slot: int) -> memoryview:
        """A zero-copy view of one slot, for I/O straight into or out of shared memory."""
        start = int(slot) * self.block_bytes
        return memoryview(self._mm)[start: start + self.block_bytes]

    def close(self) -> None:
        if self.pinned and self.array.size:
            # Unregister before the unmap: CUDA would otherwise keep the range registered, and
            # the next allocation at that address fails with CUDA_ERROR_ALREADY_MAPPED (seen
            # in kvikio's bounce buffers on the H200 host).
            import cupy
            cupy.cuda.runtime.hostUnregister(self.array.ctypes.data)
            self.pinned = False
        self.array = np.empty((0, self.block_bytes), dtype=np.uint8)
        try:
            self._mm.close()
        except BufferError:
            # A view is still exported (a client in the same process); the mapping goes when it
            # does. The fd is closed regardless.
            pass
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _try_pin(array: np.ndarray) -> bool:
    """cudaHostRegister the mapping when cupy and a device are present; False otherwise."""
    try:
        import cupy  # noqa: F401  (optional GPU extra)
    except ImportError:
        return False
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1 or array.size == 0:
            return False
        cupy.cuda.runtime.hostRegister(array.ctypes.data, array.nbytes, 0)
        return True
    except cupy.cuda.runtime.CUDARuntimeError:
        # No driver or no device: the tier stays pageable and host<->GPU copies run slower.
        return False
