"""The slot free list shared by every fixed-slot pool (host memfd, HBM).

A preallocated int64 stack: alloc and free of a batch are slice operations and allocate no
per-slot objects (the vLLM block pool threads its free list through the blocks for the same
reason). The lowest slot numbers are on top, so a fresh pool fills from slot 0. int64, the
type every slot array of the engine has (numpy indexes fastest by it, the C helpers take it):
an alloc is one copy and a free none of a cast (8 bytes a slot, 8 MB for a million slots).
"""

from __future__ import annotations

import numpy as np

from kvtier.errors import BadRequest


class SlotStack:
    """The free slots as a stack that grows downwards: _free[_low:] are free, the top at
    _low. A pop of n is one slice copy in order and a push of n one slice assignment, with
    the same order as a stack whose top is at the end read backwards (what was freed last
    comes out first, a batch in the order it was freed): no reversed views, which were two
    of a replayed request's ~17 numpy views (round 4 of the replay's CPU)."""

    name: str
    n_slots: int

    def _init_slots(self, name: str, n_slots: int) -> None:
        self.name = name
        self.n_slots = n_slots
        self._free = np.arange(n_slots, dtype=np.int64)
        self._low = 0

    @property
    def free_count(self) -> int:
        return self.n_slots - self._low

    @property
    def used_count(self) -> int:
        return self._low

    def alloc(self, n: int) -> np.ndarray | None:
        """n free slots, or None when fewer are free (an expected shortage: the caller evicts)."""
        low = self._low
        if n > self.n_slots - low:
            return None
        self._low = low + n
        return self._free[low: low + n].copy()

    def free(self, slots: np.ndarray) -> None:
        n = slots.size if isinstance(slots, np.ndarray) else len(slots)
        low = self._low
        if n > low:
            raise RuntimeError(f"pool {self.name}: more slots freed than allocated (double free)")
        self._free[low - n: low] = slots
        self._low = low - n

    def stack(self) -> tuple[np.ndarray, int]:
        """The free stack and its top (_free, _low), for a C helper that pushes slots itself
        (kvtier.coherence._fast.evict_slots); it then calls pushed."""
        return self._free, self._low

    def pushed(self, low: int) -> None:
        """A C helper pushed slots onto the stack: its top is now low (at most the old one)."""
        if not 0 <= low <= self._low:
            raise RuntimeError(f"pool {self.name}: the free stack's top moved from "
                               f"{self._low} to {low}")
        self._low = low

    def check_slots(self, slots: np.ndarray) -> np.ndarray:
        slots = np.asarray(slots)
        if slots.size and (slots.min() < 0 or slots.max() >= self.n_slots):
            raise BadRequest(f"slot out of range for pool {self.name} (0..{self.n_slots - 1})")
        return slots.astype(np.int64, copy=False)
