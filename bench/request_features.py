"""What a request's arrival tells an eviction policy that the block ids do not (issue 18, gap6).

    python bench/request_features.py ../shared/traces/mooncake_conversation_first_half.jsonl \
        --capacity 5e5,1e6,2e6,3e6,6e6 --split 2 --json

bench/policy_ceiling.py measures the best a policy gets from a block's own history (accesses so
far, previous reuse interval, depth). This script asks whether what an online service sees of
each *request* adds to that. Every feature is known when the request arrives, or (the output
length) when it finishes, before the conversation's next turn; each is binned into four levels:

    turn       the request's turn in its conversation: 0, 1, 2-3, 4+. The previous turn is the
               request that last touched the deepest block of the request's already-seen leading
               run, when that run is 2 blocks or more (block 0 is everyone's root)
    gap        seconds since that previous turn: none, < 30, < 120, more
    rate       the conversation's mean seconds per turn so far: none, < 60, < 180, more
    input      the prompt's tokens: < 2k, < 8k, < 32k, more
    new        blocks the request adds past its seen leading run: 0-1, 2-3, 4-10, more
    seen       share of the request's blocks in that run: <= 1 block, < 50%, < 90%, more
    output     the answer's tokens (a real engine knows them when the request ends): < 50,
               < 200, < 500, more
    role       the block in its request: in the seen leading run, new, the request's last block
    load       block accesses in the 60 s before the arrival, against the trace's mean rate:
               < 0.75x, < 1x, < 1.33x, more (a think time is in seconds, an age in accesses)
    arrival    the arrival's quarter of the trace's time span (not online: a control for drift)
    oracle     not online: whether the conversation has a next turn, and how soon (none,
               < 60 s, < 300 s, later): what a perfect predictor of the return would buy

"Seen" here means seen anywhere earlier in the trace (an infinite key memory); an online service
sees the leading run through its page table and its ghost, which reach less far.

For each capacity and each feature, two measures:

- its predictive power at eviction candidacy: among accesses whose block LRU would not keep until
  its next use (LRU stack distance of the next use >= the capacity, or no next use), the label
  "next use within K capacities of LRU stack distance" (K = 4, the ghost's reach); the mutual
  information of the label with the feature given the block's class (the ceiling's class), beside
  the information the class itself gives, in bits per candidate;
- the ceiling of the class-and-age family with the classes split further by the feature (the whole
  trace, each part alone with --split, and, with --split 2, the cutoffs chosen on one part and
  applied to the other: a split that only fits noise gains on its own part and not across;
  with --shrink M, split classes seen fewer than M times in training take their unsplit
  class's cutoffs);
- the same ceiling with the age measured in seconds instead of accesses (a think time is a time:
  what the arrival times buy used as a clock).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header  # noqa: E402
from bench.policy_ceiling import (_best, _choices, access_classes, ceiling,  # noqa: E402
                                  ceiling_transfer)
from kvtier.replay import TOKENS_PER_BLOCK, Tiers, Trace, parse_capacity, run  # noqa: E402

FEATURES = ("turn", "gap", "rate", "input", "new", "seen", "output", "role", "load", "arrival",
            "oracle")
PAIRS = (("turn", "output"), ("turn", "gap"), ("turn", "new"), ("output", "gap"))
HORIZON = 4                   # the label's reach, in capacities of LRU stack distance


class Requests:
    """A Mooncake trace with the fields kvtier.replay.Trace leaves out."""

    def __init__(self, recs: list[dict[str, Any]]):
        self.ids = [list(r["hash_ids"]) for r in recs]
        self.ts = np.array([r.get("timestamp", 0) for r in recs], dtype=float) / 1000.0
        self.input = np.array([r.get("input_length", TOKENS_PER_BLOCK * len(r["hash_ids"]))
                               for r in recs], dtype=float)
        self.output = np.array([r.get("output_length", 0) for r in recs], dtype=float)

    def __len__(self) -> int:
        return len(self.ids)

    def part(self, i: int, k: int) -> "Requests":
        lo, hi = len(self) * i // k, len(self) * (i + 1) // k
        out = Requests([])
        out.ids, out.ts = self.ids[lo:hi], self.ts[lo:hi]
        out.input, out.output = self.input[lo:hi], self.output[lo:hi]
        return out

    def trace(self) -> Trace:
        return Trace(self.ids, [int(min(t, len(i) * TOKENS_PER_BLOCK))
                                for i, t in zip(self.ids, self.input)])


def load(path: str) -> Requests:
    with open(path, encoding="utf-8") as fh:
        return Requests([json.loads(line) for line in fh if line.strip()])


def _bins(values: np.ndarray, edges: tuple[float, ...]) -> np.ndarray:
    return np.digitize(values, edges).astype(np.int64)


def request_features(req: Requests) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Per request, each feature's level (see the module docstring), computed from the
    requests before it only; and per request the length of its seen leading run."""
    n = len(req)
    turn = np.zeros(n, dtype=np.int64)
    gap = np.full(n, -1.0)
    rate = np.full(n, -1.0)
    run_len = np.zeros(n, dtype=np.int64)
    first = np.arange(n)                         # the conversation's first request
    after = np.full(n, np.inf)                   # seconds to the next turn (oracle only)
    last: dict[int, int] = {}                    # block -> the last request that touched it
    for i, ids in enumerate(req.ids):
        p = 0
        while p < len(ids) and ids[p] in last:
            p += 1
        run_len[i] = p
        if p >= 2:
            j = last[ids[p - 1]]
            turn[i] = turn[j] + 1
            first[i] = first[j]
            gap[i] = req.ts[i] - req.ts[j]
            rate[i] = (req.ts[i] - req.ts[first[i]]) / turn[i]
            after[j] = min(after[j], req.ts[i] - req.ts[j])
        for b in ids:
            last[b] = i
    lengths = np.array([len(i) for i in req.ids], dtype=np.int64)
    new = lengths - run_len
    seen = np.where(run_len <= 1, 0, 1 + _bins(run_len / np.maximum(lengths, 1), (0.5, 0.9)))
    span = max(float(req.ts.max() - req.ts.min()), 1e-9) if n else 1.0
    done = np.concatenate([[0], np.cumsum(lengths)])        # accesses before each request
    since = done[np.arange(n)] - done[np.searchsorted(req.ts, req.ts - 60.0, side="left")]
    mean_rate = done[-1] / max(span, 60.0)
    load = since / (mean_rate * np.minimum(60.0, np.maximum(req.ts - req.ts.min(), 1.0)))
    feats = {
        "turn": _bins(turn, (1, 2, 4)),
        "gap": np.where(gap < 0, 0, 1 + _bins(gap, (30, 120))),
        "rate": np.where(rate < 0, 0, 1 + _bins(rate, (60, 180))),
        "input": _bins(req.input, (2000, 8000, 32000)),
        "new": _bins(new, (2, 4, 11)),
        "seen": seen,
        "output": _bins(req.output, (50, 200, 500)),
        "load": _bins(load, (0.75, 1.0, 1.33)),
        "arrival": np.minimum(((req.ts - req.ts.min()) / span * 4).astype(np.int64), 3),
        "oracle": np.where(np.isinf(after), 0, 1 + _bins(after, (60, 300))),
    }
    return feats, run_len


