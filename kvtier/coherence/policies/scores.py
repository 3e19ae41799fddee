"""Scan scorers, for the NVMe tier's eviction: a scorer takes the page-table columns and the rows
that hold an evictable NVMe copy, and returns a float score per row (lower goes first). This is
O(candidates) per eviction batch; the slot tiers use the maintained queues of policies.queues.

    lru     score = last access time
    s3fifo  blocks seen once (freq <= 1) go first, oldest first; blocks seen again by recency
"""

from __future__ import annotations

from typing import Callable

import numpy as np

Scorer = Callable[[dict[str, np.ndarray], np.ndarray, int], np.ndarray]


def lru(cols: dict[str, np.ndarray], rows: np.ndarray, clock: int) -> np.ndarray:
    return cols["last_access"][rows].astype(np.float64)


def s3fifo(cols: dict[str, np.ndarray], rows: np.ndarray, clock: int) -> np.ndarray:
    last = cols["last_access"][rows].astype(np.float64)
    once = cols["freq"][rows] <= 1
    # One-hit blocks sort before every reused block, oldest first; reused ones by recency.
    return np.where(once, last - float(clock) - 1.0, last)
