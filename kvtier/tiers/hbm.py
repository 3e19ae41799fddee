"""The HBM tier: pre-allocated pools of fixed-size slots in GPU memory, one per visible GPU.

Each namespace gets ``hbm_capacity`` bytes on every visible device, all allocated at start (a
request never waits on cudaMalloc), each one cudaMalloc that CUDA IPC can export. The pools share
one slot numbering, device d holding slots ``[d * per_device, (d + 1) * per_device)``, so the
engine sees one HBM tier with the SlotPool interface (alloc, free, read, write, n_slots,
free_count). A slot is taken from the worker's device where it has room (the server names the
device of the request: ``on_device``), else from the device with most free slots; a worker on
another GPU reads a pool by peer copies (kvtier.gpu.device.IpcPool).

Used only when cupy imports and a CUDA device is present; elsewhere the service runs with the
host and NVMe tiers and ``hbm_capacity`` is ignored with a note. The coherence tests use an
in-memory stand-in (tests/conftest.py), never offered to users.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable, Sequence

import numpy as np

from kvtier.config import Settings
from kvtier.errors import BadRequest, CapacityError
from kvtier.tiers.slots import SlotStack

# The GPU of the worker whose request is being served (None: no preference).
WORKER_DEVICE: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "kvtier_worker_device", default=None)


def on_device(device: int | None, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) with HBM slots taken from device first (runs in the engine's thread)."""
    token = WORKER_DEVICE.set(device)
    try:
        return fn(*args)
    finally:
        WORKER_DEVICE.reset(token)


def cuda_available() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except cupy.cuda.runtime.CUDARuntimeError:
        return False


def visible_devices() -> tuple[int, ...]:
    import cupy
    return tuple(range(cupy.cuda.runtime.getDeviceCount()))


class _DeviceSlots(SlotStack):
    """The free list of one device's pool (slot numbers local to it)."""

    def __init__(self, name: str, n_slots: int) -> None:
        self._init_slots(name, n_slots)


