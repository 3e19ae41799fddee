"""kvtier.checksums: the batch hash gives exactly xxh3-64 of each block, in either addressing."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvtier import checksums
from kvtier.checksums import block_checksums


@pytest.mark.parametrize("n, width", [(0, 4096), (1, 4096), (3, 1000), (64, 65536),
                                      (300, 512), (256, 4096)])     # the last two: the C loop
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


needs_lib = pytest.mark.skipif(checksums._fn is None or checksums._xxh is None,
                               reason="the system's libxxhash (libxxhash0) is not installed, or "
                                      "kvtier._xxh was not built")


@needs_lib
@pytest.mark.parametrize("n, width, threads", [(2, 65536, 2), (37, 4096, 4), (64, 1000, 8),
                                               (5, 1, 3), (300, 240, 8)])
def test_the_threaded_libxxhash_path_gives_python_xxhash_s_values(monkeypatch, n, width,
                                                                  threads):
    # Widths around XXH3's size classes (1, 240, 1000, 4096, 64 KiB), forced onto threads.
    monkeypatch.setattr(checksums, "PARALLEL_BYTES", 1)
    arr = np.random.default_rng(n * width).integers(0, 256, (n, width), dtype=np.uint8)
    want = [xxhash.xxh3_64_intdigest(arr[i].tobytes()) for i in range(n)]
    assert block_checksums(arr, threads=threads).tolist() == want
    rows = list(range(n))[::-2]
    assert block_checksums(arr, rows, threads=threads).tolist() == [want[r] for r in rows]
    view = np.random.default_rng(1).integers(0, 256, (n, 2 * width), dtype=np.uint8)[:, :width]
    assert block_checksums(view, threads=threads).tolist() == [      # rows with a gap between
        xxhash.xxh3_64_intdigest(view[i].tobytes()) for i in range(n)]


@needs_lib
def test_a_row_out_of_range_raises_on_the_threaded_path_too(monkeypatch):
    monkeypatch.setattr(checksums, "PARALLEL_BYTES", 1)
    arr = np.zeros((4, 4096), dtype=np.uint8)
    for bad in ([0, 4], [-1, 2]):          # no address outside the array is ever hashed
        with pytest.raises(IndexError):
            block_checksums(arr, bad, threads=4)
    with pytest.raises(IndexError):
        block_checksums(arr, [0, 4], threads=1)


def test_two_cores_or_no_libxxhash_hash_on_the_calling_thread(monkeypatch):
    monkeypatch.setattr(checksums.os, "sched_getaffinity", lambda _pid: {0, 1})
    assert checksums.usable_threads() == 1
    monkeypatch.setattr(checksums.os, "sched_getaffinity", lambda _pid: set(range(64)))
    native = checksums._fn is not None and checksums._xxh is not None
    assert checksums.usable_threads() == (checksums.MAX_THREADS if native else 1)
    monkeypatch.setattr(checksums, "_xxh", None)
    assert checksums.usable_threads() == 1


@needs_lib
@pytest.mark.parametrize("n, width", [(1, 1), (25, 1), (25, 240), (7, 4096), (255, 17)])
def test_a_small_batch_hashed_in_one_c_call_gives_the_python_loop_s_values(monkeypatch, n,
                                                                           width):
    # Below NATIVE_ROWS, rows of at most NATIVE_WIDTH go through _xxh.hash_slots (a put's
    # checksums); the python-xxhash loop is what it must equal, in every addressing.
    rng = np.random.default_rng(n + width)
    arr = rng.integers(0, 256, (3 * n, width), dtype=np.uint8)
    gapped = rng.integers(0, 256, (3 * n, width + 5), dtype=np.uint8)[:, :width]
    slots = rng.integers(0, 3 * n, n)
    for a in (arr, gapped):
        for rows in (None, slots, slots.astype(np.int32), slots.tolist()):
            got = block_checksums(a, rows)
            with monkeypatch.context() as m:
                m.setattr(checksums, "_xxh", None)
                want = block_checksums(a, rows)
            assert got.dtype == np.uint64 and got.tolist() == want.tolist()
            idx = range(a.shape[0]) if rows is None else rows
            assert got.tolist() == [xxhash.xxh3_64_intdigest(a[i].tobytes()) for i in idx]
    for bad in ([0, 3 * n], [-1, 0]):      # checked before any row is read
        with pytest.raises(IndexError):
            block_checksums(arr, np.array(bad))
    flipped = arr[::-1]                   # rows laid out backwards: the Python loop's
    assert block_checksums(flipped, [0]).tolist() == [xxhash.xxh3_64_intdigest(
        flipped[0].tobytes())]
