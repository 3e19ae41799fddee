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


@pytest.mark.parametrize("width", [1, 3, 64])
def test_the_c_write_writes_what_numpy_writes(width):
    """kvtier.tiers._slots against numpy's checked assignment: the same random batches (int64
    and int32 slots, repeats, empty batches, strided arrays, a broadcast row, a source inside
    the pool) leave the same bytes, and the same bad slots are refused with nothing written."""
    from kvtier.tiers import host
    if host._slots is None:
        pytest.skip("kvtier.tiers._slots is not built")
    rng = np.random.default_rng(width)
    a, b = SlotPool("a", width, 50, shared=False), SlotPool("b", width, 50, shared=False)
    for step in range(300):
        n = int(rng.integers(0, 12))
        slots = rng.integers(0, 50, n).astype(np.int64 if step % 2 else np.int32)
        data = rng.integers(0, 256, (n, width), dtype=np.uint8)
        if step % 37 == 5 and n:
            data = data[:1]                 # one row for every slot: numpy broadcasts it
        if step % 29 == 11 and n:
            slots = np.repeat(slots, 2)[::2]    # strided slots and rows: numpy's way
            data = np.repeat(data, 2, axis=1)[:, ::2] if data.shape[0] == n else data
        if step % 41 == 7 and n:
            data = a.array[: n]             # a's own rows: numpy copies them first
            b_data = b.array[: n].copy()
        else:
            b_data = data
        bad = step % 23 == 3 and n
        if bad:
            slots[int(rng.integers(0, n))] = -1 if step % 2 else 50
            with pytest.raises(BadRequest, match="slot out of range"):
                a.write(slots, data)
            with pytest.raises(BadRequest, match="slot out of range"):
                b._write_numpy(slots, b_data)
        else:
            a.write(slots, data)
            b._write_numpy(slots, b_data)
        assert np.array_equal(a.array, b.array), step
    a.close()
    b.close()


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


@pytest.mark.parametrize("text,policy", [
    ("always within_size [advise] never deny force\n", "advise"),
    ("always within_size advise [never] deny force\n", "never"),
    ("[always] [inherit\n", "always"),
    ("no brackets at all", "unavailable"),
    ("", "unavailable"),
    ("\xff\xfe]garbage[", "unavailable"),
])
def test_the_shmem_huge_page_policy_is_read_or_reported_unavailable(tmp_path, text, policy):
    from kvtier.memory import shmem_huge_pages
    f = tmp_path / "shmem_enabled"
    f.write_text(text)
    assert shmem_huge_pages(str(f)) == policy
    assert shmem_huge_pages(str(tmp_path / "missing")) == "unavailable"


def test_pools_ask_for_huge_pages_and_work_whatever_the_kernel_grants():
    # The advice is taken on Linux (MADV_HUGEPAGE); whether 2 MiB pages follow depends on the
    # host's shmem_enabled, which a test must not change. Either way the slots hold the bytes.
    from kvtier.memory import advise_huge_pages, shmem_huge_pages
    for shared in (True, False):
        pool = SlotPool("t", 4096, 1024, shared=shared)
        if shmem_huge_pages() != "unavailable":          # a kernel built with THP
            assert pool.huge_pages == hasattr(mmap, "MADV_HUGEPAGE")
        pool.write(np.array([1023, 0]), np.full((2, 4096), 5, dtype=np.uint8))
        assert (pool.read(np.array([0, 1023])) == 5).all()
        pool.close()
    closed = mmap.mmap(-1, 4096)
    closed.close()
    assert advise_huge_pages(closed) is False            # refused, not raised
    assert shmem_huge_pages() in ("never", "advise", "within_size", "always", "deny", "force",
                                  "unavailable")