def access_features(req: Requests) -> dict[str, np.ndarray]:
    """Each feature per access, in the trace's access order (that of access_classes): the
    level of the request the access belongs to, and the block's role in it."""
    feats, run_len = request_features(req)
    lengths = np.array([len(i) for i in req.ids], dtype=np.int64)
    owner = np.repeat(np.arange(len(req)), lengths)
    out = {name: f[owner] for name, f in feats.items()}
    start = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(req) else np.zeros(0, int)
    pos = np.arange(owner.size) - start[owner]
    out["role"] = np.where(pos < run_len[owner], 0, np.where(pos == lengths[owner] - 1, 2, 1))
    for a, b in PAIRS:
        out[f"{a}x{b}"] = out[a] * 4 + out[b]
    return out


def next_stack_distance(trace: Trace) -> np.ndarray:
    """Per access: the LRU stack distance of the block's next access (distinct blocks accessed
    in between, plus one), inf when there is none."""
    flat = [b for ids in trace.ids for b in ids]
    n = len(flat)
    tree = [0] * (n + 1)                         # a Fenwick tree over positions: 1 marks the
    prev: dict[int, int] = {}                    # latest access of some block
    out = np.full(n, np.inf)
    for pos, b in enumerate(flat):
        q = prev.get(b)
        if q is not None:
            s, i = 0, pos                        # marks in positions q+1 .. pos-1
            while i > 0:
                s += tree[i]
                i -= i & -i
            i = q + 1
            while i > 0:
                s -= tree[i]
                i -= i & -i
            out[q] = s + 1
            i = q + 1
            while i <= n:
                tree[i] -= 1
                i += i & -i
        i = pos + 1
        while i <= n:
            tree[i] += 1
            i += i & -i
        prev[b] = pos
    return out


