"""The HBM tier: a pre-allocated pool of fixed-size slots in GPU memory, through cupy.

One pool per namespace on the service's device, carved from ``hbm_capacity`` at start (all of it
allocated up front, so that a request never waits on cudaMalloc). It exposes the SlotPool
interface the engine uses (alloc, free, read, write, n_slots, free_count), with device arrays in
place of host ones. Used only when cupy imports and a CUDA device is present; elsewhere the
service runs with the host and NVMe tiers and ``hbm_capacity`` is ignored with a note.
The coherence tests use an in-memory stand-in (tests/conftest.py), never offered to users.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kvtier.config import Settings
from kvtier.errors import BadRequest, CapacityError


def cuda_available() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except cupy.cuda.runtime.CUDARuntimeError:
        return False


class HbmPool:
    """n_slots x block_bytes on one CUDA device. Not thread-safe; the engine serialises calls."""

    def __init__(self, name: str, block_bytes: int, n_slots: int, device: int = 0) -> None:
        import cupy
        if n_slots <= 0:
            raise CapacityError("hbm_capacity is below one block; raise it or set it to 0")
        self.name, self.block_bytes, self.n_slots, self.device = name, block_bytes, n_slots, device
        self.fd = None
        self.pinned = False
        with cupy.cuda.Device(device):
            # Its own cudaMalloc, not a sub-allocation of cupy's pool: the whole pool is one
            # allocation that CUDA IPC can export, and it is taken up front.
            self._mem = cupy.cuda.memory.Memory(n_slots * block_bytes)
            self.array = cupy.ndarray((n_slots, block_bytes), dtype=cupy.uint8,
                                      memptr=cupy.cuda.MemoryPointer(self._mem, 0))
            self.array.fill(0)
        self._free = np.arange(n_slots - 1, -1, -1, dtype=np.int32)
        self._top = n_slots

    @property
    def free_count(self) -> int:
        return self._top

    @property
    def used_count(self) -> int:
        return self.n_slots - self._top

    def alloc(self, n: int) -> np.ndarray | None:
        if n > self._top:
            return None
        out = self._free[self._top - n: self._top][::-1].copy()
        self._top -= n
        return out

    def free(self, slots: np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int32)
        if self._top + slots.size > self.n_slots:
            raise RuntimeError(f"pool {self.name}: more slots freed than allocated (double free)")
        self._free[self._top: self._top + slots.size] = slots[::-1]
        self._top += slots.size

    def check_slots(self, slots: np.ndarray) -> np.ndarray:
        slots = np.asarray(slots)
        if slots.size and (slots.min() < 0 or slots.max() >= self.n_slots):
            raise BadRequest(f"slot out of range for pool {self.name} (0..{self.n_slots - 1})")
        return slots.astype(np.int64, copy=False)

    def write(self, slots: np.ndarray, data: Any) -> None:
        import cupy
        idx = cupy.asarray(self.check_slots(slots))
        self.array[idx] = cupy.asarray(data)

    def read(self, slots: np.ndarray, out: Any = None) -> Any:
        import cupy
        return self.array[cupy.asarray(self.check_slots(slots))]

    def ipc_handle(self) -> bytes:
        """A CUDA IPC handle of the pool's allocation, for a worker process on this host to
        open with cudaIpcOpenMemHandle (zero-copy access to HBM slots)."""
        import cupy
        return bytes(cupy.cuda.runtime.ipcGetMemHandle(self.array.data.ptr))

    def close(self) -> None:
        self.array = None


def hbm_pool_factory(settings: Settings) -> tuple[Callable[[str, int, int], Any] | None, str]:
    """(factory, note): a factory of HbmPools when hbm_capacity > 0 and CUDA is present."""
    if settings.hbm_capacity <= 0:
        return None, ""
    if not cuda_available():
        return None, "hbm_capacity ignored: no CUDA device (install kvtier[gpu] on a GPU host)"
    return HbmPool, f"HBM tier: {settings.hbm_capacity} bytes per namespace on device 0"
