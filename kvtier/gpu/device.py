"""What the GPU transfers run over: the caller's stream, staged indices, the slots the GPU can
address (the namespace's mapped host segment, or the service's HBM pools by CUDA IPC), and the
enqueueing of one page group's copies by the method plan.py chooses.

Needs cupy and a CUDA device; torch tensors are read through their data pointers, no copies.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.errors import BadRequest
from kvtier.gpu import kernels
from kvtier.gpu.plan import (Method, PageTable, TransferPolicy, copy_runs, kernel_launches,
                             uniform_runs, vector_bytes)

_HOST_REGISTER_PORTABLE = 0x01
_HOST_REGISTER_MAPPED = 0x02
_H2D, _D2H, _DEFAULT = 1, 2, 4       # cudaMemcpyHostToDevice, DeviceToHost, Default
THREADS = 1024
_sm_counts: dict[int, int] = {}


def is_cuda_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and getattr(x, "is_cuda", False)


def is_cuda_target(x: Any) -> bool:
    """A CUDA tensor of rows, or a kvtier.api.layouts.Pages over CUDA tensors."""
    if is_cuda_tensor(x):
        return True
    from kvtier.api.layouts import Pages
    return isinstance(x, Pages) and x.is_cuda


def sm_count(device: int) -> int:
    n = _sm_counts.get(device)
    if n is None:
        import cupy
        n = _sm_counts[device] = int(
            cupy.cuda.Device(device).attributes["MultiProcessorCount"])
    return n


def target_table(target: Any, block_bytes: int) -> PageTable:
    """The PageTable of a CUDA tensor of whole rows, or of CUDA Pages (plan.py)."""
    from kvtier.api.layouts import Pages
    if isinstance(target, Pages):
        views = target.views
        if not all(is_cuda_tensor(v) for v in views):
            raise BadRequest("a CUDA transfer needs every page view on the GPU (torch tensors)")
        devices = {v.device.index for v in views}
        if len(devices) != 1:
            raise BadRequest(f"the page views are on devices {sorted(devices)}; one transfer "
                             "moves the pages of one GPU")
        if target.block_bytes != block_bytes:
            raise BadRequest(f"the pages hold {target.block_bytes} bytes per block, the "
                             f"namespace's blocks are {block_bytes}")
        return PageTable.make([v.data_ptr() for v in views], [v.stride(0) * v.element_size()
                                                            for v in views],
                              [v.shape[1] * v.element_size() for v in views],
                              target.num_blocks, devices.pop())
    if not target.is_contiguous():
        raise BadRequest("the CUDA tensor must be contiguous rows of whole blocks (or pass "
                         "kvtier.api.layouts.Pages for per-layer tensors)")
    nbytes = target.numel() * target.element_size()
    if nbytes % block_bytes:
        raise BadRequest(f"a CUDA tensor of {nbytes} bytes is not whole blocks of {block_bytes}")
    return PageTable.make([target.data_ptr()], [block_bytes], [block_bytes],
                          nbytes // block_bytes, target.device.index)


@dataclass(slots=True)
class Stream:
    """The caller's stream: its handle and a cupy view of it (kernels launch on cupy's current
    stream)."""

    ptr: int
    cupy: Any

    @classmethod
    def resolve(cls, stream: Any, device: int) -> "Stream":
        """torch.cuda.Stream, cupy Stream, a raw cudaStream_t, or None: torch's current stream
        on device (the engine's)."""
        import cupy
        if stream is None:
            import torch
            ptr = torch.cuda.current_stream(device).cuda_stream
        elif hasattr(stream, "cuda_stream"):
            ptr = int(stream.cuda_stream)
        elif hasattr(stream, "ptr"):
            ptr = int(stream.ptr)
        elif isinstance(stream, int) and not isinstance(stream, bool):
            ptr = stream
        else:
            raise BadRequest(f"stream must be a torch or cupy CUDA stream, or a cudaStream_t "
                             f"as an int, not {type(stream).__name__}")
        return cls(ptr, cupy.cuda.ExternalStream(ptr, device))

    def event(self) -> Any:
        import cupy
        ev = cupy.cuda.Event(block=False, disable_timing=True)
        ev.record(self.cupy)
        return ev

    def wait(self, event: Any) -> None:
        import cupy
        cupy.cuda.runtime.streamWaitEvent(self.ptr, event.ptr, 0)


class _Arena:
    """Pinned host buffers for staged indices, reused once the transfer that staged into them
    has completed (never earlier: its copies may still read them)."""

    def __init__(self) -> None:
        self._free: list[tuple[int, int]] = []

    def take(self, nbytes: int) -> tuple[int, int]:
        for i, (addr, cap) in enumerate(self._free):
            if cap >= nbytes:
                return self._free.pop(i)
        import cupy
        cap = max(1 << 20, 1 << (nbytes - 1).bit_length())
        return cupy.cuda.runtime.hostAlloc(cap, 0), cap

    def give(self, bufs: list[tuple[int, int]]) -> None:
        self._free.extend(bufs)


ARENA = _Arena()


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

    def upload(self, a: np.ndarray) -> int:
        """Device address of a copy of a (int64), valid on the stream from now on."""
        import cupy
        a = np.ascontiguousarray(a, dtype=np.int64)
        nbytes = max(8, a.nbytes)
        if not self._bufs or self._off + nbytes > self._bufs[-1][1]:
            self._bufs.append(ARENA.take(nbytes))
            self._off = 0
        addr = self._bufs[-1][0] + self._off
        if a.size:
            np.ctypeslib.as_array((ctypes.c_int64 * a.size).from_address(addr))[:] = a
        dev = cupy.empty(nbytes // 8, dtype=cupy.int64)
        self._keep.append(dev)
        cupy.cuda.runtime.memcpyAsync(dev.data.ptr, addr, nbytes, _H2D, self.stream.ptr)
        self._off += -(-nbytes // 256) * 256
        return int(dev.data.ptr)

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

    def release(self) -> None:
        ARENA.give(self._bufs + self._outs)
        self._bufs, self._outs, self._keep = [], [], []


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
        # With unified addressing (every 64-bit CUDA platform) a mapped registration's device
        # pointer is its host address.
        self.ranges = (SlotRange(0, int(host.shape[0]), self.ptr, -1),)

    def close(self) -> None:
        if self.ptr:
            import cupy
            cupy.cuda.runtime.hostUnregister(self.ptr)
            self.ptr = 0


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
            ptr = cupy.cuda.runtime.ipcOpenMemHandle(pool["ipc"], self._LAZY_PEER_ACCESS)
            self._opened.append(ptr)
            ranges.append(SlotRange(int(pool["first"]), int(pool["slots"]), ptr,
                                    int(pool["device"])))
        self.ranges = tuple(ranges)

    def close(self) -> None:
        import cupy
        for ptr in self._opened:
            cupy.cuda.runtime.ipcCloseMemHandle(ptr)
        self._opened = []


class Mover:
    """Enqueues the copies of one transfer on its stream (plan.py's methods)."""

    def __init__(self, slots: DeviceSlots, table: PageTable, stream: Stream,
                 policy: TransferPolicy, staging: Staging) -> None:
        self.slots, self.table, self.stream = slots, table, stream
        self.policy, self.staging = policy, staging
        self._tab = 0
        self.methods: set[Method] = set()

    def move(self, slots: np.ndarray, rows: np.ndarray, lo: int, hi: int, to_seg: bool) -> None:
        """Pages lo..hi of blocks: slots[i] <-> engine block rows[i], to the slots or from."""
        import cupy
        bb, table = self.slots.block_bytes, self.table
        for rng, pos, local in self.slots.split(slots):
            r = rows[pos]
            for a, b in uniform_runs(table.size, lo, hi):
                size = int(table.size[a])
                method = self.policy.method(size, local.size * (b - a),
                                            self.slots.device_to_device)
                self.methods.add(method)
                if method is Method.COPY_ENGINE:
                    for c in copy_runs(local, r, table, bb, a, b):
                        seg = rng.base + c.seg_off
                        src, dst = (c.dev_addr, seg) if to_seg else (seg, c.dev_addr)
                        sp, dp = (c.dev_pitch, c.seg_pitch) if to_seg else (c.seg_pitch,
                                                                            c.dev_pitch)
                        if c.height == 1:
                            cupy.cuda.runtime.memcpyAsync(dst, src, c.width, _DEFAULT,
                                                          self.stream.ptr)
                        else:
                            cupy.cuda.runtime.memcpy2DAsync(dst, dp, src, sp, c.width,
                                                            c.height, _DEFAULT,
                                                            self.stream.ptr)
                    continue
                self._launch(rng, local, r, a, b, to_seg)

    def _launch(self, rng: SlotRange, local: np.ndarray, rows: np.ndarray, a: int, b: int,
                to_seg: bool) -> None:
        table, bb = self.table, self.slots.block_bytes
        if not self._tab:
            self._tab = self.staging.upload(table.staged())
        vec = vector_bytes(rng.base, bb, table, a, b)
        vecs = int(table.size[a]) // vec
        idx = self.staging.upload(np.concatenate([local, rows]))
        n = local.size
        k = kernels.get("move_pages16" if vec == 16 else "move_pages8")
        cap = self.policy.blocks(self.slots.device_to_device, sm_count(table.device))
        with self.stream.cupy:
            for l0, l1 in kernel_launches(n, b - a, vecs):
                total = (l1 - l0) * (b - a) * vecs
                grid = max(1, min(cap, -(-total // (4 * THREADS))))
                k((grid,), (THREADS,),
                  (np.uint64(rng.base), np.int64(bb), np.uint64(self._tab),
                   np.int32(table.pages), np.uint64(idx + 8 * l0),
                   np.uint64(idx + 8 * (n + l0)), np.int32(l1 - l0), np.int32(a),
                   np.int32(b - a), np.uint32(vecs), np.int32(1 if to_seg else 0)))

    def checksums(self, rows: np.ndarray, side: Stream) -> int:
        """xxh3-64 of engine blocks rows of the table, computed on the GPU on stream side
        (forked from the transfer's stream after the uploads it needs): the address of n uint64
        in pinned host memory, filled once side has run."""
        import cupy
        from kvtier.gpu.xxh3 import key_table
        n = rows.size
        if not self._tab:
            self._tab = self.staging.upload(self.table.staged())
        keys = self.staging.upload(key_table().view(np.int64))
        ridx = self.staging.upload(rows)
        side.wait(self.stream.event())
        out = self.staging.device(n)
        threads = 128
        with side.cupy:
            kernels.get("xxh3_pages")((-(-4 * n // threads),), (threads,),
                                      (np.uint64(self._tab), np.int32(self.table.pages),
                                       np.uint64(ridx), np.int32(n),
                                       np.int64(self.table.block_bytes), np.uint64(keys),
                                       np.uint64(out)))
        host = self.staging.pinned(8 * n)
        cupy.cuda.runtime.memcpyAsync(host, out, 8 * n, _D2H, side.ptr)
        return host
