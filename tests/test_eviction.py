"""kvtier.coherence.eviction: the usual eviction (every victim's version held by a lower tier)
told by one C call (_gets.c victims_covered) and dropped by the one-call evict_slots leaves
what the numpy check and _drop_victims_native leave; the check's answers and refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.coherence import eviction
from kvtier.coherence.engine import Engine
from kvtier.errors import CapacityError
from kvtier.types import Tier
from tests.conftest import blocks, drive_get, keys
from tests.engines import BB, small_engine


pytestmark = pytest.mark.skipif(eviction._victims_covered is None or eviction._fast is None,
                                reason="kvtier.coherence._gets or _fast was not built")


def _snapshot(eng: Engine, seen: list) -> None:
    """The page table, each slot tier's arrays, free stack and policy state, the counters."""
    ns = eng.namespace("m")
    t = ns.table
    seen.append({name: col[: t.n_rows].tolist() for name, col in t.cols.items()
                 if name != "key"})
    for tier, st in ns.slots.items():
        stack = (st.pool.stack()[0][st.pool.stack()[1]:].tolist()
                 if hasattr(st.pool, "stack") else None)
        seen.append((tier.label, st.slot_row.tolist(), st.leases.tolist(),
                     st.pool.free_count, stack,
                     st.policy.state() if st.policy is not None else None))
    seen.append({k.label: v.as_dict() for k, v in eng.counters.tiers.items()})
    seen.append(eng.host_used)


def _state_after(tmp: Path, seed: int, hbm: bool, policy: str) -> list:
    """Random puts (dirty under write-back: their victims must be written down first),
    flushes (clean, covered: the one-call drop), admin evictions and gets whose bring-ups
    from NVMe evict, with rewrites between a get's read and its install. After every step:
    what it returned and the whole state."""
    eng = small_engine(tmp, hbm, eviction=policy)
    rng = np.random.default_rng(seed)
    seen: list = []
    for step in range(200):
        op = int(rng.integers(0, 10))
        ids = [int(i) for i in rng.integers(0, 48, int(rng.integers(1, 12)))]
        try:
            if op < 3:
                ids = list(dict.fromkeys(ids))
                seen.append(eng.put("m", keys(ids), blocks(len(ids), BB, step)).tolist())
            elif op < 5:
                eng.flush()
                seen.append(eng.evict(Tier.HOST, int(rng.integers(1, 12))))
                if hbm:
                    seen.append(eng.evict(Tier.HBM, int(rng.integers(1, 6))))
            else:
                def meanwhile(p, ids=ids, step=step) -> None:
                    if rng.integers(0, 3) == 0:
                        some = list(dict.fromkeys(ids[: int(rng.integers(1, len(ids) + 1))]))
                        eng.put("m", keys(some), blocks(len(some), BB, 1000 + step))

                out = drive_get(eng, eng.get_steps("m", keys(ids), 0,
                                                   room_first=bool(rng.integers(0, 2))),
                                meanwhile)
                seen.append([out.found.tolist(), out.slots.tolist(), out.versions.tolist()])
                eng.release(out.lease_id)
        except CapacityError as exc:
            seen.append(str(exc))
        _snapshot(eng, seen)
    eng.close(flush=False)
    return seen


@pytest.mark.parametrize("policy", ["chain", "lru"])
@pytest.mark.parametrize("hbm", [False, True], ids=["host", "hbm-above"])
@pytest.mark.parametrize("seed", [3, 4])
def test_the_one_call_covered_drop_leaves_the_state_the_numpy_drop_leaves(
        tmp_path: Path, hbm: bool, seed: int, policy: str, monkeypatch):
    calls = {True: 0, False: 0}
    c_check = eviction._victims_covered

    def spy(*args):
        out = c_check(*args)
        calls[out] += 1
        return out

    monkeypatch.setattr(eviction, "_victims_covered", spy)
    with_c = _state_after(tmp_path / "c", seed, hbm, policy)
    # Both answers were given: the usual case dropped by the one call, and victims some of
    # which had to be written down first (dirty under write-back) left to the general path.
    assert calls[True] > 10 and calls[False] > 0, calls
    monkeypatch.setattr(eviction, "_victims_covered", None)
    assert _state_after(tmp_path / "numpy", seed, hbm, policy) == with_c


def _columns():
    """copy_ver of 4 rows x 4 tiers, the host tier (1) holding rows 0-3 in slots 0-3 of 6,
    NVMe (2) holding the same versions of rows 0, 1 and 3, row 2 newer in host only."""
    copy_ver = np.zeros((4, 4), dtype=np.uint64)
    copy_ver[:, 1] = [3, 5, 7, 2]
    copy_ver[:, 2] = [3, 5, 6, 2]
    slot_row = np.array([0, 1, 2, 3, -1, -1], dtype=np.int64)
    return copy_ver, slot_row


def test_victims_covered_says_whether_a_lower_tier_holds_every_version():
    copy_ver, slot_row = _columns()
    check = eviction._victims_covered
    nvme, hbm = 1 << int(Tier.NVME), 1 << int(Tier.HBM)
    v = lambda *s: np.array(s, dtype=np.int64)      # noqa: E731
    assert check(copy_ver, slot_row, v(0, 1, 3), 1, nvme) is True
    assert check(copy_ver, slot_row, v(0, 2), 1, nvme) is False        # row 2: a sole copy
    assert check(copy_ver, slot_row, v(0, 1), 1, hbm) is False         # not in that tier
    assert check(copy_ver, slot_row, v(0, 1), 1, nvme | hbm) is True   # any lower tier
    assert check(copy_ver, slot_row, v(), 1, nvme) is False            # nothing to drop
    # A victim holding no row, outside the pool or a row past the table: the general path.
    assert check(copy_ver, slot_row, v(0, 4), 1, nvme) is False
    assert check(copy_ver, slot_row, v(0, 6), 1, nvme) is False
    assert check(copy_ver, slot_row, v(0, -1), 1, nvme) is False
    assert check(copy_ver, np.array([0, 9], np.int64), v(0, 1), 1, nvme) is False
    with pytest.raises(ValueError, match="past"):
        check(copy_ver, slot_row, v(0), 4, nvme)
    with pytest.raises(ValueError, match="past"):
        check(copy_ver, slot_row, v(0), 1, 1 << 4)
    with pytest.raises(TypeError):
        check(copy_ver, slot_row, v(0).astype(np.int32), 1, nvme)
