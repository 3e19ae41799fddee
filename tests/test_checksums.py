"""kvtier.checksums: the batch hash gives exactly xxh3-64 of each block, in either addressing."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvtier.checksums import block_checksums


@pytest.mark.parametrize("n, width", [(0, 4096), (1, 4096), (3, 1000), (64, 65536)])
def test_block_checksums_equal_the_hash_of_each_block(n: int, width: int):
    arr = np.random.default_rng(n).integers(0, 256, (n, width), dtype=np.uint8)
    want = [xxhash.xxh3_64_intdigest(arr[i].tobytes()) for i in range(n)]
    assert block_checksums(arr).tolist() == want
    assert block_checksums(arr, list(range(n))[::-1]).tolist() == want[::-1]


def test_a_changed_byte_changes_only_its_block():
    arr = np.random.default_rng(7).integers(0, 256, (40, 4096), dtype=np.uint8)
    before = block_checksums(arr)
    arr[17, 4095] ^= 1
    assert (before != block_checksums(arr)).tolist() == [i == 17 for i in range(40)]
