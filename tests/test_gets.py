"""kvtier.coherence.gets: a get's split into ready and to-bring-up blocks in one C call
(coherence/_gets.c) leaves what the numpy split leaves; a bad key pins nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.coherence import gets
from kvtier.coherence.engine import Engine
from kvtier.config import make_settings
from kvtier.errors import BadRequest, CapacityError
from kvtier.types import Tier
from tests.conftest import blocks, drive_get, keys
from tests.engines import BB, put_or_evict, small_engine


pytestmark = pytest.mark.skipif(gets._split is None, reason="kvtier.coherence._gets not built")


def _snapshot(eng: Engine, seen: list) -> None:
    """The page table, the slot arrays and the per-tier counters of m, onto seen."""
    ns = eng.namespace("m")
    t = ns.table
    seen.append({name: col[: t.n_rows].tolist() for name, col in t.cols.items()
                 if name != "key"})
    for st in ns.slots.values():
        seen.append((st.slot_row.tolist(), st.leases.tolist(), st.pool.free_count))
    seen.append({k.label: v.as_dict() for k, v in eng.counters.tiers.items()})


def _state_after_gets(tmp: Path, seed: int, hbm: bool) -> list:
    """Random puts, evictions into NVMe and gets (repeated keys, missing keys, resident and
    NVMe blocks mixed): after every get its result, the page table, the slot arrays and the
    counters."""
    eng = small_engine(tmp, hbm)
    rng = np.random.default_rng(seed)
    seen: list = []
    for step in range(150):
        op = rng.integers(0, 10)
        ids = [int(i) for i in rng.integers(0, 60, int(rng.integers(1, 12)))]
        if op < 3:
            ids = list(dict.fromkeys(ids))
            eng.put("m", keys(ids), blocks(len(ids), BB, step))
        elif op < 4:
            eng.flush()
            seen.append(eng.evict(Tier.HOST, int(rng.integers(1, 10))))
        else:
            if op == 9:
                ids = ids + [1000 + step]          # a key never stored: a miss
            res = eng.get("m", keys(ids))
            seen.append([res.found.tolist(), res.slots.tolist(), res.versions.tolist(),
                         res.checksums.tolist()])
            eng.release(res.lease_id)
        _snapshot(eng, seen)
    eng.close(flush=False)
    return seen


@pytest.mark.parametrize("hbm", [False, True], ids=["host", "hbm-above"])
def test_the_c_split_leaves_the_state_the_numpy_split_leaves(tmp_path: Path, hbm: bool,
                                                             monkeypatch):
    with_c = _state_after_gets(tmp_path / "c", 3, hbm)
    monkeypatch.setattr(gets, "_split", None)
    assert _state_after_gets(tmp_path / "numpy", 3, hbm) == with_c


def test_a_missing_all_zero_key_is_refused_before_anything_is_pinned(tmp_path: Path):
    eng = Engine(make_settings({"data_dir": str(tmp_path), "host_capacity": "64KiB",
                                "nvme_capacity": "4MiB"}))
    try:
        eng.create_namespace("m", BB)
        eng.put("m", keys(range(4)), blocks(4, BB))
        eng.flush()
        eng.evict(Tier.HOST, 2)                    # two on NVMe only: the split path
        st = eng.namespace("m").slots[Tier.HOST]
        before = st.leases.copy()
        with pytest.raises(BadRequest, match="all-zero key"):
            eng.get("m", keys(range(4)) + bytes(16))
        assert (st.leases == before).all() and not eng.leases
    finally:
        eng.close(flush=False)


def test_split_rows_refuses_a_broken_table_before_it_pins(tmp_path: Path):
    # A current copy whose slot lies outside the pool (never made by the engine): a typed
    # error, and no pin written.
    n = 4
    version = np.array([1, 1, 1, 0], dtype=np.uint64)
    copy_ver = np.zeros((n, 4), dtype=np.uint64)
    copy_ver[:3, Tier.HOST] = 1
    slot = np.full((n, 4), -1, dtype=np.int32)
    slot[:3, Tier.HOST] = [0, 1, 9]                # 9: past a pool of 4
    sums = np.arange(n, dtype=np.uint64)
    pool = np.zeros(4, dtype=np.uint32)
    rows = np.array([0, 1, 2, 3, -1], dtype=np.int64)
    outs = [np.empty(5, dtype=d) for d in (bool, np.int64, np.uint64, np.uint64, np.int64)]
    with pytest.raises(ValueError, match="outside the pool"):
        gets._split(version, copy_ver, slot, sums, pool, rows, n, int(Tier.HOST), *outs)
    assert not pool.any()
    slot[2, Tier.HOST] = 2
    copy_ver[1, Tier.HOST] = 0                     # row 1 must be brought up
    k, hits, repeats = gets._split(version, copy_ver, slot, sums, pool, np.array(
        [0, 1, 2, 3, -1, 1], dtype=np.int64), n, int(Tier.HOST),
        *[np.empty(6, dtype=o.dtype) for o in outs])
    assert (k, hits, repeats) == (2, 2, True) and pool.tolist() == [1, 0, 1, 0]


def _state_after_interleaved_gets(tmp: Path, seed: int, hbm: bool) -> list:
    """Random puts, flushes, evictions and gets whose NVMe reads are interleaved with what
    can happen between a read and its install on the server's loop: a put rewrites some of
    the keys (the row moves on: not installed; its new copy in the host tier, or flushed and
    evicted to NVMe again), another get installs the same blocks (a
    copy current already: shared), a record fails its verdict (dropped), or nothing (the
    usual install). After every step: the get's result, the page table, the slot arrays,
    the leases and the counters."""
    eng = small_engine(tmp, hbm)
    rng = np.random.default_rng(seed)
    seen: list = []
    for step in range(200):
        op = int(rng.integers(0, 10))
        ids = [int(i) for i in rng.integers(0, 40, int(rng.integers(1, 10)))]
        if not put_or_evict(eng, rng, op, ids, step, seen, evict_below=4):
            steps = eng.get_steps("m", keys(ids), 0, room_first=bool(rng.integers(0, 2)))
            later: list = []

            def meanwhile(p, ids=ids, step=step, later=later) -> None:
                what = int(rng.integers(0, 5))
                some = ids[: int(rng.integers(1, len(ids) + 1))]
                try:
                    if what == 0:
                        some = list(dict.fromkeys(some))
                        eng.put("m", keys(some), blocks(len(some), BB, 1000 + step))
                    elif what == 1:
                        later.append(eng.get("m", keys(some)).lease_id)
                    elif what == 3:             # rewritten, and its new copy gone
                        some = list(dict.fromkeys(some))       # down to NVMe again
                        eng.put("m", keys(some), blocks(len(some), BB, 2000 + step))
                        eng.flush()
                        eng.evict(Tier.HOST, 12)
                except CapacityError:
                    seen.append("full")
                if what == 2 and p.plan is not None and p.plan.ok is not None:
                    ok = np.array(p.plan.ok, dtype=bool)
                    ok[int(rng.integers(0, ok.size))] = False
                    p.plan.ok = ok

            try:
                out = drive_get(eng, steps, meanwhile)
            except CapacityError:
                seen.append("get full")
            else:
                seen.append([out.found.tolist(), out.slots.tolist(), out.versions.tolist(),
                             out.checksums.tolist()])
                later.append(out.lease_id)
            for lid in later:
                eng.release(lid)
        _snapshot(eng, seen)
        seen.append(eng.counters.checksum_failures)
    eng.close(flush=False)
    return seen


@pytest.mark.parametrize("hbm", [False, True], ids=["host", "hbm-above"])
@pytest.mark.parametrize("seed", [5, 6])
def test_the_c_install_leaves_the_state_the_numpy_install_leaves(tmp_path: Path, hbm: bool,
                                                                 seed: int, monkeypatch):
    # coherence/_gets.c read_installable (the usual install told in one call), lease_current
    # (the lease's rows) and plan_columns (the read plan's gathers), against install_read,
    # the numpy lease and plan_read's numpy gathers.
    from kvtier.coherence import persist

    with_c = _state_after_interleaved_gets(tmp_path / "c", seed, hbm)
    monkeypatch.setattr(gets, "_read_installable", None)
    monkeypatch.setattr(gets, "_lease_current", None)
    monkeypatch.setattr(persist, "_plan_columns", None)
    monkeypatch.setattr(gets, "_room_rows", None)
    assert _state_after_interleaved_gets(tmp_path / "numpy", seed, hbm) == with_c


def _room_table(rng: np.random.Generator, n: int = 12, nt: int = 4, pool: int = 10):
    """Columns as a page table holds them (rows without a version, copies current or
    stale in tier 1, slots in a pool of ten), and a lookup's rows: misses, repeats."""
    version = rng.integers(0, 4, n).astype(np.uint64)          # 0: a row without a version
    copy_ver = np.zeros((n, nt), dtype=np.uint64)
    copy_ver[:, 1] = np.where(rng.integers(0, 2, n) == 1, version, version + 1)
    copy_ver[rng.integers(0, n, 2), 1] = 0
    slot = np.full((n, nt), -1, dtype=np.int32)
    cur = (copy_ver[:, 1] == version) & (version > 0)
    slot[cur, 1] = rng.integers(0, pool, int(cur.sum()))
    leases = rng.integers(0, 3, pool).astype(np.uint32)
    rows = rng.integers(-1, n, int(rng.integers(1, 20))).astype(np.int64)
    return version, copy_ver, slot, leases, rows


