"""xxh3-64 of many blocks: the one place where kvtier hashes a batch.

Every committed block is hashed by the service, and a verifying client hashes what it copied.
This is the largest cost of a big put: on the H200 host a 4,096 x 64 KiB commit spends ~44 ms
hashing (bench/results/gpu-h200.json, commit_hash_gbps: 5.5-7 GB/s), on the development VM
~21 GB/s.

Threads were tried and measured, and are not used: xxhash releases the GIL, and two threads
hashed an in-cache 4 MiB buffer 1.93x as fast as one, but over the real case (a batch of slots
larger than the caches) eight threads gave 6.82 GB/s against 6.97 on the H200 host, and two
threads were slower than one on the 2-core VM (bench/api.py verified gets 8.5 -> 6.1 GB/s).
The hash of a batch is bound by memory there, not by one core.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import xxhash


def block_checksums(arr: np.ndarray, rows: Sequence[int] | None = None) -> np.ndarray:
    """xxh3-64 of arr[i] for each row i (or of arr[rows[i]]), as uint64, read in place.

    arr is 2-D (blocks x bytes). One pass over the bytes, no copy."""
    h = xxhash.xxh3_64_intdigest
    if rows is None:
        out = np.empty(arr.shape[0], dtype=np.uint64)
        for i in range(arr.shape[0]):
            out[i] = h(arr[i])
    else:
        out = np.empty(len(rows), dtype=np.uint64)
        for i, r in enumerate(rows):
            out[i] = h(arr[r])
    return out
