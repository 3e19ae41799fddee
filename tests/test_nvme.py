"""The NVMe segment log: append, read back, roll-over, O_DIRECT alignment, damage, bad dirs."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import DataDirError
from kvtier.tiers.nvme import HEADER_BYTES, SegmentLog


def _blocks(n: int, size: int) -> list[memoryview]:
    rng = np.random.default_rng(n)
    return [memoryview(rng.integers(0, 256, size, dtype=np.uint8).tobytes()) for _ in range(n)]


@pytest.mark.parametrize("block_bytes", [4096, 65536, 1000])
def test_append_then_read_back(tmp_path: Path, block_bytes: int):
    log = SegmentLog(tmp_path, 1, block_bytes, 1 << 20)
    data = _blocks(40, block_bytes)
    segs, offs = log.append(data)
    outs = [memoryview(bytearray(block_bytes)) for _ in data]
    ok = log.read(segs, offs, outs)
    assert ok.all()
    assert [bytes(o) for o in outs] == [bytes(d) for d in data]
    assert log.live_bytes() == 0      # liveness is the caller's bookkeeping
    log.close()


def test_segments_roll_over_and_survive_reopen(tmp_path: Path):
    log = SegmentLog(tmp_path, 1, 65536, 1 << 20)
    data = _blocks(40, 65536)
    segs, offs = log.append(data)
    assert len(set(segs.tolist())) == 3      # 15 records of 64 KiB per 1 MiB segment
    log.close()
    log = SegmentLog(tmp_path, 1, 65536, 1 << 20)
    outs = [memoryview(bytearray(65536)) for _ in data]
    assert log.read(segs, offs, outs).all()
    assert bytes(outs[-1]) == bytes(data[-1])
    log.close()


def test_truncated_segment_reads_fail_instead_of_returning_garbage(tmp_path: Path):
    log = SegmentLog(tmp_path, 1, 4096, 1 << 20)
    segs, offs = log.append(_blocks(4, 4096))
    log.close()
    path = next(tmp_path.glob("seg-*.kvt"))
    os.truncate(path, HEADER_BYTES + 2 * 4096 + 100)
    log = SegmentLog(tmp_path, 1, 4096, 1 << 20)
    ok = log.read(segs, offs, [memoryview(bytearray(4096)) for _ in range(4)])
    assert ok.tolist() == [True, True, False, False]
    log.close()


def test_foreign_file_in_the_segment_directory_is_a_clear_error(tmp_path: Path):
    (tmp_path / "seg-00000001.kvt").write_bytes(b"not a segment" * 1000)
    with pytest.raises(DataDirError, match="not a kvtier segment"):
        SegmentLog(tmp_path, 1, 4096, 1 << 20)


def test_unwritable_directory_is_a_clear_error(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DataDirError, match="cannot create NVMe directory"):
        SegmentLog(blocker / "nvme", 1, 4096, 1 << 20)


def test_compaction_candidates_follow_live_bytes(tmp_path: Path):
    log = SegmentLog(tmp_path, 1, 65536, 1 << 20)
    segs, _ = log.append(_blocks(30, 65536))
    log.add_live(segs)
    first = int(segs[0])
    log.add_live(segs[segs == first][:12], -1)
    assert log.compaction_candidates(0.5) == [first]
    assert log.remove(first) > 0 and first not in log.segments
    log.close()