class _RoomNs:
    def __init__(self, version, copy_ver, slot, leases):
        from types import SimpleNamespace
        self.table = SimpleNamespace(cols={"version": version, "copy_ver": copy_ver,
                                           "slot": slot}, n_rows=version.size)
        self.slots = {Tier(1): SimpleNamespace(leases=leases)}


def test_the_room_steps_c_count_and_pins_match_the_numpy_ones(monkeypatch):
    # coherence/_gets.c room_rows against _room_count's numpy path, on random tables: the
    # same want, the same slots kept (in batch order) and the same pins; none when nothing
    # is wanted. A row without a version is neither wanted nor pinned by either (the numpy
    # path pinned its slot, -1: the pool's last slot, when its copy_ver was 0 too).
    rng = np.random.default_rng(11)
    c_only = gets._room_rows
    seen_want = seen_none = 0
    for _ in range(400):
        version, copy_ver, slot, leases, rows = _room_table(rng)
        got = []
        for fn in (c_only, None):
            monkeypatch.setattr(gets, "_room_rows", fn)
            pins = leases.copy()
            want, keep = gets._room_count(_RoomNs(version, copy_ver, slot, pins), rows,
                                          Tier(1))
            got.append((want, keep.tolist(), pins.tolist()))
        assert got[0] == got[1]
        seen_want += got[0][0] > 0 and len(got[0][1]) > 0
        seen_none += got[0][0] == 0 and got[0][2] == leases.tolist()
    assert seen_want > 50 and seen_none > 20


