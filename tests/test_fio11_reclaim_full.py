"""A reclaim whose copy-forward finds the disk full (issue 17, fio11): like a flush's append
(Flushes._disk_full), it makes coherence.space ask the file system again, so that the reclaims
and flushes after it see the capacity the disk really has instead of retrying copies forward
into room that the kept figure (capacity_now's DISK_CHECK_S window) still shows. The segment
stays and every block in it still reads back, before and after a restart."""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.coherence import space
from kvtier.coherence.engine import Engine
from kvtier.config import make_settings
from tests import test_faults
from tests.conftest import blocks, keys

BB = 4096
small_tmpfs = test_faults.small_tmpfs      # the fixture: a real 3 MiB tmpfs (root only)


def _fill_disk_but(root: Path, leave: int) -> int:
    """Someone else's file taking all but ``leave`` bytes of the file system. Its size."""
    st = os.statvfs(root)
    size = max(st.f_bavail * st.f_frsize - leave, 0)
    with open(root / "other", "wb") as fh:
        fh.write(bytes(size))
    return size


def test_a_reclaim_that_finds_the_disk_full_makes_the_figure_fresh(small_tmpfs: Path,
                                                                   monkeypatch):
    monkeypatch.setattr(space, "DISK_CHECK_S", 3600.0)   # only an event refreshes the figure
    settings = make_settings({"data_dir": str(small_tmpfs / "data"), "host_capacity": "8MiB",
                              "nvme_capacity": "64MiB", "segment_bytes": "1MiB",
                              "write_policy": "write_through"})
    eng = Engine(settings)
    eng.create_namespace("m", BB)
    data = blocks(320, BB)
    for lo in range(0, 320, 64):
        eng.put("m", keys(range(lo, lo + 64)), data[lo:lo + 64])
    ns = eng.namespace("m")
    sp = eng.nvme.space
    kept = sp.capacity_now()
    seg = ns.log.segments[min(s.seg_id for s in ns.log.sealed())]
    assert seg.live > 64
    other = _fill_disk_but(small_tmpfs, 64 << 10)        # less room than its live records need
    assert sp.capacity_now() == kept                     # not seen yet: the kept figure
    with eng.nvme.writer:
        sp.reclaim(ns, seg, keep_all=True)               # its append: ENOSPC
    assert seg.seg_id in ns.log.segments                 # not reclaimed: it stays
    assert sp.capacity_now() <= kept - other + space.DISK_MARGIN   # the disk asked again
    found, out = eng.read("m", keys(range(320)))
    assert found.all() and (out == data).all()
    eng.close(flush=False)
    eng = Engine(settings)
    found, out = eng.read("m", keys(range(320)))
    assert found.all() and (out == data).all()
    eng.close(flush=False)
