"""The client's CUDA data path: one gather or scatter launch per batch.

The namespace's shared host segment, already mapped into the worker, is registered with
cudaHostRegister (portable, mapped), so the GPU can read and write it directly over PCIe. A get
into a CUDA tensor is then a single kernel that copies the leased slots (scattered in the
segment) into the rows of the worker's tensor (scattered too, as a paged KV cache lays out its
pages); a put is the same kernel the other way. No per-block cudaMemcpy: on the H200 one copy
per 16 KiB block moves 1.6 GB/s, while one launch over mapped pinned memory runs near the 55
GB/s of pinned copies.

Needs cupy and a CUDA device; torch tensors are exchanged through DLPack without copies.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.errors import BadRequest

# Two kernels over the same rows. move_rows: one thread per 8-byte word of the whole batch
# (a 64-bit division per word); it ran at 0.89 of a pinned cudaMemcpy for 16 KiB rows on the
# H200. move_rows16: one thread block per row, 16-byte loads and stores, no division; used when
# rows are whole 16-byte vectors and both buffers are 16-byte aligned (page-aligned slots,
# allocator-aligned tensors), which is every real KV page.
_KERNEL = r"""
extern "C" __global__ void move_rows(const unsigned long long* __restrict__ src,
                                     unsigned long long* __restrict__ dst,
                                     const long long* __restrict__ src_rows,
                                     const long long* __restrict__ dst_rows,
                                     long long n_rows, long long words) {
    long long total = n_rows * words;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / words, w = i - r * words;
        dst[dst_rows[r] * words + w] = src[src_rows[r] * words + w];
    }
}

