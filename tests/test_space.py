"""coherence.space's view of the disk: capacity_now asks the file system at most every
DISK_CHECK_S and follows the store's own appends and removals in between; an append that finds
the disk full, or spares dropped for room, make it ask again at once (issue 17, fio7)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from kvtier.coherence import space
from kvtier.coherence.engine import Engine
from kvtier.config import make_settings
from tests.conftest import blocks, key, keys
from tests import test_faults
from tests.test_faults import _fill

BB = 4096
small_tmpfs = test_faults.small_tmpfs      # the fixture: a real 3 MiB tmpfs (root only)


@pytest.fixture
def statvfs_calls(monkeypatch) -> list[str]:
    """Every shutil.disk_usage call, by path (the real one runs)."""
    calls: list[str] = []
    real = shutil.disk_usage

    def counted(path):
        calls.append(str(path))
        return real(path)
    monkeypatch.setattr(shutil, "disk_usage", counted)
    return calls


def test_puts_ask_the_disk_once_per_interval(tmp_path: Path, monkeypatch, statvfs_calls):
    monkeypatch.setattr(space, "DISK_CHECK_S", 3600.0)
    eng = Engine(make_settings({"data_dir": str(tmp_path), "host_capacity": "2MiB",
                                "nvme_capacity": "64MiB", "write_policy": "write_through"}))
    eng.create_namespace("m", BB)
    for lo in range(0, 640, 16):                  # 40 write_through puts of 16 blocks
        eng.put("m", keys(range(lo, lo + 16)), blocks(16, BB, lo))
    assert len(statvfs_calls) == 1                # before: two a put (make_room, compaction)
    eng.nvme.space.disk_changed()
    eng.nvme.space.capacity_now()
    assert len(statvfs_calls) == 2
    eng.close(flush=False)


def test_between_asks_the_figure_follows_the_stores_own_bytes(small_tmpfs: Path, monkeypatch):
    # A 3 MiB file system under a 64 MiB capacity: capacity_now is what the disk holds. Puts
    # and the reclaims they force (segments removed) move used_bytes and the free space by
    # the same bytes, so the figure kept from the first ask stays what a fresh ask gives,
    # within what LMDB wrote meanwhile (DISK_MARGIN's part).
    monkeypatch.setattr(space, "DISK_CHECK_S", 3600.0)
    eng = Engine(make_settings({"data_dir": str(small_tmpfs / "data"), "host_capacity": "8MiB",
                                "nvme_capacity": "64MiB", "segment_bytes": "1MiB"}))
    eng.create_namespace("m", BB)
    sp = eng.nvme.space
    first = sp.capacity_now()
    for lo in range(0, 256, 64):
        eng.put("m", keys(range(lo, lo + 64)), blocks(64, BB, lo))
    kept = sp.capacity_now()
    assert kept < 3 << 20 and eng.nvme.used_bytes() > 0
    sp.disk_changed()
    fresh = sp.capacity_now()
    assert abs(kept - fresh) <= space.DISK_MARGIN and abs(first - fresh) <= space.DISK_MARGIN
    eng.close(flush=False)


def test_an_append_that_finds_the_disk_full_makes_the_figure_fresh(small_tmpfs: Path,
                                                                   monkeypatch):
    # The kept figure is never refreshed by time here: only an append's ENOSPC
    # (Flushes._disk_full) makes the flush ask the disk again, and then reclaim into what it
    # has. Every acknowledged block it kept is durable, as in test_faults.
    monkeypatch.setattr(space, "DISK_CHECK_S", 3600.0)
    settings = make_settings({"data_dir": str(small_tmpfs / "data"), "host_capacity": "8MiB",
                              "nvme_capacity": "64MiB", "segment_bytes": "1MiB"})
    eng = Engine(settings)
    eng.create_namespace("m", BB)
    sp = eng.nvme.space
    first = sp.capacity_now()                     # the figure from an empty disk, kept
    (small_tmpfs / "other").write_bytes(bytes(1 << 20))   # someone else's file, after it
    assert sp.capacity_now() == first             # not seen yet: the window DISK_CHECK_S is
    data = blocks(1024, BB)
    acked, _failed = _fill(eng, data)
    assert eng.stats()["nvme_full"] > 0
    assert sp.capacity_now() <= first - (1 << 20) + space.DISK_MARGIN    # seen now
    # (a refused put's blocks stay dirty in the host tier: only acknowledged ones count)
    kept = [i for lo in acked for i in range(lo, lo + 64) if eng.entry("m", key(i)) is not None]
    assert kept
    eng.close(flush=False)
    eng = Engine(settings)
    for i in kept:
        found, out = eng.read("m", key(i))
        assert found[0] and (out[0] == data[i]).all()
    eng.close(flush=False)


def test_reclaims_read_into_one_kept_buffer_and_every_moved_block_reads_back(tmp_path: Path):
    settings = make_settings({"data_dir": str(tmp_path), "host_capacity": "1MiB",
                              "nvme_capacity": "6MiB", "segment_bytes": "1MiB",
                              "write_policy": "write_through"})
    eng = Engine(settings)
    eng.create_namespace("m", BB)
    sp = eng.nvme.space
    rng = np.random.default_rng(5)
    last: dict[int, np.ndarray] = {}
    bufs = set()
    for c in range(300):                          # 16-block rewrites of 1,200 keys
        ids = sorted(rng.choice(1200, 16, replace=False).tolist())
        data = blocks(16, BB, c)
        eng.put("m", keys(ids), data)
        last.update(zip(ids, data))
        if sp._buf is not None:
            bufs.add(id(sp._buf))
    assert sp.reclaimed >= 3 and sp.copied_forward > 0
    assert len(bufs) == 1                         # kept, never mapped again
    eng.close(flush=False)
    eng = Engine(settings)
    held = [i for i in sorted(last) if eng.entry("m", key(i)) is not None]
    assert len(held) > 100
    for lo in range(0, len(held), 64):            # 64 at a time: the host tier holds 256
        part = held[lo:lo + 64]
        found, out = eng.read("m", keys(part))
        assert found.all() and all((out[j] == last[i]).all() for j, i in enumerate(part))
    eng.close(flush=False)
