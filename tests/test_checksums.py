"""kvtier.checksums: the threaded hash of many blocks gives exactly the serial hashes."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvtier import checksums


@pytest.mark.parametrize("n, width", [(0, 4096), (1, 4096), (3, 1000), (64, 65536),
                                      (1000, 16384)])
def test_block_checksums_equal_the_serial_hashes(n: int, width: int):
    # Batches from below the threading threshold to well above it (64 x 64 KiB is 4 MiB),
    # on as many threads as this machine gets and on four.
    arr = np.random.default_rng(n).integers(0, 256, (n, width), dtype=np.uint8)
    want = [xxhash.xxh3_64_intdigest(arr[i]) for i in range(n)]
    assert checksums.block_checksums(arr).tolist() == want
    rows = list(range(n))[::-1]
    assert checksums.block_checksums(arr, rows).tolist() == want[::-1]
    checksums._threads_override = 4
    try:
        assert checksums.block_checksums(arr).tolist() == want
        assert checksums.block_checksums(arr, rows).tolist() == want[::-1]
    finally:
        checksums._threads_override = 0


def test_a_changed_byte_changes_only_its_block(monkeypatch):
    monkeypatch.setattr(checksums, "_PARALLEL_BYTES", 0)      # thread even a small batch,
    monkeypatch.setattr(checksums, "_PER_THREAD", 1)          # on any machine
    monkeypatch.setattr(checksums, "_threads_override", 4)
    arr = np.random.default_rng(7).integers(0, 256, (40, 4096), dtype=np.uint8)
    before = checksums.block_checksums(arr)
    arr[17, 4095] ^= 1
    after = checksums.block_checksums(arr)
    assert (before != after).tolist() == [i == 17 for i in range(40)]