extern "C" __global__ void move_rows16(const ulonglong2* __restrict__ src,
                                       ulonglong2* __restrict__ dst,
                                       const long long* __restrict__ src_rows,
                                       const long long* __restrict__ dst_rows,
                                       long long n_rows, long long vecs) {
    for (long long r = blockIdx.x; r < n_rows; r += gridDim.x) {
        const ulonglong2* s = src + src_rows[r] * vecs;
        ulonglong2* d = dst + dst_rows[r] * vecs;
        for (long long v = threadIdx.x; v < vecs; v += blockDim.x) {
            d[v] = s[v];
        }
    }
}
"""
_HOST_REGISTER_PORTABLE = 0x01
_HOST_REGISTER_MAPPED = 0x02
_kernel_cache: dict[tuple[int, str], Any] = {}


def _kernel(name: str = "move_rows") -> Any:
    import cupy
    key = (cupy.cuda.Device().id, name)
    k = _kernel_cache.get(key)
    if k is None:
        k = cupy.RawModule(code=_KERNEL).get_function(name)
        _kernel_cache[key] = k
    return k


def is_cuda_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and getattr(x, "is_cuda", False)


def rows_view(tensor: Any, n: int, block_bytes: int) -> Any:
    """A CUDA tensor as a cupy (rows, block_bytes / 8) uint64 view, no copy."""
    import cupy
    import torch
    if not tensor.is_contiguous():
        raise BadRequest("the CUDA tensor must be contiguous (a paged cache's storage is)")
    flat = tensor.view(torch.uint8).reshape(-1)
    if flat.numel() % block_bytes:
        raise BadRequest(f"a CUDA tensor of {flat.numel()} bytes is not whole blocks of "
                         f"{block_bytes}")
    arr = cupy.from_dlpack(flat)
    return arr.view(cupy.uint64).reshape(-1, block_bytes // 8)


class PinnedIndices:
    """Row indices on their way to the kernels, staged in pinned host memory and copied with
    cudaMemcpyAsync, so that launching chunk k+1 of a pipelined batch never waits for chunk k.

    (cupy.asarray of a numpy array is a pageable copy: it is ordered after the kernel already
    in the stream and blocks the host until that kernel has run, which serialised the control
    path of one chunk behind the transfer of the previous one: bench/gpu.py onboard 16 KiB at
    2.35 ms where the kernel alone takes 1.46 ms.)

    A staged region is not rewritten until reset(), which the caller makes only after the
    stream has synchronised; until then a full buffer is followed by a new, larger one.
    """

    def __init__(self) -> None:
        self._bufs: list[tuple[int, int]] = []       # (pinned host address, bytes)
        self._off = 0

    def upload(self, a: np.ndarray) -> Any:
        import ctypes
        import cupy
        a = np.ascontiguousarray(a, dtype=np.int64)
        nbytes = a.nbytes
        if not self._bufs or self._off + nbytes > self._bufs[-1][1]:
            cap = max(1 << 20, 2 * (self._bufs[-1][1] if self._bufs else 0), nbytes)
            self._bufs.append((cupy.cuda.runtime.hostAlloc(cap, 0), cap))
            self._off = 0
        addr = self._bufs[-1][0] + self._off
        if a.size:
            np.ctypeslib.as_array((ctypes.c_int64 * a.size).from_address(addr))[:] = a
        dev = cupy.empty(a.size, dtype=cupy.int64)
        if a.size:
            dev.data.copy_from_host_async(addr, nbytes)
        self._off += -(-nbytes // 256) * 256
        return dev

    def reset(self) -> None:
        """Every staged index has been copied (the stream has synchronised): reuse the
        largest buffer from its start, free the others."""
        import cupy
        for addr, _cap in self._bufs[:-1]:
            cupy.cuda.runtime.freeHost(addr)
        self._bufs = self._bufs[-1:]
        self._off = 0

    def close(self) -> None:
        import cupy
        for addr, _cap in self._bufs:
            cupy.cuda.runtime.freeHost(addr)
        self._bufs = []


class MappedSegment:
    """A mapped host segment (numpy (n_slots, block_bytes)) made readable by the GPU."""

    def __init__(self, host: np.ndarray) -> None:
        import cupy
        if host.shape[1] % 8:
            raise BadRequest("the CUDA path needs block_bytes that are a multiple of 8")
        self.host = host
        self.ptr = host.ctypes.data
        self.nbytes = host.nbytes
        cupy.cuda.runtime.hostRegister(self.ptr, self.nbytes,
                                       _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED)
        # With unified virtual addressing (every 64-bit CUDA platform) a mapped registration's
        # device pointer is its host address; cupy has no binding for cudaHostGetDevicePointer.
        get = getattr(cupy.cuda.runtime, "hostGetDevicePointer", None)
        dptr = get(self.ptr, 0) if get is not None else self.ptr
        mem = cupy.cuda.UnownedMemory(dptr, self.nbytes, self)
        self.dev = cupy.ndarray((host.shape[0], host.shape[1] // 8), dtype=cupy.uint64,
                                memptr=cupy.cuda.MemoryPointer(mem, 0))
        self.indices = PinnedIndices()

    def gather(self, slots: np.ndarray, out: Any, rows: np.ndarray | None = None) -> None:
        """out[rows[i]] = segment[slots[i]], one launch (asynchronous: sync() before the
        slots may be released); out is a cupy uint64 row view."""
        self._move(self.dev, out, slots, rows if rows is not None else np.arange(len(slots)),
                   self.indices)

    def scatter(self, src: Any, slots: np.ndarray, rows: np.ndarray | None = None) -> None:
        """segment[slots[i]] = src[rows[i]], one launch (asynchronous: sync() before commit)."""
        self._move(src, self.dev, rows if rows is not None else np.arange(len(slots)), slots,
                   self.indices)

    def sync(self) -> None:
        """Wait for this thread's launches; then the staged indices may be reused."""
        synchronize()
        self.indices.reset()

    @staticmethod
    def _move(src: Any, dst: Any, src_rows: np.ndarray, dst_rows: np.ndarray,
              indices: PinnedIndices | None = None, wide: bool = True) -> None:
        """dst[dst_rows[i]] = src[src_rows[i]] for all i, one launch. wide=False forces the
        8-byte kernel (bench/gpu.py compares the two)."""
        import cupy
        n = len(src_rows)
        if n == 0:
            return
        words = src.shape[1]
        if indices is not None:
            sr, dr = indices.upload(src_rows), indices.upload(dst_rows)
        else:
            sr = cupy.asarray(np.asarray(src_rows, dtype=np.int64))
            dr = cupy.asarray(np.asarray(dst_rows, dtype=np.int64))
        threads = 256
        if wide and words % 2 == 0 and src.data.ptr % 16 == 0 and dst.data.ptr % 16 == 0:
            blocks = min(n, 1 << 16)
            _kernel("move_rows16")((blocks,), (threads,),
                                   (src, dst, sr, dr, np.int64(n), np.int64(words // 2)))
            return
        blocks = min(65535, max(1, (n * words + threads - 1) // threads))
        _kernel()((blocks,), (threads,), (src, dst, sr, dr, np.int64(n), np.int64(words)))

    def _release(self) -> None:
        import cupy
        cupy.cuda.runtime.hostUnregister(self.ptr)

    def close(self) -> None:
        if self.ptr:
            synchronize()
            self.indices.close()
            self._release()
            self.ptr = 0


class IpcPool(MappedSegment):
    """A worker's view of the service's HBM pool, opened from its CUDA IPC handle (ns_open's
    ``hbm``). Gets and puts with tier="hbm" move blocks between its slots and the worker's
    tensors device to device, by MappedSegment's gather and scatter. Opened with lazy peer
    access, so a worker on another GPU of the host reads it by peer copies where P2P is
    available (through host memory otherwise, which CUDA does for the kernel)."""

    _LAZY_PEER_ACCESS = 1            # cudaIpcMemLazyEnablePeerAccess

    def __init__(self, handle: bytes, n_slots: int, block_bytes: int) -> None:
        import cupy
        if block_bytes % 8:
            raise BadRequest("the CUDA path needs block_bytes that are a multiple of 8")
        self.ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle, self._LAZY_PEER_ACCESS)
        mem = cupy.cuda.UnownedMemory(self.ptr, n_slots * block_bytes, self)
        self.dev = cupy.ndarray((n_slots, block_bytes // 8), dtype=cupy.uint64,
                                memptr=cupy.cuda.MemoryPointer(mem, 0))
        self.indices = PinnedIndices()

    def _release(self) -> None:
        import cupy
        cupy.cuda.runtime.ipcCloseMemHandle(self.ptr)


def synchronize() -> None:
    import cupy
    cupy.cuda.get_current_stream().synchronize()


def warm(block_bytes: int = 16384) -> None:
    """Create the CUDA context and compile the transfer kernel before the first request."""
    import cupy
    src = cupy.zeros((2, block_bytes // 8), dtype=cupy.uint64)
    dst = cupy.empty_like(src)
    MappedSegment._move(src, dst, np.arange(2), np.arange(2))          # the 16-byte kernel
    odd = cupy.zeros((2, 1), dtype=cupy.uint64)
    MappedSegment._move(odd, cupy.empty_like(odd), np.arange(2), np.arange(2))   # 8-byte one
    synchronize()
