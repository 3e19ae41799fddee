"""`kvtier replay TRACE.jsonl`: what hit ratio a given amount of memory buys on a real workload.

The trace format is Mooncake's (../shared/traces/README.md): one JSON request per line with
``hash_ids``, the prompt's blocks of 512 tokens. A request hits only on the leading run of its
blocks that is cached; then every block of the request is accessed in order (hits are touched,
misses are stored with the previous block as parent), as a serving engine would.

Policies run through the real engine (kvtier.coherence.engine.Engine: its page table, eviction
policies and leaf-first rule), on a host tier of the given capacity and, with --nvme-capacity, an
NVMe tier below it, so the figures are the engine's own. ``--metadata-only`` makes blocks 1 byte
so that no time goes to copying; without it each block carries --block-bytes of data.

Two reference points do not go through the engine: ``infinite`` (nothing is ever evicted) and
``belady`` (on a miss with a full cache, evict the block whose next use is furthest away, the
offline optimum for this access sequence).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kvtier.config import EVICTION_POLICIES, make_settings, parse_size
from kvtier.errors import ConfigError

TOKENS_PER_BLOCK = 512
REFERENCES = ("infinite", "belady")


@dataclass(slots=True)
class Result:
    policy: str
    capacity_tokens: int
    hit_ratio: float
    hits: int
    blocks: int
    tier_hits: dict[str, int]
    leaf_first: bool = False
    nvme_blocks_max: int = 0      # most blocks the NVMe tier held (sampled per request)

    def as_dict(self) -> dict[str, Any]:
        return {"policy": self.policy + ("+leaf_first" if self.leaf_first else ""),
                "capacity_tokens": self.capacity_tokens,
                "hit_ratio": round(self.hit_ratio, 4), "hits": self.hits, "blocks": self.blocks,
                "tier_hit_ratio": {t: round(h / self.blocks, 4) if self.blocks else 0.0
                                   for t, h in self.tier_hits.items()},
                "nvme_blocks_max": self.nvme_blocks_max}


def load_trace(path: str | Path) -> list[list[int]]:
    """The hash_ids of every request. Raises ConfigError naming the line of any bad record."""
    out: list[list[int]] = []
    try:
        fh = open(path, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc.strerror}") from None
    with fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ids = rec["hash_ids"]
                if not isinstance(ids, list) or not all(
                        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                    raise TypeError("hash_ids must be a list of non-negative integers")
            except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{path}:{n}: not a Mooncake trace record ({exc})") from None
            out.append(ids)
    if not out:
        raise ConfigError(f"{path}: no requests in the trace")
    return out


def parse_capacity(text: str) -> int:
    """Tokens ('3000000', '3e6') or bytes with a unit ('4GiB'), returned in tokens for the
    caller's block size; bytes are converted by the caller. Returns tokens as an int."""
    try:
        return int(float(text))
    except ValueError:
        raise ConfigError(f"capacity {text!r}: give tokens (3e6) or bytes with a unit") from None


def _capacity_tokens(text: str, block_bytes: int) -> int:
    t = text.strip()
    if t and t[-1].isalpha():
        return parse_size(t, "capacity") // block_bytes * TOKENS_PER_BLOCK
    return parse_capacity(t)


def _key(i: int) -> bytes:
    return (i + 1).to_bytes(16, "big")


# ---------------------------------------------------------------------- reference points

def replay_infinite(trace: Sequence[Sequence[int]]) -> tuple[int, int]:
    seen: set[int] = set()
    hits = total = 0
    for ids in trace:
        n = 0
        while n < len(ids) and ids[n] in seen:
            n += 1
        hits += n
        total += len(ids)
        seen.update(ids)
    return hits, total


def replay_belady(trace: Sequence[Sequence[int]], capacity_blocks: int) -> tuple[int, int]:
    """Belady's MIN on the flattened access sequence, with leading-run hit counting."""
    flat = [b for ids in trace for b in ids]
    nxt = [math.inf] * len(flat)
    last: dict[int, int] = {}
    for pos in range(len(flat) - 1, -1, -1):
        nxt[pos] = last.get(flat[pos], math.inf)
        last[flat[pos]] = pos
    cache: dict[int, float] = {}            # block -> its next use
    heap: list[tuple[float, int]] = []      # (-next use, block), lazily invalidated
    hits = total = 0
    pos = 0
    for ids in trace:
        n = 0
        while n < len(ids) and ids[n] in cache:
            n += 1
        hits += n
        total += len(ids)
        for b in ids:
            nu = nxt[pos]
            pos += 1
            if b not in cache and len(cache) >= capacity_blocks:
                while heap:
                    neg, victim = heapq.heappop(heap)
                    if cache.get(victim) == -neg:
                        del cache[victim]
                        break
            if capacity_blocks > 0:
                cache[b] = nu
                heapq.heappush(heap, (-nu, b))
    return hits, total


# ---------------------------------------------------------------------- through the engine

