"""rev9: the journal's marks against a reclaimed segment's removal (kvtier.tiers.nvme
SegmentLog.marks, unpin, remove) when a checkpoint runs between the two.

A reader's unpin (an I/O thread, no engine lock) and a checkpoint (the writer's lock) run
concurrently. unpin takes the last reader's segment out of ``doomed`` under the log's lock and
unlinks its file after it; a checkpoint in between recorded marks without the segment and
without syncing for its removal, so a crash before the unlink left the file, with no mark, for
the restart to replay from its start (deleted keys back with their oldest bytes).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from kvtier.coherence.engine import Engine
from kvtier.config import make_settings
from tests.conftest import keys
from tests.test_journal import BB, block


def _engine(path: Path) -> Engine:
    return Engine(make_settings({"data_dir": str(path), "host_capacity": str(64 * BB),
                                 "nvme_capacity": "4MiB", "segment_bytes": "1MiB",
                                 "compact_threshold": 0.5, "checkpoint_interval": 3600}))


def test_a_checkpoint_between_the_last_unpin_and_the_unlink_keeps_the_segments_mark(
        tmp_path: Path):
    # The interleaving is forced at one seam: the backend's close of the doomed file (the
    # step of SegmentLog._delete before its unlink) runs a delete (a checkpoint) and then
    # copies the data directory, the crash. Everything else is the real engine.
    data = tmp_path / "data"
    eng = _engine(data)
    eng.create_namespace("m", BB)
    for lo in range(0, 200, 50):
        eng.put("m", keys(range(lo, lo + 50)), np.stack([block(i, 0) for i in range(lo, lo + 50)]))
    eng.flush()
    lg = eng.namespace("m").log
    first = min(lg.segments)
    held = lg.pin(np.array([first]))                     # a read in flight on it
    for gen in (1, 2, 3):                                # every record of it dead: reclaimed
        for lo in range(0, 200, 50):
            eng.put("m", keys(range(lo, lo + 50)),
                    np.stack([block(i, gen) for i in range(lo, lo + 50)]))
        eng.flush()
    assert first in lg.doomed
    doomed_fd = lg.doomed[first].fd
    real_close = lg.backend.close
    crashed = tmp_path / "crashed"

    def close(fd: int) -> None:
        if fd == doomed_fd and not crashed.exists():
            assert eng.delete("m", keys(range(10))) == 10      # a checkpoint, durable
            shutil.copytree(data, crashed)
        real_close(fd)
    lg.backend.close = close
    lg.unpin(held)                                       # the last reader: the file goes
    assert crashed.exists() and first not in lg.doomed
    eng.close(flush=False)
    eng = _engine(crashed)
    try:
        parts = [eng.read("m", keys(range(lo, lo + 25))) for lo in range(0, 200, 25)]
        found = np.concatenate([f for f, _ in parts])
        out = np.concatenate([o for _, o in parts])
        gen0 = np.stack([block(i, 0) for i in range(10)])
        assert not (found[:10] & (out[:10] == gen0).all(axis=1)).any()   # no first version
        assert not found[:10].any()                      # deleted stays deleted
        assert found[10:].all()
        assert (out[10:] == np.stack([block(i, 3) for i in range(10, 200)])).all()
    finally:
        eng.close(flush=False)
