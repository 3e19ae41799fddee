"""How much HBM a namespace's pool takes at start: fixed, or from the history of its demand.

With ``hbm_reserve = history`` the pool of a namespace is sized from the peak HBM demand of
its earlier runs (seed 2.1):

    reserve = sum over i of peak_i x alpha^i        (peak_0: the latest run; alpha = 0.7)

capped at hbm_capacity and at least one block. A run's peak demand is the most slots that its
HBM tier was asked to hold at once (slots in use plus the batch that asked), so it can exceed
the pool: a pool that is too small grows run by run (a steady peak P settles at P / (1 - alpha),
3.3 P at alpha = 0.7, unless the cap binds), and one that demand has left shrinks by alpha a run.
The memory a namespace does not take stays free for the inference engine on the same GPU.
A namespace with no history takes hbm_capacity. The history keeps the last HISTORY runs (the
16th weighs alpha^15, 0.5% at 0.7) in LMDB, written when the engine closes.
"""

from __future__ import annotations

from typing import Sequence

HISTORY = 16


def alpha_reserve(peaks: Sequence[int], alpha: float) -> int:
    """sum(peaks[i] * alpha**i), newest first, rounded up to whole units of the peaks."""
    total = 0.0
    weight = 1.0
    for p in peaks:
        total += p * weight
        weight *= alpha
    return int(-(-total // 1))


def pool_slots(peaks: Sequence[int], alpha: float, capacity_slots: int) -> int:
    """Slots of a pool sized by its history (peaks in slots, newest first)."""
    if not peaks:
        return capacity_slots
    return max(1, min(capacity_slots, alpha_reserve(peaks, alpha)))


def record(peaks: Sequence[int], peak: int) -> list[int]:
    """The history after a run whose peak demand was ``peak`` slots."""
    return [int(peak), *[int(p) for p in peaks]][:HISTORY]
