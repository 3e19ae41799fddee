"""kvtier.api.segment: a worker's read-only mapping with write windows, on a real memfd."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvtier.api.segment import SegmentMap


@pytest.fixture
def seg():
    def make(block_bytes: int, n: int) -> SegmentMap:
        fd = os.memfd_create("kvtier-test")
        os.ftruncate(fd, n * block_bytes)
        return SegmentMap(fd, n * block_bytes, block_bytes)
    made: list[SegmentMap] = []
    yield lambda bb, n: made.append(make(bb, n)) or made[-1]
    for m in made:
        m.close()


def test_windows_cover_runs_and_merge_only_small_gaps(seg):
    m = seg(65536, 64)                                      # gaps up to 4 slots are merged
    assert m._runs(np.array([5, 3, 4, 9, 20, 21])) == [(3 * 65536, 10 * 65536),
                                                        (20 * 65536, 22 * 65536)]
    assert m._runs(np.array([], dtype=np.int32)) == []
    small = seg(1000, 4096)                                 # 256 slots of gap merged
    assert small._runs(np.array([0, 200, 700])) == [(0, 201 * 1000), (700 * 1000, 701 * 1000)]


@pytest.mark.parametrize("block_bytes", [4096, 65536, 1000])
def test_write_puts_bytes_only_in_the_named_slots_and_the_view_stays_read_only(seg, block_bytes):
    m = seg(block_bytes, 300)
    rng = np.random.default_rng(block_bytes)
    slots = rng.permutation(300)[:40].astype(np.int32)
    src = rng.integers(1, 256, (40, block_bytes), dtype=np.uint8)
    m.write(slots, src)
    assert (m.view[slots] == src).all()
    others = np.setdiff1d(np.arange(300), slots)
    assert not m.view[others].any()                         # untouched slots stay zero
    with pytest.raises(ValueError, match="read-only"):
        m.view[0, 0] = 1
    m.write(slots[:3], src[3:6])                            # windows reopen for a rewrite
    assert (m.view[slots[:3]] == src[3:6]).all()