class HbmPool:
    """n_slots x block_bytes on each device of ``devices`` (default: every visible GPU). Not
    thread-safe; the engine serialises calls. ``devices`` may name one device twice (two pools
    on one GPU: how the multi-pool logic is tested on a one-GPU host)."""

    def __init__(self, name: str, block_bytes: int, n_slots: int,
                 devices: Sequence[int] | None = None) -> None:
        import cupy
        if n_slots <= 0:
            raise CapacityError("hbm_capacity is below one block; raise it or set it to 0")
        self.name, self.block_bytes = name, block_bytes
        self.devices = tuple(visible_devices() if devices is None else devices)
        if not self.devices:
            raise CapacityError("the HBM tier needs a CUDA device; set hbm_capacity to 0")
        self.per_device = n_slots
        self.n_slots = n_slots * len(self.devices)
        self.device = self.devices[0]
        self.fd = None
        self.pinned = False
        self._mems: list[Any] = []
        self.arrays: list[Any] = []
        for d in self.devices:
            with cupy.cuda.Device(d):
                # Its own cudaMalloc, not a sub-allocation of cupy's pool: one allocation per
                # device that CUDA IPC can export, taken up front.
                mem = cupy.cuda.memory.Memory(n_slots * block_bytes)
                arr = cupy.ndarray((n_slots, block_bytes), dtype=cupy.uint8,
                                   memptr=cupy.cuda.MemoryPointer(mem, 0))
                arr.fill(0)
            self._mems.append(mem)
            self.arrays.append(arr)
        self.array = self.arrays[0]
        self._free = [_DeviceSlots(f"{name}[{i}]", n_slots) for i in range(len(self.devices))]

    # ------------------------------------------------------------------ slots

    @property
    def free_count(self) -> int:
        return sum(f.free_count for f in self._free)

    @property
    def used_count(self) -> int:
        return self.n_slots - self.free_count

    def _order(self) -> list[int]:
        """Pool indices in the order slots are taken: the worker's device first."""
        want = WORKER_DEVICE.get()
        order = sorted(range(len(self._free)), key=lambda i: -self._free[i].free_count)
        if want is not None:
            order.sort(key=lambda i: self.devices[i] != want)     # stable: ties keep room order
        return order

    def alloc(self, n: int) -> np.ndarray | None:
        """n free slots, or None when fewer are free (an expected shortage: the caller evicts)."""
        if n > self.free_count:
            return None
        parts, left = [], n
        for i in self._order():
            take = min(left, self._free[i].free_count)
            if take:
                parts.append(self._free[i].alloc(take) + i * self.per_device)
                left -= take
            if not left:
                break
        return np.concatenate(parts).astype(np.int32) if parts else np.empty(0, np.int32)

    def free(self, slots: np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int32)
        for i, local in self._by_pool(slots):
            self._free[i].free(local)

    def check_slots(self, slots: np.ndarray) -> np.ndarray:
        slots = np.asarray(slots)
        if slots.size and (slots.min() < 0 or slots.max() >= self.n_slots):
            raise BadRequest(f"slot out of range for pool {self.name} (0..{self.n_slots - 1})")
        return slots.astype(np.int64, copy=False)

    def _by_pool(self, slots: np.ndarray) -> list[tuple[int, np.ndarray]]:
        pool = slots // self.per_device
        return [(i, (slots[pool == i] - i * self.per_device).astype(slots.dtype))
                for i in np.unique(pool).tolist()]

    # ------------------------------------------------------------------ bytes

    def write(self, slots: np.ndarray, data: Any) -> None:
        import cupy
        slots = self.check_slots(slots)
        pool = slots // self.per_device
        for i in np.unique(pool).tolist():
            pos = np.flatnonzero(pool == i)
            with cupy.cuda.Device(self.devices[i]):
                self.arrays[i][cupy.asarray(slots[pos] - i * self.per_device)] = \
                    cupy.asarray(np.asarray(data)[pos] if len(self.arrays) > 1 else data)

    def read(self, slots: np.ndarray, out: Any = None) -> Any:
        import cupy
        slots = self.check_slots(slots)
        if len(self.arrays) == 1:
            return self.arrays[0][cupy.asarray(slots)]
        res = np.empty((slots.size, self.block_bytes), dtype=np.uint8)
        pool = slots // self.per_device
        for i in np.unique(pool).tolist():
            pos = np.flatnonzero(pool == i)
            with cupy.cuda.Device(self.devices[i]):
                res[pos] = self.arrays[i][cupy.asarray(slots[pos] - i * self.per_device)].get()
        return res

    def ipc_handle(self) -> bytes:
        """The CUDA IPC handle of the first device's pool."""
        return self.ipc_info()["pools"][0]["ipc"]

    def ipc_info(self) -> dict[str, Any]:
        """ns_open's ``hbm``: each device's pool, by CUDA IPC handle, for a worker process on
        this host to open with cudaIpcOpenMemHandle (zero-copy access to HBM slots)."""
        import cupy
        pools = []
        for i, d in enumerate(self.devices):
            with cupy.cuda.Device(d):
                handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(self.arrays[i].data.ptr))
            pools.append({"ipc": handle, "device": d, "first": i * self.per_device,
                          "slots": self.per_device})
        return {"pools": pools, "slots": self.n_slots, "device": self.device}

    def close(self) -> None:
        self.arrays, self._mems = [], []
        self.array = None


def hbm_pool_factory(settings: Settings) -> tuple[Callable[[str, int, int], Any] | None, str]:
    """(factory, note): a factory of HbmPools when hbm_capacity > 0 and CUDA is present."""
    if settings.hbm_capacity <= 0:
        return None, ""
    if not cuda_available():
        return None, "hbm_capacity ignored: no CUDA device (install kvtier[gpu] on a GPU host)"
    devices = visible_devices()
    return HbmPool, (f"HBM tier: {settings.hbm_capacity} bytes per namespace on each of "
                     f"{len(devices)} device(s) {list(devices)}")
