"""Copy-engine calls of a GPU transfer: one block page by page (copy_one, the latency case) and
many 1-D copies in one driver call (copy_batch: cuMemcpyBatchAsync through ctypes).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.errors import KvtierError
from kvtier.gpu.streams import Stream

if TYPE_CHECKING:
    from kvtier.gpu.plan import PageTable
    from kvtier.gpu.slots import DeviceSlots

_H2D, _D2H, _DEFAULT = 1, 2, 4       # cudaMemcpyHostToDevice, DeviceToHost, Default


def copy_one(slots: DeviceSlots, table: PageTable, stream: Stream, slot: int, row: int,
             lo: int, hi: int, to_seg: bool) -> None:
    """Pages lo..hi of one block (slot <-> engine block row) by a copy-engine call per page on
    stream: the latency case, no numpy. slots has one range."""
    import cupy
    rng = slots.ranges[0]
    seg0 = rng.base + (slot - rng.first) * slots.block_bytes
    for p in range(lo, hi):
        seg = seg0 + int(table.offset[p])
        dev = int(table.base[p]) + row * int(table.stride[p])
        src, dst = (dev, seg) if to_seg else (seg, dev)
        cupy.cuda.runtime.memcpyAsync(dst, src, int(table.size[p]), _DEFAULT, stream.ptr)


class _Batch:
    """cuMemcpyBatchAsync (the CUDA 13 driver's, without failIdx: cuMemcpyBatchAsync_v2) through
    ctypes: many 1-D copies handed to the driver in one call, each in stream order. None where
    the driver lacks it (copies then go one cudaMemcpyAsync each)."""

    class Attrs(ctypes.Structure):
        _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_type", ctypes.c_int),
                    ("src_loc_id", ctypes.c_int), ("dst_loc_type", ctypes.c_int),
                    ("dst_loc_id", ctypes.c_int), ("flags", ctypes.c_uint)]

    _fn: list[Any] = []

    @classmethod
    def fn(cls) -> Any:
        if not cls._fn:
            fn = None
            try:
                fn = ctypes.CDLL("libcuda.so.1").cuMemcpyBatchAsync_v2
                vp, sz = ctypes.c_void_p, ctypes.c_size_t
                fn.argtypes = [vp, vp, vp, sz, vp, vp, sz, vp]   # dsts srcs sizes count attrs
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                fn = None
            cls._fn.append(fn)
        return cls._fn[0]


_ATTRS = _Batch.Attrs(1, 0, 0, 0, 0, 0)      # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, no hints
_ATTR_IDX = (ctypes.c_size_t * 1)(0)


def batch_available() -> bool:
    return _Batch.fn() is not None


def copy_batch(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: Stream,
               per_call: int) -> None:
    """The copies dst[i] <- src[i] (sizes[i] bytes), in stream order on stream (not the legacy
    default stream, which the driver refuses: Mover forks off it), per_call to a driver call.
    Within a call the copies run in any order, so no two may write the same bytes. The first
    call is short, so the copy engines start while the rest are handed over. Raises
    KvtierError on a driver error (the transfer then fails)."""
    fn = _Batch.fn()
    dst = np.ascontiguousarray(dst, dtype=np.uint64)
    src = np.ascontiguousarray(src, dtype=np.uint64)
    sizes = np.ascontiguousarray(sizes, dtype=np.uint64)
    n = dst.size
    lo = 0
    step = max(1, min(per_call, 8))
    while lo < n:
        hi = min(n, lo + step)
        rc = fn(dst.ctypes.data + 8 * lo, src.ctypes.data + 8 * lo, sizes.ctypes.data + 8 * lo,
                hi - lo, ctypes.addressof(_ATTRS), ctypes.addressof(_ATTR_IDX), 1,
                ctypes.c_void_p(stream.ptr))
        if rc != 0:
            raise KvtierError(f"cuMemcpyBatchAsync failed with CUDA error {rc} (copies "
                              f"{lo}..{hi} of {n}); kvtier.gpu.transfer.set_policy("
                              "TransferPolicy(batch_copies=0)) copies one call per block")
        lo, step = hi, per_call
