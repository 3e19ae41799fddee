"""xxh3-64 of many blocks: the one place where kvtier hashes a batch.

Every committed block is hashed by the service, and a verifying client hashes what it copied.
This was the largest cost of a big put: on the H200 host a 4,096 x 64 KiB commit spent ~44 ms
hashing with python-xxhash (bench/gpu.py's commit_hash_gbps: 5.5-7 GB/s; 62.6 since this
change), on the development VM ~21 GB/s.

That figure was once put down to memory bandwidth, wrongly. On the H200 host (bench/hash.py,
bench/results/hash-h200.json) python-xxhash hashed 256 MiB at 6.9 GB/s on one thread and 6.1 on
sixteen (and in cache, 16 GB/s whatever the threads): its calls hold the GIL. numpy's copy of
the same rows, which releases it, went from 9.6 GB/s on one thread to 36 GB/s on sixteen, and
this module's threaded hash from 7.3 to 61.9 GB/s (56.5 over pinned pages a GPU had just
written). So large batches are hashed here by the system's libxxhash (Debian and Ubuntu's
libxxhash0: the same XXH3 as python-xxhash's, whose output is fixed since xxHash 0.8.0, and
checked against it at import) on a small thread pool, each thread hashing its share of the rows
in one call of the C helper kvtier/_xxh.c with the GIL released. Calling libxxhash through
ctypes one block at a time took the GIL back every 4 us and stopped scaling at 4 threads.

When threads are used: a batch of at least PARALLEL_BYTES, a machine with at least 4 usable
cores, libxxhash and the C helper. On the 2-core VM two threads were slower than one
(bench/api.py verified gets 8.5 -> 6.1 GB/s), so it keeps one thread. On one thread the C loop
takes batches of many small rows (NATIVE_ROWS, NATIVE_WIDTH), where python-xxhash's per-call
cost dominates, and a small batch of such rows goes through one call of _xxh.hash_slots (25
one-byte rows: 0.5 us against 14 for the loop on the dev VM); batches of larger rows go
through python-xxhash, as before. Thread safety: the workers
only read the blocks, and block_checksums returns only after all of them have stopped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Sequence

import numpy as np
import xxhash

PARALLEL_BYTES = 16 << 20          # below this a batch is hashed on the calling thread
# On one thread the C loop wins only where python-xxhash's per-call cost dominates: many small
# rows (dev VM, 4,096 rows: 512 B 237 against 1,200 us, 4 KiB 1.5 against 2.0 ms). For rows of
# 8 KiB or more, or a few rows, python-xxhash's own build is faster (1.5-2x in cache on the dev
# VM: Debian's libxxhash is a baseline SSE2 build).
NATIVE_ROWS = 256
NATIVE_WIDTH = 4096
MAX_THREADS = 16


# numpy names the hot paths read as globals (why: kvtier.pagetable.table, at _empty).
(_I64, _U64, _contiguous, _empty, _ndarray) = (
    np.int64, np.uint64, np.ascontiguousarray, np.empty, np.ndarray)


def _load() -> int | None:
    """The address of libxxhash's XXH3_64bits, once it has hashed a probe as python-xxhash
    does; None where the library is missing or disagrees."""
    name = ctypes.util.find_library("xxhash")
    if not name:
        return None
    try:
        fn = ctypes.CDLL(name).XXH3_64bits
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_uint64
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    probe = b"kvtier checks libxxhash against python-xxhash"
    if fn(probe, len(probe)) != xxhash.xxh3_64_intdigest(probe):
        return None                    # not the XXH3 python-xxhash computes: never use it
    return ctypes.cast(fn, ctypes.c_void_p).value


_fn = _load()
# The address of libxxhash's XXH3_64bits, checked against python-xxhash (None without it): for
# C code that hashes blocks itself (kvtier.pagetable._native.put_rows), the same function
# block_checksums calls, so the same checksums.
XXH3_ADDRESS: int | None = _fn
try:
    from kvtier import _xxh
except ImportError:                   # not built: every batch goes through python-xxhash
    _xxh = None
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def usable_threads() -> int:
    """Threads a large batch is hashed on here: 1 without libxxhash or the C helper, or below
    4 cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    if _fn is None or _xxh is None or cores < 4:
        return 1
    return min(MAX_THREADS, cores)


def block_checksums(arr: np.ndarray, rows: Sequence[int] | np.ndarray | None = None,
                    threads: int | None = None, release_gil: bool = False) -> np.ndarray:
    """xxh3-64 of arr[i] for each row i (or of arr[rows[i]]), as uint64, read in place.

    arr is 2-D (blocks x bytes). One pass over the bytes, no copy. threads: how many to hash a
    large batch on (default usable_threads(); the tests force the threaded path with it).
    release_gil: hash in C with the GIL released even where python-xxhash would be faster on
    this thread, so that the service's other threads run meanwhile (an NVMe get's verify on
    a worker thread: 56 x 64 KiB held the GIL ~0.5 ms on the dev VM, issue 17)."""
    n = arr.shape[0] if rows is None else len(rows)
    if _fn is not None and _xxh is not None and n >= 1 and arr.strides[1] == 1:
        if n * arr.shape[1] >= PARALLEL_BYTES:       # only then is the core count asked for
            threads = usable_threads() if threads is None else threads
            if threads > 1:
                return _in_c(arr, rows, n, threads)
        if release_gil or (n >= NATIVE_ROWS and arr.shape[1] <= NATIVE_WIDTH):
            return _in_c(arr, rows, n, 1)
        if arr.shape[1] <= NATIVE_WIDTH and arr.strides[0] >= 0:
            # A small batch of small rows (a put's 25 blocks of the replay): one C call,
            # bounds checked there, in place of a python-xxhash call per row.
            idx = (np.arange(n, dtype=_I64) if rows is None
                   else _contiguous(rows, dtype=_I64))
            out = _empty(n, dtype=_U64)
            _xxh.hash_slots(_fn, arr, idx, out)
            return out
    h = xxhash.xxh3_64_intdigest
    out = _empty(n, dtype=_U64)
    if rows is None:
        for i in range(n):
            out[i] = h(arr[i])
    else:
        for i, r in enumerate(rows.tolist() if isinstance(rows, _ndarray) else rows):
            out[i] = h(arr[r])
    return out


def _in_c(arr: np.ndarray, rows: Sequence[int] | None, n: int, threads: int) -> np.ndarray:
    """The rows hashed by kvtier/_xxh.c, split over threads (1: on the calling thread)."""
    idx = np.arange(n, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= arr.shape[0]):
        raise IndexError(f"row out of range for {arr.shape[0]} blocks")
    if arr.strides[0] < 0:
        raise ValueError("rows must be laid out forwards in memory")
    base, stride, width = arr.ctypes.data, arr.strides[0], arr.shape[1]
    out = np.empty(n, dtype=np.uint64)

    def part(lo: int, hi: int) -> None:
        _xxh.hash_rows(_fn, base, stride, width, idx[lo:hi], out[lo:hi])

    if threads <= 1:
        part(0, n)
        return out
    step = -(-n // threads)
    futures = [_executor().submit(part, lo, min(lo + step, n)) for lo in range(0, n, step)]
    wait(futures)                      # every part has stopped reading arr before we return
    for f in futures:
        f.result()
    return out


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="kvtier-hash")
        return _pool