def test_room_rows_refuses_a_broken_table_before_it_pins():
    version, copy_ver, slot, leases, _ = _room_table(np.random.default_rng(2))
    version[:3], copy_ver[:3, 1], slot[:3, 1] = 1, 1, [0, 1, 99]    # 99: past the pool
    version[3], copy_ver[3, 1] = 2, 1                              # row 3 must come up
    before = leases.copy()
    keep = np.empty(5, dtype=np.int64)
    for rows, n_rows, match in (([0, 1, 2, 3], 12, "outside the pool"),
                                ([0, 1, 3, 12], 12, "past the table"),
                                ([0, 1, 3], 13, "shorter than n_rows")):
        with pytest.raises(ValueError, match=match):
            gets._room_rows(version, copy_ver, slot, leases, np.array(rows, dtype=np.int64),
                            n_rows, 1, keep)
        assert (leases == before).all()
    with pytest.raises(ValueError, match="out_keep"):
        gets._room_rows(version, copy_ver, slot, leases, np.zeros(6, dtype=np.int64), 12, 1,
                        keep)
    with pytest.raises(ValueError, match="tier past"):
        gets._room_rows(version, copy_ver, slot, leases, np.zeros(2, dtype=np.int64), 12, 4,
                        keep)
    assert (leases == before).all()
    assert gets._room_rows(version, copy_ver, slot, leases, np.array([0, 3, 0], np.int64), 12,
                           1, keep) == (1, 2)
    assert keep[:2].tolist() == [0, 0] and leases[0] == before[0] + 2


def _try_gets(tmp: Path, seed: int) -> list:
    """Random puts (dirty under write-back), flushes, evictions to NVMe and try_gets of
    batches resident, partly resident, missing or all on NVMe; each try_get's answer (its
    result, or None: refused) and the state after it."""
    eng = small_engine(tmp, False)
    rng = np.random.default_rng(seed)
    seen: list = []
    for step in range(200):
        op = int(rng.integers(0, 10))
        ids = [int(i) for i in rng.integers(0, 40, int(rng.integers(1, 10)))]
        if not put_or_evict(eng, rng, op, ids, step, seen, evict_below=5):
            if op == 9:
                ids = ids + [1000 + step]          # a key never stored: a miss
            res = eng.try_get("m", keys(ids))
            seen.append(None if res is None else [res.found.tolist(), res.slots.tolist(),
                                                  res.versions.tolist()])
            if res is not None:
                eng.release(res.lease_id)
        _snapshot(eng, seen)
    eng.close(flush=False)
    return seen


