"""rev11's review of fio10's verify-as-reaped (kvtier/tiers/_reads.c): a verdict must say what
the destination row holds once the read returns, as the Python fallback's does (read_rows, then
block_checksums over the rows)."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from kvtier.checksums import block_checksums
from kvtier.tiers import reads
from kvtier.tiers.nvme import SegmentLog

pytestmark = pytest.mark.skipif(not reads.available(), reason="kvtier.tiers._reads not built "
                                "or no libxxhash: the Python read runs")

BB = 65536


def test_two_records_into_one_row_are_refused_or_verified_against_what_the_row_holds(
        tmp_path: Path):
    log = SegmentLog(tmp_path, 1, BB, 1 << 20)
    if log._aio_reads is None:
        pytest.skip("no native AIO on this file system")
    data = np.random.default_rng(5).integers(0, 256, (2, BB), dtype=np.uint8)
    segs, offs = (np.asarray(a) for a in log.append(data))
    pool = np.frombuffer(mmap.mmap(-1, 4 * BB), dtype=np.uint8).reshape(4, BB)
    held = log.pin(segs)
    try:
        try:
            batch = reads.record_batch(log, pool, np.array([0, 0]), segs, offs,
                                       block_checksums(data), held)
        except ValueError:
            return                          # refused: the caller's bug, said at once
        assert batch is not None
        # One request in flight at a time: the first record is reaped (and, before the
        # fix, verified) before the second lands over it.
        log._aio_reads.run_native(lambda ctx, depth: batch.run(ctx, 1, reads.XXH3_READ))
        ok = reads.verdicts(log, batch)
        for i in np.flatnonzero(ok).tolist():
            assert (pool[0] == data[i]).all(), f"record {i} passed, its row holds another"
    finally:
        log.unpin(held)
        log.close()
