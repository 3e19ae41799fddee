"""kvtier.coherence._flush (fio7's pick and apply) against its numpy references on raw tables
that no engine builds: rows asked for that repeat, fall outside the table or lie between
n_rows and the columns' length; DIRTY rows whose copy is only in HBM (staged), in neither
tier, or at another version; parents past n_rows; batch rows repeated, reused by another
key, older or newer than the batch. The C calls must leave exactly what numpy leaves: the
same picked arrays and records, the same columns, nvme_moved calls and returned keys after
an apply, and the same IllegalTransition (rev10, review of session 34's merges).

tests/test_flush_native.py checks the same on engine-built tables; these tables are random
in every column, so that a bound or an order that the engine never produces is met too."""

from __future__ import annotations

import types

import numpy as np
import pytest

from kvtier.coherence import flushes
from kvtier.coherence.flushes import Flushes
from kvtier.coherence.persist import NvmeStore
from kvtier.coherence.states import BlockState, IllegalTransition

pytestmark = pytest.mark.skipif(flushes._flush is None,
                                reason="kvtier.coherence._flush was not built")
W = 8
SEEDS = 400


def _table(rng: np.random.Generator) -> types.SimpleNamespace:
    """A namespace stand-in: random columns of `capacity` rows, n_rows of them in use. Small
    value ranges, so that versions tie, copies match, keys collide."""
    cap = int(rng.integers(1, 40))
    c = {"state": rng.integers(0, len(BlockState), cap).astype(np.uint8),
         "version": rng.integers(0, 6, cap).astype(np.uint64),
         "copy_ver": rng.integers(0, 6, (cap, 4)).astype(np.uint64),
         "slot": rng.integers(-1, 50, (cap, 4)).astype(np.int32),
         "checksum": rng.integers(0, 1 << 62, cap).astype(np.uint64),
         "key": np.frombuffer(rng.integers(0, 3, cap * W).astype(np.uint8).tobytes(),
                              f"V{W}").copy(),
         "parent": rng.integers(-3, cap, cap).astype(np.int32),
         "nvme_off": rng.integers(0, 100, cap).astype(np.uint32),
         "nvme_checksum": rng.integers(0, 100, cap).astype(np.uint64)}
    return types.SimpleNamespace(table=types.SimpleNamespace(cols=c, n_rows=int(
        rng.integers(0, cap + 1))), key_width=W, block_bytes=4096)


class _Store:
    """What _apply_flush / _apply_numpy call of the NVMe store: set_nvme is the real one,
    nvme_moved (the segments' live counts and Members) is recorded instead."""

    set_nvme = NvmeStore.set_nvme

    def __init__(self) -> None:
        self.moved: list = []

    def nvme_moved(self, ns, old, rows, segs) -> None:
        self.moved.append((sorted(np.asarray(old).tolist()), np.asarray(rows).tolist(),
                           np.asarray(segs).tolist()))


def _outcome(fn, *args):
    try:
        return fn(*args), None
    except IllegalTransition as exc:
        return None, f"IllegalTransition: {exc}"
    except (IndexError, ValueError) as exc:
        return None, type(exc).__name__


@pytest.mark.parametrize("part", range(4))
def test_the_c_pick_matches_numpy_on_random_tables(part: int):
    picked = 0
    for seed in range(part * SEEDS, (part + 1) * SEEDS):
        rng = np.random.default_rng(seed)
        ns = _table(rng)
        cap = ns.table.cols["state"].size
        rows = rng.integers(-3, cap + 3, int(rng.integers(0, 30)))
        if rng.random() < 0.3:
            rows = np.unique(rows)                 # the sorted, distinct fast path
        f = Flushes(_Store())
        got, g_err = _outcome(f._pick_c, ns, rows.copy())
        want, w_err = _outcome(f._pick_numpy, ns, rows.copy())
        assert g_err == w_err and (got is None) == (want is None), seed
        if got is None:
            continue
        picked += 1
        for g, w in zip(got[:6], want[:6]):        # rows, versions, slots, sums, keys, records
            assert g.dtype == w.dtype and g.tobytes() == w.tobytes(), seed
        assert tuple(got[6:]) == tuple(want[6:]), seed     # distinct, staged
    assert picked > SEEDS // 5                     # the comparisons were not all empty


def _batch(rng: np.random.Generator, ns) -> tuple:
    cols, n = ns.table.cols, ns.table.n_rows
    k = int(rng.integers(0, 20))
    rows = rng.integers(0, n, k)
    if rng.random() < 0.5:
        rows = np.unique(rows)                     # as pick gives them; else repeats too
    k = rows.size
    keys = cols["key"][rows].copy()
    keys[rng.random(k) < 0.2] = np.frombuffer(b"\x07" * W, f"V{W}")[0]    # reused rows
    batch = types.SimpleNamespace(rows=rows.astype(np.int64), keys=keys,
                                  versions=rng.integers(0, 6, k).astype(np.uint64),
                                  sums=rng.integers(0, 99, k).astype(np.uint64))
    return batch, rng.integers(0, 9, k).astype(np.int32), rng.integers(0, 99, k).astype(
        np.uint32)


@pytest.mark.parametrize("part", range(4))
def test_the_c_apply_matches_numpy_on_random_tables(part: int):
    raised = applied = 0
    for seed in range(part * SEEDS, (part + 1) * SEEDS):
        rng = np.random.default_rng(seed)
        ns = _table(rng)
        if ns.table.n_rows == 0:
            continue
        batch, segs, offs = _batch(rng, ns)
        before = {c: a.copy() for c, a in ns.table.cols.items()}
        ends = []
        for way in ("_apply_flush", "_apply_numpy"):
            for c, a in before.items():
                ns.table.cols[c][...] = a
            store = _Store()
            res, err = _outcome(getattr(Flushes(store), way), ns, batch, segs, offs)
            ends.append(({c: a.copy() for c, a in ns.table.cols.items()}, store.moved, res,
                         err))
        (c_cols, c_moved, c_res, c_err), (p_cols, p_moved, p_res, p_err) = ends
        for c in before:
            assert np.array_equal(c_cols[c], p_cols[c]), (seed, c)
        assert c_moved == p_moved and c_res == p_res and c_err == p_err, seed
        raised += c_err is not None
        applied += bool(c_moved and c_moved[0][1])
    assert raised > 0 and applied > SEEDS // 3    # both outcomes were met