def test_try_gets_refusal_in_c_leaves_what_the_numpy_check_leaves(tmp_path: Path, monkeypatch):
    # coherence/_gets.c must_bring (try_get's refusal of a batch that must read the disk)
    # against the numpy check it replaced: the same answers, state and counters; both
    # answers given (refusals, and batches served whole or with misses).
    for seed in (7, 8):
        c_bring = gets._must_bring
        answers = {True: 0, False: 0}

        def spy(*args, c_bring=c_bring):
            out = c_bring(*args)
            answers[out] += 1
            return out

        monkeypatch.setattr(gets, "_must_bring", spy)
        with_c = _try_gets(tmp_path / f"c{seed}", seed)
        assert answers[True] > 5 and answers[False] > 5, answers
        assert sum(x is None for x in with_c) > 5
        monkeypatch.setattr(gets, "_must_bring", None)
        assert _try_gets(tmp_path / f"numpy{seed}", seed) == with_c
        monkeypatch.setattr(gets, "_must_bring", c_bring)


def test_must_bring_tells_a_row_to_bring_up_and_refuses_a_broken_table():
    rng = np.random.default_rng(12)
    told = {True: 0, False: 0}
    for _ in range(300):
        version, copy_ver, _slot, _leases, rows = _room_table(rng)
        r = rows[rows >= 0]
        expect = bool(((copy_ver[r, 1] != version[r]) & (version[r] > 0)).any())
        assert gets._must_bring(version, copy_ver, rows, 12, 1) is expect
        told[expect] += 1
    assert told[True] > 50 and told[False] > 20
    version, copy_ver, _slot, _leases, _ = _room_table(rng)
    for rows, n_rows, tier, match in (([0, 12], 12, 1, "past the table"),
                                      ([0], 13, 1, "shorter than n_rows"),
                                      ([0], 12, 4, "tier past")):
        with pytest.raises(ValueError, match=match):
            gets._must_bring(version, copy_ver, np.array(rows, np.int64), n_rows, tier)


def test_the_interleavings_reach_every_install_path(tmp_path: Path, monkeypatch):
    # The comparison above means something only if its workload takes both answers of
    # read_installable, and the general path's share, free and drop branches.
    told: list[bool] = []
    real = gets._read_installable

    def spy(*a):
        told.append(real(*a))
        return told[-1]

    monkeypatch.setattr(gets, "_read_installable", spy)
    calls = {"share": 0, "miss": 0}
    from kvtier.coherence import transfers
    orig = transfers.Transfers.install_read

    def install_read(self, plan, tier, pos, rows, slots, found):
        before = int((~found).sum()), int(self.counters.tiers[tier].misses)
        orig(self, plan, tier, pos, rows, slots, found)
        calls["miss"] += int(self.counters.tiers[tier].misses) > before[1]
        calls["share"] += 1

    monkeypatch.setattr(transfers.Transfers, "install_read", install_read)
    _state_after_interleaved_gets(tmp_path, 5, False)
    assert True in told and False in told
    assert calls["share"] > 0 and calls["miss"] > 0


def test_read_installable_and_lease_current_refuse_bad_input():
    n = 4
    version = np.array([1, 2, 3, 0], dtype=np.uint64)
    copy_ver = np.zeros((n, 4), dtype=np.uint64)
    key = np.arange(n * 16, dtype=np.uint8).view("V16")
    ok = np.ones(2, dtype=bool)
    rows = np.array([0, 1], dtype=np.int64)
    assert gets._read_installable(version, copy_ver, key, n, int(Tier.HOST), ok, rows,
                                  key[rows].copy(), version[rows].copy())
    with pytest.raises(ValueError, match="shorter than n_rows"):
        gets._read_installable(version, copy_ver, key, n + 1, int(Tier.HOST), ok, rows,
                               key[rows].copy(), version[rows].copy())
    with pytest.raises(ValueError, match="another width"):
        gets._read_installable(version, copy_ver, key, n, int(Tier.HOST), ok, rows,
                               np.zeros(2, dtype="V8"), version[rows].copy())
    with pytest.raises(ValueError, match="differ in length"):
        gets._read_installable(version, copy_ver, key, n, int(Tier.HOST), ok[:1], rows,
                               key[rows].copy(), version[rows].copy())
    leases = np.zeros(n, dtype=np.uint16)
    out = np.empty(3, dtype=np.int64)
    with pytest.raises(ValueError, match="past the columns"):
        gets._lease_current(version, key, leases, np.array([0, 9, 1], dtype=np.int64),
                            np.ones(3, dtype=np.uint64), key[[0, 0, 1]].copy(), out)
    assert not leases.any()                        # checked before any count was written
    leases[1] = 65535                              # a full count stays full (rev7)
    assert gets._lease_current(version, key, leases, rows, version[rows].copy(),
                               key[rows].copy(), out) == 2
    assert leases.tolist() == [1, 65535, 0, 0] and out[:2].tolist() == [0, 1]
    leases[:] = 0
    stale = version[rows].copy()
    stale[1] = 1                                   # row 1 moved on to version 2: not leased
    assert gets._lease_current(version, key, leases, rows, stale, key[rows].copy(), out) == 1
    assert out[0] == 0 and leases.tolist() == [1, 0, 0, 0]


