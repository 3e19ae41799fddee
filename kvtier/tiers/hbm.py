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
from kvtier.errors import CapacityError
from kvtier.tiers.slots import SlotStack


def cuda_available() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except cupy.cuda.runtime.CUDARuntimeError:
        return False


class HbmPool(SlotStack):
    """n_slots x block_bytes on one CUDA device. Not thread-safe; the engine serialises calls."""

    def __init__(self, name: str, block_bytes: int, n_slots: int, device: int = 0) -> None:
        import cupy
        if n_slots <= 0:
            raise CapacityError("hbm_capacity is below one block; raise it or set it to 0")
        self.block_bytes, self.device = block_bytes, device
        self.fd = None
        self.pinned = False
        with cupy.cuda.Device(device):
            # Its own cudaMalloc, not a sub-allocation of cupy's pool: the whole pool is one
            # allocation that CUDA IPC can export, and it is taken up front.
            self._mem = cupy.cuda.memory.Memory(n_slots * block_bytes)
            self.array = cupy.ndarray((n_slots, block_bytes), dtype=cupy.uint8,
                                      memptr=cupy.cuda.MemoryPointer(self._mem, 0))
            self.array.fill(0)
        self._init_slots(name, n_slots)

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