def replay_engine(trace: Sequence[Sequence[int]], policy: str, capacity_blocks: int,
                  nvme_blocks: int = 0, block_bytes: int = 1, progress: Any = None,
                  leaf_first: bool = False) -> Result:
    from kvtier.coherence.engine import Engine
    from kvtier.types import Tier

    from kvtier.coherence.space import capacity_for

    tmp = tempfile.mkdtemp(prefix="kvtier-replay-")
    try:
        # The NVMe tier holds at most nvme_blocks blocks (segment headers and the reclaim
        # headroom are on top, as they are on disk).
        nvme_bytes, segment = capacity_for(nvme_blocks, block_bytes) if nvme_blocks else (0, 0)
        settings = make_settings({
            "data_dir": tmp, "host_capacity": max(1, capacity_blocks) * block_bytes,
            "nvme_capacity": nvme_bytes, "write_policy": "write_back", "eviction": policy,
            "segment_bytes": max(segment, 1 << 20), "leaf_first": leaf_first})
        eng = Engine(settings)
        eng.create_namespace("trace", block_bytes)
        hits = total = 0
        cap = max(1, capacity_blocks)
        before = {t: eng.counters.tiers[t].hits for t in Tier}
        payload = np.zeros((cap, block_bytes), dtype=np.uint8)
        log = eng.namespace("trace").log
        nvme_max = 0
        for ids in trace:
            keys = b"".join(_key(i) for i in ids)
            n = eng.match_prefix("trace", keys) if ids else 0
            hits += n
            total += len(ids)
            if n:
                res = eng.get("trace", keys[: n * 16])
                eng.release(res.lease_id)
            # Store the misses in order, each chained to the block before it; a run longer
            # than the tier goes in tier-sized pieces (the tail is what stays, as in LRU).
            for lo in range(n, len(ids), cap):
                hi = min(len(ids), lo + cap)
                parents = (_key(ids[lo - 1]) if lo else bytes(16)) + keys[lo * 16:(hi - 1) * 16]
                eng.put("trace", keys[lo * 16: hi * 16], payload[: hi - lo], parents=parents)
            if log is not None:
                nvme_max = max(nvme_max, log.live_bytes() // log.record_bytes)
            if progress is not None:
                progress()
        tier_hits = {t.label: eng.counters.tiers[t].hits - before[t]
                     for t in (Tier.HOST, Tier.NVME)}
        eng.close(flush=False)
        return Result(policy, capacity_blocks * TOKENS_PER_BLOCK, hits / total if total else 0,
                      hits, total, tier_hits, leaf_first, nvme_max)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(trace: Sequence[Sequence[int]], policy: str, capacity_tokens: int, nvme_tokens: int = 0,
        block_bytes: int = 1, progress: Any = None, leaf_first: bool = False) -> Result:
    blocks = capacity_tokens // TOKENS_PER_BLOCK
    if policy == "infinite":
        h, t = replay_infinite(trace)
        return Result(policy, capacity_tokens, h / t, h, t, {"host": h})
    if policy == "belady":
        h, t = replay_belady(trace, blocks + nvme_tokens // TOKENS_PER_BLOCK)
        return Result(policy, capacity_tokens, h / t, h, t, {"host": h})
    if policy not in EVICTION_POLICIES:
        raise ConfigError(f"policy {policy!r}: use one of "
                          f"{', '.join((*EVICTION_POLICIES, *REFERENCES))}")
    return replay_engine(trace, policy, blocks, nvme_tokens // TOKENS_PER_BLOCK, block_bytes,
                         progress, leaf_first)


def plot(results: list[Result], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r.policy for r in results):
        rs = sorted((r for r in results if r.policy == policy), key=lambda r: r.capacity_tokens)
        ax.plot([r.capacity_tokens for r in rs], [r.hit_ratio for r in rs], marker="o",
                label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("host-tier capacity (tokens)")
    ax.set_ylabel("prefix-block hit ratio")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvtier replay", description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="Mooncake-format JSONL trace")
    ap.add_argument("--capacity", action="append", required=True,
                    help="host-tier capacity in tokens (3e6) or bytes (4GiB); repeat or "
                         "comma-separate for a curve")
    ap.add_argument("--nvme-capacity", default="0", help="an NVMe tier below, in tokens")
    ap.add_argument("--policy", action="append",
                    help=f"{', '.join((*EVICTION_POLICIES, *REFERENCES))}; repeatable "
                         "(default: lru)")
    ap.add_argument("--block-bytes", type=int, default=4096,
                    help="bytes per block when data is carried")
    ap.add_argument("--metadata-only", action="store_true", help="1-byte blocks: no copying")
    ap.add_argument("--leaf-first", action="store_true",
                    help="the service's prefix-aware eviction (children before parents); off "
                         "by default so that 'lru' is the textbook LRU of the reference points")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot", help="write the hit-ratio-vs-capacity curve to this PNG")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    trace = load_trace(args.trace)
    bb = 1 if args.metadata_only else args.block_bytes
    if bb <= 0:
        raise ConfigError("--block-bytes must be positive")
    caps = [_capacity_tokens(c, bb) for arg in args.capacity for c in arg.split(",") if c]
    if any(c < TOKENS_PER_BLOCK for c in caps):
        raise ConfigError(f"capacity below one block ({TOKENS_PER_BLOCK} tokens)")
    policies = [p for arg in (args.policy or ["lru"]) for p in arg.split(",") if p]
    nvme = parse_capacity(args.nvme_capacity)
    results: list[Result] = []
    from rich.progress import Progress
    with Progress(disable=args.no_progress or not sys.stderr.isatty(),
                  transient=True) as prog:
        for policy in policies:
            for cap in caps:
                task = prog.add_task(f"{policy} @ {cap:.3g} tokens", total=len(trace))
                results.append(run(trace, policy, cap, nvme, bb,
                                   progress=lambda t=task: prog.advance(t),
                                   leaf_first=args.leaf_first))
    if args.plot:
        plot(results, args.plot)
    if args.json:
        out: dict[str, Any] = {"trace": str(args.trace), "requests": len(trace),
                               "results": [r.as_dict() for r in results]}
        if len(results) == 1:
            out.update(results[0].as_dict())
        print(json.dumps(out))
    else:
        print(f"{'policy':<10} {'capacity':>12} {'hit ratio':>9} {'hits':>8} {'blocks':>8}")
        for r in results:
            print(f"{r.policy:<10} {r.capacity_tokens:>12,} {r.hit_ratio:>9.4f} "
                  f"{r.hits:>8} {r.blocks:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
