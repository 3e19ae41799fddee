"""A checkpoint's joined puts (pagetable.store._runs, fio7, session 34) in a real engine, then a
crash (rev10, review of session 34's merges).

With checkpoints held back (checkpoint_interval one hour), every write_through put's batch
waits in the journal: one put operation per flush, keys rewritten from one flush to the next,
so that a joined run names a key several times, oldest version first. A client delete then
commits them all in its checkpoint (joined into one put per run, the delete after them), and
the crash is the data directory copied right after it returns. At the restart nothing lies
past LMDB's marks, so what is served comes from the records the joined puts left: every key
must serve its last acknowledged bytes, and the deleted ones nothing."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np

from kvtier.coherence.engine import Engine
from kvtier.config import make_settings
from kvtier.pagetable.store import Catalog
from tests.conftest import blocks, keys

BB = 4096


def _engine(path: Path) -> Engine:
    return Engine(make_settings({"data_dir": str(path), "host_capacity": "4MiB",
                                 "nvme_capacity": "64MiB", "write_policy": "write_through",
                                 "checkpoint_interval": 3600}))


def test_a_checkpoint_of_rewritten_keys_keeps_each_keys_last_version(tmp_path: Path, caplog):
    data, crashed = tmp_path / "data", tmp_path / "crashed"
    eng = _engine(data)
    eng.create_namespace("m", BB)
    rng = np.random.default_rng(7)
    last: dict[int, np.ndarray] = {}
    for c in range(40):                           # 40 puts of 16 of 64 keys: ~10 rewrites each
        ids = sorted(rng.choice(64, 16, replace=False).tolist())
        data_ = blocks(16, BB, 1000 * c)
        eng.put("m", keys(ids), data_)
        last.update(zip(ids, data_))
    assert eng.nvme.journal.waiting >= 40 * 16    # nothing committed yet: one put a flush
    gone = [3, 17, 40]
    assert eng.delete("m", keys(gone)) == 3       # its checkpoint commits them all, joined
    assert eng.nvme.journal.waiting == 0
    shutil.copytree(data, crashed)                # the crash: every file as written
    eng.close(flush=False)

    cat = Catalog(crashed / "meta")               # LMDB itself: one record a key, the last
    rec = next(r for r in cat.namespaces() if r.name == "m")
    k, recs, bad = cat.load(rec.ns_id, rec.key_width)
    cat.close()
    assert bad == 0 and len(k) == len(last) - len(gone)
    caplog.set_level(logging.INFO, logger="kvtier.persist")
    eng = _engine(crashed)
    assert not [r for r in caplog.records if "replayed" in r.getMessage()]   # LMDB's alone
    for i in sorted(last):
        found, out = eng.read("m", keys([i]))
        if i in gone:
            assert not found[0], i
        else:
            assert found[0] and (out[0] == last[i]).all(), i
    eng.close(flush=False)

