"""How much of the LRU -> optimum gap the information a cache has about a block can buy (issue 18).

    python bench/policy_ceiling.py ../shared/traces/mooncake_conversation_first_half.jsonl \
        --capacity 1e6,2e6,3e6,6e6 --split 2 --json

An online policy decides from what it has seen of a block: how often it was accessed, how long
ago, how long its previous reuse took, where it sits in its chain. This script measures the best
hit ratio any policy of one family gets from exactly that: each block is kept after an access
until its age reaches a cutoff chosen, with hindsight, for its class, and then dropped (or not
stored at all, cutoff 0). A class is

    accesses so far   1, 2, 3 or more
    previous reuse    none, or the interval since the block's previous access in powers of two
                      of the capacity (1/16 C .. 256 C)
    depth             the block's position in its request: < 5 (shared prefixes), < 20, more

The cutoffs are the best for the whole trace (a Lagrangian over the classes: for a price per
slot, each class takes the cutoff with the most hits net of its occupancy; the largest total
that fits the capacity wins; by Little's law, occupancy is the sum over accesses of
min(next use, cutoff) over the accesses in the trace). A reuse counts as a hit whenever the block
is resident, which overstates a prefix cache, where a block after a missing one is a miss. So
the figure is generous to the family: a policy that uses this information and nothing else
should not expect to exceed it, but one that exploits more (a request's blocks share a fate;
the workload changes over the trace) can.

Beside it, in the same run: lru and chain through the engine (kvtier replay's code) and belady
(the optimum that may bypass), each with its share of the lru -> belady gap. --split N also
reports each of N consecutive parts of the trace on its own (to see whether a result holds on
data it was not tuned on).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header  # noqa: E402
from kvtier.replay import (TOKENS_PER_BLOCK, Tiers, Trace, load_trace,  # noqa: E402
                           parse_capacity, run)

INTERVAL_BUCKETS = (-4, 8)        # log2 of (previous interval / capacity), clipped
DEPTHS = (5, 20)
CUTOFFS = 400                     # candidate cutoffs per class, log-spaced to 50 x capacity


def access_classes(trace: Trace, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Per access: its class (an int) and the distance to the block's next access in
    accesses (inf: never again)."""
    flat = [b for ids in trace.ids for b in ids]
    depth = [i for ids in trace.ids for i in range(len(ids))]
    n = len(flat)
    nxt = np.full(n, np.inf)
    seen: dict[int, int] = {}
    for pos in range(n - 1, -1, -1):
        later = seen.get(flat[pos])
        if later is not None:
            nxt[pos] = later - pos
        seen[flat[pos]] = pos
    lo, hi = INTERVAL_BUCKETS
    width = hi - lo + 2                # one more for "no previous access"
    cls = np.empty(n, dtype=np.int64)
    count: dict[int, int] = {}
    prev: dict[int, int] = {}
    for pos, b in enumerate(flat):
        k = min(count.get(b, 0) + 1, 3)
        count[b] = k
        if b in prev:
            ratio = max(pos - prev[b], 1) / capacity
            interval = min(hi, max(lo, math.floor(math.log2(ratio)))) - lo + 1
        else:
            interval = 0
        prev[b] = pos
        d = depth[pos]
        where = 0 if d < DEPTHS[0] else 1 if d < DEPTHS[1] else 2
        cls[pos] = ((k - 1) * width + interval) * 3 + where
    return cls, nxt


def _curves(cls: np.ndarray, nxt: np.ndarray, grid: np.ndarray) -> dict[int, tuple]:
    """Per class: its occupancy (sum of min(next use, cutoff)) and its hits at each cutoff of
    ``grid``."""
    out = {}
    for c in np.unique(cls):
        d = np.sort(nxt[cls == c])
        finite = d[np.isfinite(d)]
        csum = np.concatenate([[0.0], np.cumsum(finite)])
        at = np.searchsorted(finite, grid, side="right")       # reuses within each cutoff
        out[int(c)] = (csum[at] + grid * (d.size - at), at.astype(float))
    return out


PRICES = np.geomspace(1e-8, 1.0, 800)


def _choices(curves: dict[int, tuple]) -> dict[int, np.ndarray]:
    """Each class's best cutoff (an index into the grid) at every price at once."""
    return {c: np.argmax(hit[None, :] - PRICES[:, None] * occ[None, :], axis=1)
            for c, (occ, hit) in curves.items()}