def seconds_curves(req: Requests, cls: np.ndarray, nxt: np.ndarray,
                   grid: np.ndarray) -> dict[int, tuple]:
    """policy_ceiling's per-class curves with the cutoff an age in seconds (``grid``) instead
    of accesses: a block is kept until ``grid[k]`` seconds after its access; its occupancy is
    the accesses that pass meanwhile (past the trace's end, at its mean rate), its hit a next
    use within that time."""
    lengths = np.array([len(i) for i in req.ids], dtype=np.int64)
    at = np.repeat(req.ts, lengths)
    n = at.size
    pos = np.arange(n)
    finite = np.isfinite(nxt)
    dt = np.full(n, np.inf)
    dt[finite] = at[(pos + nxt)[finite].astype(np.int64)] - at[finite]
    rate = n / max(float(at[-1] - at[0]), 1.0) if n else 1.0
    out = {}
    for c in np.unique(cls):
        idx = np.flatnonzero(cls == c)
        occ = np.empty(grid.size)
        hit = np.empty(grid.size)
        for k, t in enumerate(grid):
            if t == 0:
                occ[k] = hit[k] = 0.0
                continue
            end = at[idx] + t
            passed = np.searchsorted(at, end, side="right") - idx - 1
            passed = passed + np.maximum(end - at[-1], 0) * rate
            occ[k] = np.minimum(passed, nxt[idx]).sum()
            hit[k] = (dt[idx] <= t).sum()
        out[int(c)] = (occ, hit)
    return out


def seconds_ceiling(req: Requests, capacity: int, train: Requests | None = None) -> float:
    """The class-and-age ceiling's hit ratio with ages in seconds; with ``train``, its cutoffs
    chosen there (ceiling_transfer's rule)."""
    span = max(float(req.ts[-1] - req.ts[0]), 1.0)
    grid = np.concatenate([[0.0], np.geomspace(0.5, 8 * span, 200)])
    trace = req.trace()
    cls, nxt = access_classes(trace, capacity)
    curves = seconds_curves(req, cls, nxt, grid)
    if train is None:
        choice = _choices(curves)
    else:
        tcls, tnxt = access_classes(train.trace(), capacity)
        choice = _choices(seconds_curves(train, tcls, tnxt, grid))
    return _best(curves, choice, grid, cls.size, capacity)["hit_ratio"]


def _entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def _cond_info(y: np.ndarray, f: np.ndarray, g: np.ndarray) -> float:
    """I(y; f | g) in bits, y binary."""
    total = 0.0
    n = y.size
    for c in np.unique(g):
        m = g == c
        yc, fc = y[m], f[m]
        h = _entropy(np.bincount(yc, minlength=2))
        hf = sum((fc == v).sum() / yc.size * _entropy(np.bincount(yc[fc == v], minlength=2))
                 for v in np.unique(fc))
        total += m.sum() / n * (h - hf)
    return total


def predictive(trace: Trace, feats: dict[str, np.ndarray], capacity: int,
               sd: np.ndarray) -> dict[str, Any]:
    """At LRU eviction candidacy: the label's rate, the information in the class, and each
    feature's information beyond it, with the label's rate per level of the feature."""
    cls, _ = access_classes(trace, capacity)
    cand = sd >= capacity                        # inf too: never used again
    y = (sd[cand] < HORIZON * capacity).astype(np.int64)
    g = cls[cand]
    h = _entropy(np.bincount(y, minlength=2))
    out: dict[str, Any] = {"candidates": int(cand.sum()), "label_rate": round(float(y.mean()), 4),
                           "label_bits": round(h, 4),
                           "class_bits": round(_cond_info(y, g, np.zeros_like(g)), 4)}
    hy_g = h - out["class_bits"]
    out["label_bits_given_class"] = round(hy_g, 4)
    per = {}
    for name, f in feats.items():
        fc = f[cand]
        bits = _cond_info(y, fc, g)
        rates = {int(v): round(float(y[fc == v].mean()), 3) for v in np.unique(fc)}
        per[name] = {"bits_beyond_class": round(bits, 4),
                     "share_of_what_is_left": round(bits / hy_g, 4) if hy_g > 0 else 0.0,
                     "bits_alone": round(_cond_info(y, fc, np.zeros_like(fc)), 4),
                     "label_rate_by_level": rates}
    out["features"] = per
    return out


def _gap(value: float, lru: float, belady: float) -> float:
    return round((value - lru) / (belady - lru), 4) if belady > lru else 0.0


