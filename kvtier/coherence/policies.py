"""Eviction policies, as data: POLICIES maps a name to a scoring function.

A scoring function takes the page-table columns and the rows that hold an evictable copy in one
tier, and returns a float score per row: lower goes first. The engine adds the leaf-first rule on
top (a row whose child is cached in the same tier is evicted after every leaf), so each policy
only ranks recency and frequency.

    lru        score = last access time
    lru_k_lfu  the seed's mix, K = 2: evict-score = 0.6 x normalised age of the K-th last access
               + 0.4 x (1 - normalised frequency); lower keep-score goes first
    s3fifo     a vectorised S3-FIFO approximation: blocks seen once (freq <= 1) form the small
               FIFO and go first in insertion order; blocks seen again are ranked by recency

Costs: each is O(candidates) numpy work per eviction batch.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

Scorer = Callable[[dict[str, np.ndarray], np.ndarray, int], np.ndarray]


def lru(cols: dict[str, np.ndarray], rows: np.ndarray, clock: int) -> np.ndarray:
    return cols["last_access"][rows].astype(np.float64)


def lru_k_lfu(cols: dict[str, np.ndarray], rows: np.ndarray, clock: int) -> np.ndarray:
    kth = cols["prev_access"][rows].astype(np.float64)
    age = clock - kth
    span = age.max() if age.size else 1.0
    age_n = age / span if span > 0 else np.zeros_like(age)
    freq = cols["freq"][rows].astype(np.float64)
    fmax = freq.max() if freq.size else 1.0
    inv_freq = 1.0 - (freq / fmax if fmax > 0 else freq)
    evict_score = 0.6 * age_n + 0.4 * inv_freq
    return -evict_score


def s3fifo(cols: dict[str, np.ndarray], rows: np.ndarray, clock: int) -> np.ndarray:
    last = cols["last_access"][rows].astype(np.float64)
    once = cols["freq"][rows] <= 1
    # One-hit blocks sort before every reused block, oldest first; reused ones by recency.
    return np.where(once, last - float(clock) - 1.0, last)


POLICIES: dict[str, Scorer] = {"lru": lru, "lru_k_lfu": lru_k_lfu, "s3fifo": s3fifo}
