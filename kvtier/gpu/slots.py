"""The slots a GPU transfer addresses: the namespace's mapped host segment, registered with
CUDA, or the service's HBM pools opened by CUDA IPC (one per GPU of the service).

A registration or an IPC mapping ends with close(), or, for a handle dropped without it (a
namespace reopened, a client collected), when the object is collected: a stale registration of
an address range that is later mapped again would make that range's next registration, or an
IPC mapping placed there, fail ("already mapped").
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.errors import BadRequest

_HOST_REGISTER_PORTABLE = 0x01
_HOST_REGISTER_MAPPED = 0x02


def _unregister(ptr: int) -> None:
    import cupy
    cupy.cuda.runtime.hostUnregister(ptr)


def _ipc_close(ptrs: list[int]) -> None:
    import cupy
    for ptr in ptrs:
        cupy.cuda.runtime.ipcCloseMemHandle(ptr)


@dataclass(frozen=True, slots=True)
class SlotRange:
    first: int          # the first slot number of the range
    count: int
    base: int           # device-usable address of slot `first`
    device: int         # -1: host memory


class DeviceSlots:
    """Slots the GPU can address, in one or more ranges (one per HBM pool device)."""

    ranges: tuple[SlotRange, ...]
    block_bytes: int
    device_to_device: bool

    def split(self, slots: np.ndarray) -> list[tuple[SlotRange, np.ndarray, np.ndarray]]:
        """(range, positions in slots, slot numbers within the range) per range touched."""
        slots = np.asarray(slots, dtype=np.int64)
        if len(self.ranges) == 1:
            r = self.ranges[0]
            return [(r, np.arange(slots.size), slots - r.first)] if slots.size else []
        out = []
        for r in self.ranges:
            pos = np.flatnonzero((slots >= r.first) & (slots < r.first + r.count))
            if pos.size:
                out.append((r, pos, slots[pos] - r.first))
        return out

    def close(self) -> None:
        raise NotImplementedError


class MappedSegment(DeviceSlots):
    """The namespace's shared host segment (numpy (n_slots, block_bytes), already mapped in this
    process) registered with cudaHostRegister, portable and mapped: copy engines and kernels
    reach it over PCIe without a bounce buffer."""

    device_to_device = False

    def __init__(self, host: np.ndarray) -> None:
        import cupy
        if host.shape[1] % 8:
            raise BadRequest("the CUDA path needs block_bytes that are a multiple of 8")
        self.block_bytes = int(host.shape[1])
        self.host = host
        self.ptr = host.ctypes.data
        cupy.cuda.runtime.hostRegister(self.ptr, host.nbytes,
                                       _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED)
        # Runs before the mapping can go: self.host keeps it alive until then.
        self._end = weakref.finalize(self, _unregister, self.ptr)
        # With unified addressing (every 64-bit CUDA platform) a mapped registration's device
        # pointer is its host address.
        self.ranges = (SlotRange(0, int(host.shape[0]), self.ptr, -1),)

    def close(self) -> None:
        self._end()


class IpcPool(DeviceSlots):
    """A worker's view of the service's HBM pools, one per GPU of the service (ns_open's
    ``hbm``), opened from their CUDA IPC handles with lazy peer access: a worker on another GPU
    reads a pool by peer copies where P2P is on (through host memory otherwise, which CUDA does
    for the kernel)."""

    device_to_device = True
    _LAZY_PEER_ACCESS = 1            # cudaIpcMemLazyEnablePeerAccess

    def __init__(self, info: dict[str, Any], block_bytes: int) -> None:
        import cupy
        if block_bytes % 8:
            raise BadRequest("the CUDA path needs block_bytes that are a multiple of 8")
        self.block_bytes = block_bytes
        self._opened: list[int] = []
        ranges = []
        for pool in info["pools"]:
            try:
                ptr = cupy.cuda.runtime.ipcOpenMemHandle(pool["ipc"], self._LAZY_PEER_ACCESS)
            except BaseException:
                _ipc_close(self._opened)
                raise
            self._opened.append(ptr)
            ranges.append(SlotRange(int(pool["first"]), int(pool["slots"]), ptr,
                                    int(pool["device"])))
        self.ranges = tuple(ranges)
        self._end = weakref.finalize(self, _ipc_close, self._opened)

    def close(self) -> None:
        self._end()
