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
    name: str
    n_slots: int

    def _init_slots(self, name: str, n_slots: int) -> None:
        self.name = name
        self.n_slots = n_slots
        self._free = np.arange(n_slots - 1, -1, -1, dtype=np.int64)
        self._top = n_slots

    @property
    def free_count(self) -> int:
        return self._top

    @property
    def used_count(self) -> int:
        return self.n_slots - self._top

    def alloc(self, n: int) -> np.ndarray | None:
        """n free slots, or None when fewer are free (an expected shortage: the caller evicts)."""
        if n > self._top:
            return None
        out = self._free[self._top - n: self._top][::-1].copy()
        self._top -= n
        return out

    def free(self, slots: np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        n = slots.size
        if self._top + n > self.n_slots:
            raise RuntimeError(f"pool {self.name}: more slots freed than allocated (double free)")
        self._free[self._top: self._top + n] = slots[::-1]
        self._top += n

    def check_slots(self, slots: np.ndarray) -> np.ndarray:
        slots = np.asarray(slots)
        if slots.size and (slots.min() < 0 or slots.max() >= self.n_slots):
            raise BadRequest(f"slot out of range for pool {self.name} (0..{self.n_slots - 1})")
        return slots.astype(np.int64, copy=False)
