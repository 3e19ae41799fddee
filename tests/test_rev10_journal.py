"""An fdatasync that fails, then an acknowledged put in the same segment, then a crash (rev10,
review of session 34's merges; the window is older than session 34).

A write_through put is acknowledged once its batch is synced (coherence.flushes: "a batch's
sync also covers every batch written before it (a crash keeps a prefix)"), and at a restart
coherence.journal.replay walks a segment's batch headers from LMDB's mark and stops at the
first one that does not validate. When a batch's fdatasync fails, its put is refused and
its rows stay dirty, but the segment takes the next batch right after it. After a failed
writeback the kernel reports the error once and does not write those pages again: what lies
on the disk there is what was there before, here zeros (a fresh extent). A later batch's
fdatasync then succeeds and its put is acknowledged, but a replay stops at the hole, before
it: until the next checkpoint puts its records in LMDB, a crash loses an acknowledged put.

The fault is injected at one seam, because no file system here fails an fdatasync for real:
the backend's sync raises EIO once, and the crash image is the data directory copied with
the failed batch's bytes zeroed (what a failed writeback leaves on a fresh extent). The rest
is the real engine, its files and its restart."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest

from kvtier.coherence.engine import Engine
from kvtier.config import make_settings
from kvtier.errors import StorageError
from tests.conftest import blocks, keys

BB = 4096


def _engine(path: Path) -> Engine:
    return Engine(make_settings({"data_dir": str(path), "host_capacity": "4MiB",
                                 "nvme_capacity": "64MiB", "write_policy": "write_through",
                                 "checkpoint_interval": 3600}))


def test_a_put_acknowledged_after_a_failed_sync_in_its_segment_survives_a_crash(
        tmp_path: Path, monkeypatch):
    data, crashed = tmp_path / "data", tmp_path / "crashed"
    eng = _engine(data)
    eng.create_namespace("m", BB)
    eng.put("m", keys(range(16)), blocks(16, BB, 0))          # acknowledged: synced
    lg = eng.namespace("m").log
    seg = lg.segments[lg.active_id]
    real_sync, failed = lg.backend.sync, []

    def sync(fd: int) -> None:
        if not failed:
            failed.append(fd)
            raise OSError(errno.EIO, "Input/output error")   # the writeback failed
        real_sync(fd)
    monkeypatch.setattr(lg.backend, "sync", sync)
    start = seg.size
    with pytest.raises(StorageError):                        # refused: its rows stay dirty
        eng.put("m", keys(range(100, 116)), blocks(16, BB, 100))
    end = seg.size
    assert failed == [seg.fd] and end > start
    later = blocks(16, BB, 200)
    eng.put("m", keys(range(200, 216)), later)               # acknowledged
    shutil.copytree(data, crashed)                           # the crash
    eng.close(flush=False)
    with open(crashed / seg.path.relative_to(data), "r+b") as f:
        f.seek(start)
        f.write(bytes(end - start))      # the failed batch never reached the disk

    eng = _engine(crashed)
    try:
        found, out = eng.read("m", keys(range(200, 216)))
        assert found.all() and (out == later).all()          # on main: none found
        found, out = eng.read("m", keys(range(16)))
        assert found.all() and (out == blocks(16, BB, 0)).all()
    finally:
        eng.close(flush=False)
