"""tiers/_aio.c write_run (Aio.write_run): an NVMe append's chunk as PWRITEVs built in C
(issue 17, fio10). The records land in order, each request reports what it wrote, a refused
request reports its errno (SegmentLog turns it into StorageError), bad arguments are
refused before anything is written."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import StorageError
from kvtier.tiers import aio
from kvtier.tiers.nvme import SegmentLog

pytestmark = pytest.mark.skipif(aio._native is None or not aio.Aio.available(),
                                reason="kvtier.tiers._aio not built, or no native AIO")

REC = 8192


def _records(n: int) -> tuple[mmap.mmap, np.ndarray, np.ndarray]:
    buf = mmap.mmap(-1, n * REC)                   # page-aligned, as the pool's slots
    arr = np.frombuffer(buf, dtype=np.uint8).reshape(n, REC)
    arr[:] = np.random.default_rng(n).integers(0, 256, arr.shape, dtype=np.uint8)
    addrs = arr.ctypes.data + np.arange(n, dtype=np.int64) * REC
    return buf, arr, addrs


@pytest.mark.parametrize("n, per", [(1, 1), (17, 2), (17, 16), (5, 3), (16, 1)])
def test_a_run_of_records_lands_in_order_and_each_request_reports_its_bytes(tmp_path: Path,
                                                                           n: int, per: int):
    _buf, arr, addrs = _records(n)
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    ctx = aio.Aio(64)
    try:
        res = ctx.write_run(fd, 3 * REC, addrs, REC, per, window=4)
        want = [min(per, n - k) * REC for k in range(0, n, per)]
        assert res.tolist() == want
    finally:
        ctx.close()
        os.close(fd)
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    assert data.size == (3 + n) * REC
    assert (data[3 * REC:].reshape(n, REC) == arr).all()


def test_a_refused_request_reports_its_errno_and_the_log_raises(tmp_path: Path):
    _buf, _arr, addrs = _records(4)
    path = tmp_path / "ro"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    ctx = aio.Aio(64)
    try:
        res = ctx.write_run(fd, 0, addrs, REC, 2)
        assert res.tolist() == [-errno.EBADF, -errno.EBADF]
        with pytest.raises(ValueError):
            ctx.write_run(fd, 0, addrs, REC, 0)            # per < 1
        with pytest.raises(ValueError):
            ctx.write_run(fd, -REC, addrs, REC, 2)         # a negative offset
        with pytest.raises(ValueError):
            aio._native.write_run(ctx._ctx.value, 4, fd, 0, addrs, REC, 2,
                                  np.empty(1, dtype=np.int64))   # out of the wrong length
    finally:
        ctx.close()
        os.close(fd)
    assert path.stat().st_size == 0

    # Through a segment log: an append whose writes fail raises StorageError naming the file,
    # and what it appended reads back after the failure is gone.
    log = SegmentLog(tmp_path / "log", 1, REC, 1 << 20)
    if log._aio is None:
        pytest.skip("no native AIO on this file system")
    seg = log._active()
    real_fd = seg.fd
    seg.fd = os.open(seg.path, os.O_RDONLY)
    try:
        with pytest.raises(StorageError, match=str(seg.path.name)):
            log.append(_records(3)[1])
    finally:
        os.close(seg.fd)
        seg.fd = real_fd
    data = _records(3)[1]
    segs, offs = log.append(data)
    got = [np.empty(REC, dtype=np.uint8) for _ in range(3)]
    assert log.read(np.asarray(segs), np.asarray(offs), [memoryview(g) for g in got]).all()
    assert all((g == d).all() for g, d in zip(got, data))
    log.close()