def test_plan_read_in_c_plans_what_the_numpy_gathers_plan(tmp_path: Path, monkeypatch):
    # Random rows of a table spread over several segments (repeats included): the same
    # ReadPlan columns, dtypes and segment pins either way.
    from kvtier.coherence import persist

    eng = Engine(make_settings({"data_dir": str(tmp_path), "host_capacity": "1MiB",
                                "nvme_capacity": "16MiB", "segment_bytes": "1MiB"}))
    big = 256                                      # 4 KiB blocks: 1 MiB segments hold ~250
    try:
        eng.create_namespace("m", BB)
        for lo in range(0, 3 * big, big):
            eng.put("m", keys(range(lo, lo + big)), blocks(big, BB, lo))
            eng.flush()
        ns = eng.namespace("m")
        rng = np.random.default_rng(2)
        dst = np.arange(12, dtype=np.int64)
        spread = 0
        for _ in range(20):
            rows = ns.table.lookup(keys(int(i) for i in rng.integers(0, 3 * big, 12)))
            plans = []
            for c in (persist._plan_columns, None):
                monkeypatch.setattr(persist, "_plan_columns", c)
                plans.append(eng.nvme.plan_read(ns, rows, dst))
            a, b = plans
            for name in ("rows", "keys", "versions", "sums", "segs", "offs", "dst"):
                x, y = getattr(a, name), getattr(b, name)
                assert x.dtype == y.dtype and (x == y).all(), name
            assert [s.seg_id for s in a.pins] == [s.seg_id for s in b.pins]
            spread += len(a.pins) > 1
            ns.log.unpin(a.pins)
            ns.log.unpin(b.pins)
        assert spread                              # plans of more than one segment
        bad = np.array([0, ns.table.cols["slot"].shape[0]], dtype=np.int64)
        outs = [np.empty(2, dtype=d) for d in (np.int32, ns.table.cols["key"].dtype,
                                               np.uint64, np.uint64, np.uint32, np.int64)]
        cols = ns.table.cols
        with pytest.raises(ValueError, match="outside the columns"):
            from kvtier.coherence._gets import plan_columns
            plan_columns(cols["slot"], cols["key"], cols["copy_ver"], cols["nvme_checksum"],
                         cols["nvme_off"], bad, int(Tier.NVME), *outs)
    finally:
        eng.close(flush=False)


def _reader_counts_near_the_top(tmp: Path, monkeypatch, numpy: bool) -> list[list[int]]:
    """Reader counts of keys 0 and 1 through general-path gets (a missing key in each batch)
    that take them past 65,535, and releases that take them below 0 (a count set at 1 under
    a lease of the row twice: what a saturated count meets), in C or in numpy."""
    from kvtier.coherence import leases
    if numpy:
        monkeypatch.setattr(gets, "_lease_current", None)
        monkeypatch.setattr(leases, "_fast", None)
    eng = small_engine(tmp, hbm=False)
    eng.put("m", keys([0, 1]), blocks(2, BB))
    ns = eng.namespace("m")
    counts = ns.table.cols["leases"]
    r0, r1 = ns.table.lookup(keys([0, 1])).tolist()
    seen = []
    counts[r0], counts[r1] = 65_533, 65_535
    res = eng.get("m", keys([0, 0, 0, 1, 9]))
    seen.append([int(counts[r0]), int(counts[r1])])
    counts[r0], counts[r1] = 1, 0
    eng.release(res.lease_id)
    seen.append([int(counts[r0]), int(counts[r1])])
    assert not ns.slots[Tier.HOST].leases.any()
    eng.close(flush=False)
    return seen


def test_numpy_reader_counts_saturate_and_stop_at_zero_as_the_c_ones_do(tmp_path: Path,
                                                                        monkeypatch):
    # Without the C helpers the counts wrapped: 65,533 + 3 was 0, and 1 - 3 was 65,534 (an
    # admin eviction takes rows whose count is 0; a wrapped count keeps a row off it).
    c = _reader_counts_near_the_top(tmp_path / "c", monkeypatch, numpy=False)
    with monkeypatch.context() as m:
        n = _reader_counts_near_the_top(tmp_path / "n", m, numpy=True)
    assert c == n == [[65_535, 65_535], [0, 0]]
