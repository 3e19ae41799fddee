"""The host tier's slot pool: a memfd that another mapping sees, a free list, bad slots."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from kvtier.errors import BadRequest, CapacityError
from kvtier.tiers.host import SlotPool


def test_slots_are_visible_through_a_second_mapping_of_the_fd():
    pool = SlotPool("t", 4096, 8)
    pool.write(np.array([3]), np.full((1, 4096), 7, dtype=np.uint8))
    fd = os.dup(pool.fd)
    mm = mmap.mmap(fd, 8 * 4096, mmap.MAP_SHARED, mmap.PROT_READ)
    assert mm[3 * 4096: 3 * 4096 + 4] == b"\x07" * 4
    mm.close()
    os.close(fd)
    pool.close()


def test_alloc_fills_from_slot_zero_and_returns_none_when_short():
    pool = SlotPool("t", 64, 4)
    assert pool.alloc(3).tolist() == [0, 1, 2]
    assert pool.alloc(2) is None            # an expected shortage, not an exception
    pool.free(np.array([1]))
    assert pool.alloc(2).tolist() == [1, 3]
    pool.close()


def test_double_free_is_caught():
    pool = SlotPool("t", 64, 2)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(np.array([0]))
    pool.close()


def test_out_of_range_slot_is_a_bad_request():
    pool = SlotPool("t", 64, 2)
    with pytest.raises(BadRequest, match="slot out of range"):
        pool.read(np.array([2]))
    with pytest.raises(BadRequest):
        pool.write(np.array([-1]), np.zeros((1, 64), dtype=np.uint8))
    pool.close()


def test_wrong_block_size_and_empty_pool_are_refused():
    with pytest.raises(BadRequest):
        SlotPool("t", 0, 2)
    with pytest.raises(CapacityError, match="raise host_capacity"):
        SlotPool("t", 64, 0)


def test_slot_view_is_zero_copy():
    pool = SlotPool("t", 16, 2)
    pool.slot_view(1)[:] = b"a" * 16
    assert pool.array[1].tobytes() == b"a" * 16
    pool.close()
