"""xxh3-64 of many blocks, hashed by several threads at once.

Every committed block is hashed by the service, and a verifying client hashes what it copied.
On one core that was the largest cost of a big put: 38-44 ms of the ~51 ms that a 256 MiB GPU
offload took on the H200 host (bench/results/gpu-h200.json). xxhash releases the GIL while it
hashes, so threads scale: two threads hashed two 4 MiB buffers 1.93x as fast as one on the
2-core development VM.

A batch is split into contiguous runs of rows, one per thread, only when it is large enough for
the hand-off (tens of microseconds) to pay: at least _PARALLEL_BYTES in all and _PER_THREAD
bytes per thread. The pool is made on first use and is not fork-safe: a forked child must not
use a parent's pool (kvtier never forks after hashing).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import xxhash

_PARALLEL_BYTES = 1 << 20
_PER_THREAD = 512 << 10
_MAX_THREADS = 8
_MIN_CPUS = 4
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def threads() -> int:
    """Threads a large batch is hashed by: the CPUs this process may run on, at most 8, and
    one below _MIN_CPUS. On the 2-core development VM, where the service and its workers
    share two cores, hashing on two threads made bench/api.py slower (verified gets 8.5 ->
    6.1 GB/s, puts 3.5 -> 2.7 GB/s): the hand-off and the other process's core cost more
    than half a hash saves."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return 1 if n < _MIN_CPUS else min(n, _MAX_THREADS)


def _threads_now() -> int:
    return _threads_override or threads()


_threads_override = 0          # tests set it to thread a batch on any machine


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(_threads_now(), 2),
                                       thread_name_prefix="kvtier-xxh3")
        return _pool


def _hash_rows(arr: np.ndarray, rows: Sequence[int] | None, lo: int, hi: int,
               out: np.ndarray) -> None:
    h = xxhash.xxh3_64_intdigest
    if rows is None:
        for i in range(lo, hi):
            out[i] = h(arr[i])
    else:
        for i in range(lo, hi):
            out[i] = h(arr[rows[i]])


def block_checksums(arr: np.ndarray, rows: Sequence[int] | None = None) -> np.ndarray:
    """xxh3-64 of arr[i] for each row i (or of arr[rows[i]]), as uint64, read in place.

    arr is 2-D (blocks x bytes). Costs one pass over the bytes, spread over threads() threads
    for batches of a megabyte or more."""
    n = arr.shape[0] if rows is None else len(rows)
    out = np.empty(n, dtype=np.uint64)
    if n == 0:
        return out
    row_bytes = arr.shape[1] * arr.itemsize if arr.ndim > 1 else arr.itemsize
    workers = min(_threads_now(), n, n * row_bytes // _PER_THREAD)
    if workers <= 1 or n * row_bytes < _PARALLEL_BYTES:
        _hash_rows(arr, rows, 0, n, out)
        return out
    bounds = np.linspace(0, n, workers + 1).astype(int)
    pool = _get_pool()
    futures = [pool.submit(_hash_rows, arr, rows, int(lo), int(hi), out)
               for lo, hi in zip(bounds[:-1], bounds[1:])]
    for f in futures:
        f.result()
    return out