def measure(req: Requests, capacities: list[int], names: list[str], split: int, info: bool,
            seconds: bool = True, shrink: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    trace = req.trace()
    feats = access_features(req)
    parts = [req.part(i, split) for i in range(split)] if split > 1 else []
    ptraces = [p.trace() for p in parts]
    pfeats = [access_features(p) for p in parts]
    sd = next_stack_distance(trace) if info else None
    out = []
    for tokens in capacities:
        blocks = tokens // TOKENS_PER_BLOCK
        row: dict[str, Any] = {"capacity_tokens": tokens}
        ref = {"whole": (run(trace, "lru", Tiers(blocks)).hit_ratio,
                         run(trace, "belady", Tiers(blocks)).hit_ratio)}
        for i, t in enumerate(ptraces):
            ref[f"part{i}"] = (run(t, "lru", Tiers(blocks)).hit_ratio,
                               run(t, "belady", Tiers(blocks)).hit_ratio)
        row["lru"] = {k: round(v[0], 4) for k, v in ref.items()}
        row["belady"] = {k: round(v[1], 4) for k, v in ref.items()}
        whole_cls = access_classes(trace, blocks)
        part_cls = [access_classes(t, blocks) for t in ptraces]
        ceilings: dict[str, Any] = {}
        for name in ["none", *names]:
            f = None if name == "none" else feats[name]
            got = ceiling(trace, blocks, f, whole_cls)
            entry: dict[str, Any] = {"whole": _gap(got["hit_ratio"], *ref["whole"]),
                                     "classes_kept": got["classes_kept"]}
            for i, t in enumerate(ptraces):
                pf = None if name == "none" else pfeats[i][name]
                entry[f"part{i}"] = _gap(ceiling(t, blocks, pf, part_cls[i])["hit_ratio"],
                                         *ref[f"part{i}"])
            if split == 2:
                for i in range(2):
                    tr = (ptraces[1 - i], None if name == "none" else pfeats[1 - i][name])
                    te = (ptraces[i], None if name == "none" else pfeats[i][name])
                    entry[f"part{i}_cutoffs_from_part{1 - i}"] = _gap(
                        ceiling_transfer(tr, te, blocks)["hit_ratio"], *ref[f"part{i}"])
                    for m in (shrink if name != "none" else ()):
                        entry[f"part{i}_cutoffs_from_part{1 - i}_shrink{m}"] = _gap(
                            ceiling_transfer(tr, te, blocks, m)["hit_ratio"], *ref[f"part{i}"])
            ceilings[name] = entry
        row["ceiling_gap_closed"] = ceilings
        if seconds:
            sec = {"whole": _gap(seconds_ceiling(req, blocks), *ref["whole"])}
            for i, p in enumerate(parts):
                sec[f"part{i}"] = _gap(seconds_ceiling(p, blocks), *ref[f"part{i}"])
                if split == 2:
                    sec[f"part{i}_cutoffs_from_part{1 - i}"] = _gap(
                        seconds_ceiling(p, blocks, parts[1 - i]), *ref[f"part{i}"])
            row["ceiling_age_in_seconds_gap_closed"] = sec
        if sd is not None:
            row["at_candidacy"] = predictive(trace, {n: feats[n] for n in names}, blocks, sd)
        out.append(row)
        print(f"# {tokens:.3g}: " + ", ".join(
            f"{k} {v['whole']:+.3f}" for k, v in ceilings.items()), file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--capacity", default="5e5,1e6,2e6,3e6,6e6", help="tokens, comma-separated")
    ap.add_argument("--features", default=",".join(FEATURES + tuple(f"{a}x{b}" for a, b in PAIRS)))
    ap.add_argument("--split", type=int, default=2, help="also each of N consecutive parts")
    ap.add_argument("--no-info", action="store_true", help="skip the candidacy measure")
    ap.add_argument("--no-seconds", action="store_true", help="skip the ceiling with ages in s")
    ap.add_argument("--shrink", default="", help="also the transfer with split classes seen "
                    "fewer than M times in training shrunk to their unsplit class: M,M,...")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result: dict[str, Any] = {"machine": header("request_features"), "trace": args.trace,
                              "horizon_capacities": HORIZON}
    req = load(args.trace)
    caps = [parse_capacity(c) for c in args.capacity.split(",") if c]
    names = [n for n in args.features.split(",") if n]
    shrink = tuple(int(m) for m in args.shrink.split(",") if m)
    result["rows"] = measure(req, caps, names, args.split, not args.no_info,
                             not args.no_seconds, shrink)
    emit(result, args.json)


if __name__ == "__main__":
    main()
