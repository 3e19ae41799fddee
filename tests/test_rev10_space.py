"""coherence.space's kept disk figure (fio7, session 34) taken while a segment file is between
SegmentLog's counted sets (rev10, review of session 34's merges).

capacity_now keeps (segment bytes + free disk bytes) from its last statvfs for DISK_CHECK_S
and takes the free space as that figure less used_bytes() in between: right only if
used_bytes() counts every segment file on disk at the moment of the statvfs. Two moments when
it does not, each open while another thread may ask the disk:

- a reclaimed segment whose last reader just ended (SegmentLog.unpin, an I/O thread, no
  writer): taken out of ``doomed`` into ``_going`` before its file is closed and unlinked;
  total_bytes() counts segments, doomed and spares, not ``_going``;
- a spare being made the next segment (SegmentLog._new_segment, under the writer, inside an
  append): popped from ``spares`` before two directory syncs, a header write and its
  fdatasync, and only then put into ``segments``.

Space.compaction_due() asks the disk without the writer (Flushes._finish_group calls it after
every batch, beside the next group's append), and since session 34 its answer is kept for the
writer's own make_room and fits too. A figure taken in either window is one segment low for
DISK_CHECK_S: on a disk-limited tier every flush then reclaims, or refuses, a segment's worth
that the disk holds. Before session 34 such a statvfs misled one compaction hint only.

Real engines on a real 8 MiB tmpfs; one seam each, only to force the thread interleaving (the
other thread's statvfs at that instant), which no single-threaded test can produce: the
backend's close of the unpinned file, and the directory sync of _new_segment."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

from kvtier.coherence import space
from kvtier.coherence.engine import Engine
from kvtier.config import make_settings
from kvtier.tiers import nvme
from tests.conftest import blocks, keys

BB = 4096




@pytest.fixture
def disk(tmp_path: Path, request) -> Path:
    """A real 8 MiB tmpfs (root only, as test_faults' 3 MiB one, where a spare is dropped for
    room at once): small enough that the disk, not nvme_capacity, sizes the tier."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)]
    if os.getuid() != 0 or subprocess.run(cmd, capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    request.addfinalizer(lambda: subprocess.run(["umount", "-l", str(mnt)], check=False))
    return mnt


def _reclaimed(root: Path, monkeypatch, held_by_a_reader: bool):
    """An engine whose first segment was just reclaimed, the kept figure never refreshed by
    time: (engine, namespace, space, log, the reader's pins or None)."""
    monkeypatch.setattr(space, "DISK_CHECK_S", 3600.0)
    # A 64 MiB capacity on an 8 MiB file system: capacity_now is what the disk holds.
    eng = Engine(make_settings({"data_dir": str(root / "data"), "host_capacity": "8MiB",
                                "nvme_capacity": "64MiB", "segment_bytes": "1MiB",
                                "write_policy": "write_through"}))
    eng.create_namespace("m", BB)
    for lo in range(0, 384, 64):                  # 1.5 MiB of records: two segments
        eng.put("m", keys(range(lo, lo + 64)), blocks(64, BB, lo))
    ns, sp = eng.namespace("m"), eng.nvme.space
    lg = ns.log
    sid = min(lg.segments)
    held = lg.pin(np.array([sid])) if held_by_a_reader else None   # a get's read in flight
    with eng.nvme.writer:
        sp.reclaim(ns, lg.segments[sid], keep_all=True)
    return eng, ns, sp, lg, held


def _kept_and_fresh(sp: space.Space) -> tuple[int, int]:
    kept = sp.capacity_now()
    sp.disk_changed()
    return kept, sp.capacity_now()


def test_a_figure_taken_while_the_last_reader_deletes_its_segment_is_not_kept_low(
        disk: Path, monkeypatch):
    eng, ns, sp, lg, held = _reclaimed(disk, monkeypatch, held_by_a_reader=True)
    sid = held[0].seg_id
    assert sid in lg.doomed                       # kept for its reader
    fd, real_close = held[0].fd, lg.backend.close

    def close(f: int) -> None:
        if f == fd:                               # between _going and the unlink:
            sp.disk_changed()                     # another thread's flush ends with the
            sp.compaction_due()                   # unlocked hint, which asks the disk
        real_close(f)
    monkeypatch.setattr(lg.backend, "close", close)
    lg.unpin(held)                                # the reader ends: the file is deleted
    assert sid not in lg.doomed and not lg._going
    kept, fresh = _kept_and_fresh(sp)
    assert fresh - kept <= space.DISK_MARGIN      # on main: low by the segment, 1 MiB
    eng.close(flush=False)


def test_a_figure_taken_while_a_spare_becomes_the_next_segment_is_not_kept_low(
        disk: Path, monkeypatch):
    eng, ns, sp, lg, _ = _reclaimed(disk, monkeypatch, held_by_a_reader=False)
    assert len(lg.spares) == 1                    # no reader: its file is kept as a spare
    real_sync = nvme._sync_dir
    asked: list[threading.Thread] = []

    def hint() -> None:
        sp.disk_changed()
        sp.compaction_due()

    def sync_dir(path: Path) -> None:
        if not lg.spares and not asked:           # the spare popped, not yet a segment:
            # the previous batch's thread ends with its unlocked hint. Waited for a while
            # only: a fix that makes it wait for the segment (the log's lock) ends it after.
            asked.append(threading.Thread(target=hint))
            asked[0].start()
            asked[0].join(timeout=1.0)
        real_sync(path)
    monkeypatch.setattr(nvme, "_sync_dir", sync_dir)
    before = len(lg.segments)
    for lo in range(1000, 1000 + 8 * 32, 32):     # puts until the next segment opens
        eng.put("m", keys(range(lo, lo + 32)), blocks(32, BB, lo))
        if len(lg.segments) > before or not lg.spares:
            break
    assert asked and not lg.spares                # the spare is a segment now
    asked[0].join()
    kept, fresh = _kept_and_fresh(sp)
    assert fresh - kept <= space.DISK_MARGIN      # on main: low by the spare, 1 MiB
    eng.close(flush=False)
