"""The C read's verify (kvtier/tiers/_reads.c, issue 17, fio10): each record is hashed as its
read completes, with the dispatching XXH3 where libxxhash has it (tiers.reads.XXH3_READ). The
verdicts must be those of read-everything-then-hash with kvtier.checksums' XXH3: a torn record
anywhere in the batch refused, every other one verified, whatever order the reads complete in."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvtier import _xxh, checksums
from kvtier.tiers import reads
from kvtier.tiers.nvme import SegmentLog
from tests.test_reads import _log_with, _pool

pytestmark = pytest.mark.skipif(not reads.available() or _xxh is None,
                                reason="kvtier.tiers._reads or kvtier._xxh not built, or no "
                                "libxxhash: the Python read runs")

def test_the_reads_xxh3_hashes_every_size_as_python_xxhash_does():
    # Sizes on both sides of XXH3's size classes (0-16, 17-128, 129-240, longer: stripes of
    # 64 bytes, blocks of 1,024) and odd tails: one mismatch would refuse good records or,
    # worse, pass torn ones.
    rng = np.random.default_rng(3)
    sizes = [0, 1, 16, 17, 128, 129, 240, 241, 1023, 1024, 1025, 65536, 65536 + 63]
    sizes += rng.integers(1, 200_000, 40).tolist()
    width = max(sizes)
    arr = rng.integers(0, 256, (len(sizes), width), dtype=np.uint8)
    out = np.empty(1, dtype=np.uint64)
    for i, size in enumerate(sizes):
        _xxh.hash_rows(reads.XXH3_READ, arr.ctypes.data + i * width, 0, size,
                       np.zeros(1, dtype=np.int64), out)
        assert int(out[0]) == xxhash.xxh3_64_intdigest(arr[i, :size].tobytes()), size


def _tear(log: SegmentLog, seg: int, off: int) -> None:
    fd = os.open(log.segments[seg].path, os.O_WRONLY)
    try:
        os.pwrite(fd, b"torn" * 1024, off * 4096)
    finally:
        os.close(fd)


@pytest.mark.parametrize("window", [1, 3, 16])
@pytest.mark.parametrize("xxh3", ["read", "checksums"])
def test_torn_records_anywhere_are_refused_as_each_read_lands(tmp_path: Path, window: int,
                                                              xxh3: str):
    # Window 1 and 3: the records complete over many reaps, each verified in its own; 16: in
    # one or a few. Both XXH3 entries (the dispatching one, the baseline checksums takes)
    # give the same verdicts.
    fn = reads.XXH3_READ if xxh3 == "read" else checksums._fn
    log, data, segs, offs, sums = _log_with(tmp_path, 16)
    torn = [0, 7, 15]
    for i in torn:
        _tear(log, int(segs[i]), int(offs[i]))
    rows = np.random.default_rng(5).permutation(24)[:16]
    pool = _pool(24)
    held = log.pin(segs)
    try:
        batch = reads.record_batch(log, pool, rows, segs, offs, sums, held)
        log._aio_reads.run_native(lambda ctx, depth: batch.run(ctx, min(window, depth), fn))
        ok = reads.verdicts(log, batch)
        assert ok.tolist() == [i not in torn for i in range(16)]
        for i in range(16):
            if i not in torn:
                assert (pool[rows[i]] == data[i]).all()
        # The same batch read again after the records were made whole: all verified now
        # (each run's verdicts are its own).
        for i in torn:
            fd = os.open(log.segments[int(segs[i])].path, os.O_WRONLY)
            os.pwrite(fd, data[i].tobytes(), int(offs[i]) * 4096)
            os.close(fd)
        log._aio_reads.run_native(lambda ctx, depth: batch.run(ctx, min(window, depth), fn))
        assert reads.verdicts(log, batch).all()
    finally:
        log.unpin(held)
        log.close()
