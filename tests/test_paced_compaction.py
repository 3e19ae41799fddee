"""Compaction after a flush is paced (coherence.space.Space.compact; issue 17, session 41).

A flush that finds the NVMe tier past compaction's mark reclaims the emptiest candidate, and
more only until it has freed what it wrote: the candidates are reclaimed one flush at a
time, never all in one put's flush (ten reclaims, 172-190 ms, in one of ~50 puts of the randrw
fio jobs before). Every block stays readable, before and after a restart."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvtier.coherence.engine import Engine
from kvtier.config import make_settings
from tests.conftest import blocks, keys

BB = 4096


def _engine(path: Path) -> Engine:
    eng = Engine(make_settings({"data_dir": str(path), "host_capacity": "1MiB",
                                "nvme_capacity": "16MiB", "segment_bytes": "1MiB",
                                "write_policy": "write_through"}))
    if "m" not in eng.namespaces:
        eng.create_namespace("m", BB)
    return eng


def _segment_of(eng: Engine, i: int) -> int:
    from kvtier.types import Tier
    ns = eng.namespace("m")
    row = int(ns.table.lookup(keys([i]))[0])
    return int(ns.table.cols["slot"][row, Tier.NVME])


def test_a_flush_past_the_mark_reclaims_one_candidate_and_the_next_flushes_the_rest(
        tmp_path: Path):
    eng = _engine(tmp_path)
    ns = eng.namespace("m")
    sp = eng.nvme.space
    data: dict[int, np.ndarray] = {}
    n = 0

    def put16() -> None:
        nonlocal n
        part = blocks(16, BB, n)
        data.update(zip(range(n, n + 16), part))
        eng.put("m", keys(range(n, n + 16)), part)
        n += 16

    while len(ns.log.sealed()) < 9:                  # nine sealed segments of ~250 records
        put16()
    assert not sp.compaction_due()                   # 9-10 MiB of a 16 MiB tier: under 3/4
    sealed = sorted(s.seg_id for s in ns.log.sealed())[:8]
    # Most of eight segments' keys deleted: eight compaction candidates, nothing reclaimed yet
    # because the tier is under the mark.
    gone = [i for i in data if _segment_of(eng, i) in sealed and i % 4 != 0]
    eng.delete("m", keys(gone))
    for i in gone:
        del data[i]
    candidates = ns.log.compaction_candidates(eng.settings.compact_threshold)
    assert len(candidates) >= 8
    before = eng.counters.compactions
    while eng.counters.compactions == before:        # until a flush finds the tier past it
        assert n < 20000
        put16()
    assert eng.counters.compactions == before + 1    # one reclaim in that put's flush
    left = ns.log.compaction_candidates(eng.settings.compact_threshold)
    assert len(left) >= len(candidates) - 2
    # The next flushes take the rest in turn, one each, while the tier stays past the mark.
    steps = []
    for _ in range(12):
        c0 = eng.counters.compactions
        put16()
        steps.append(eng.counters.compactions - c0)
    assert max(steps) <= 1 and sum(steps) >= 1
    _all_read_back(eng, data)
    eng.close()
    eng = _engine(tmp_path)
    _all_read_back(eng, data)
    eng.close(flush=False)


def _all_read_back(eng: Engine, data: dict[int, np.ndarray]) -> None:
    ks = sorted(data)
    for lo in range(0, len(ks), 128):            # a 1 MiB host tier holds 256 blocks at once
        part = ks[lo:lo + 128]
        found, out = eng.read("m", keys(part))
        assert found.all() and all((out[j] == data[i]).all() for j, i in enumerate(part))