def _best(curves: dict[int, tuple], choice: dict[int, np.ndarray], grid: np.ndarray, n: int,
          capacity: int) -> dict[str, Any]:
    """The price whose cutoffs (``choice``, per class; a class it lacks keeps nothing) give the
    most hits on ``curves`` within ``capacity`` blocks on average."""
    hits = np.zeros(PRICES.size)
    occupancy = np.zeros(PRICES.size)
    for c, (occ, hit) in curves.items():
        j = choice.get(c)
        if j is not None:
            hits += hit[j]
            occupancy += occ[j]
    fits = occupancy / n <= capacity    # the highest prices keep nothing, which always fits
    at = int(np.flatnonzero(fits)[np.argmax(hits[fits])]) if fits.any() else -1
    kept = sum(1 for c in curves if c in choice and grid[choice[c][at]] > 0) if at >= 0 else 0
    best = (float(hits[at]), float(occupancy[at] / n)) if at >= 0 else (0.0, 0.0)
    return {"hits": int(best[0]), "hit_ratio": best[0] / n, "occupancy_blocks": best[1],
            "classes_kept": kept}


def _grid(capacity: int) -> np.ndarray:
    return np.concatenate([[0.0], np.geomspace(1, 50 * capacity, CUTOFFS)])


def with_extra(cls: np.ndarray, extra: np.ndarray | None, levels: int = 0) -> np.ndarray:
    """The classes split further by a per-access feature (small non-negative ints, fewer than
    ``levels``; by default one more than its largest)."""
    if extra is None:
        return cls
    extra = np.asarray(extra, dtype=np.int64)
    levels = levels or (int(extra.max()) + 1 if extra.size else 1)
    return cls * levels + extra


def ceiling(trace: Trace, capacity: int, extra: np.ndarray | None = None,
            classes: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, Any]:
    """The best hits (see the module docstring) with at most ``capacity`` blocks resident on
    average, that average, and how many classes keep anything. ``extra``, one small int per
    access (the trace's accesses in order), splits every class further by that feature;
    ``classes``, access_classes(trace, capacity) when the caller has it already."""
    cls, nxt = classes or access_classes(trace, capacity)
    grid = _grid(capacity)
    curves = _curves(with_extra(cls, extra), nxt, grid)
    return _best(curves, _choices(curves), grid, cls.size, capacity)


def ceiling_transfer(train: tuple[Trace, np.ndarray | None],
                     test: tuple[Trace, np.ndarray | None], capacity: int,
                     shrink: int = 0) -> dict[str, Any]:
    """The ceiling's cutoffs chosen on ``train`` (a trace and its extra feature) and applied to
    ``test``: only the price (one number, the capacity's) is chosen on ``test``. What a class
    split buys that is not hindsight: a split that fits noise gains on its own part only. With
    ``shrink``, a split class seen fewer than that many times in ``train`` takes the cutoffs of
    its unsplit class (fewer cutoffs learned from little data)."""
    grid = _grid(capacity)
    levels = max([int(np.max(e)) + 1 for e in (train[1], test[1]) if e is not None and e.size]
                 or [1])
    cls, nxt = access_classes(train[0], capacity)
    split = with_extra(cls, train[1], levels)
    choice = _choices(_curves(split, nxt, grid))
    if shrink and train[1] is not None:
        parent = _choices(_curves(cls, nxt, grid))
        cells, counts = np.unique(split, return_counts=True)
        for c, k in zip(cells.tolist(), counts.tolist()):
            if k < shrink:
                choice[c] = parent[c // levels]
    cls, nxt = access_classes(test[0], capacity)
    return _best(_curves(with_extra(cls, test[1], levels), nxt, grid), choice, grid, cls.size,
                 capacity)


def part(trace: Trace, i: int, k: int) -> Trace:
    lo, hi = len(trace) * i // k, len(trace) * (i + 1) // k
    return Trace(trace.ids[lo:hi], trace.tokens[lo:hi])


def measure(trace: Trace, capacities: list[int], engine: bool) -> list[dict[str, Any]]:
    out = []
    for tokens in capacities:
        blocks = tokens // TOKENS_PER_BLOCK
        row: dict[str, Any] = {"capacity_tokens": tokens}
        names = ["lru", "belady"] + (["chain"] if engine else [])
        for name in names:
            row[name] = round(run(trace, name, Tiers(blocks)).hit_ratio, 4)
        row["ceiling"] = round(ceiling(trace, blocks)["hit_ratio"], 4)
        gap = row["belady"] - row["lru"]
        for name in ("chain", "ceiling"):
            if name in row and gap > 0:
                row[f"{name}_gap_closed"] = round(float((row[name] - row["lru"]) / gap), 4)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--capacity", default="1e6,2e6,3e6,6e6", help="tokens, comma-separated")
    ap.add_argument("--split", type=int, default=1, help="also each of N consecutive parts")
    ap.add_argument("--no-engine", action="store_true", help="leave chain out (faster)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result: dict[str, Any] = {"machine": header("policy_ceiling"), "trace": args.trace}
    trace = load_trace(args.trace)
    caps = [parse_capacity(c) for c in args.capacity.split(",") if c]
    result["whole"] = measure(trace, caps, not args.no_engine)
    if args.split > 1:
        result["parts"] = [measure(part(trace, i, args.split), caps, not args.no_engine)
                           for i in range(args.split)]
    emit(result, args.json)


if __name__ == "__main__":
    main()
