"""`kvtier replay TRACE.jsonl`: what hit ratio a given amount of memory buys on a real workload.

The trace format is Mooncake's (../shared/traces/README.md): one JSON request per line with
``hash_ids``, the prompt's blocks of 512 tokens, and ``input_length``, its tokens. A request hits
only on the leading run of its blocks that is cached; then every block of the request is accessed
in order (hits are read, misses are stored with the previous block as parent), as a serving
engine would. Two ratios are reported: blocks hit over blocks asked for, and tokens hit over
prompt tokens (a request's last block is usually partial, and almost never reused).

Policies run through the real engine (kvtier.coherence.engine.Engine: its page table and its
policy objects), on a host tier of the given capacity and, in tiered mode, an HBM tier above it
(a host-memory stand-in; gets are served from it, as a GPU would read them) and an NVMe tier
below it, so the figures are the engine's own. ``--metadata-only`` makes blocks 1 byte so that no
time goes to copying; without it each block carries --block-bytes of data.

Reference points that do not go through the engine: ``infinite`` (nothing is ever evicted),
``belady`` (the offline optimum for this counting rule: on a miss with a full cache, drop the
block, resident or new, whose next use is furthest away; so it may decline to store a block) and
``belady_store`` (the same, made to store every block). Each capacity point also runs ``lru`` and
``belady`` for the same total capacity, and reports every policy's share of the gap between them
closed: (policy - lru) / (belady - lru).
"""

from __future__ import annotations

import argparse
import csv
import heapq
import io
import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from kvtier.config import (EVICTION_POLICIES, POLICY_PARAMETERS, make_settings, parse_size,
                           tier_values)
from kvtier.errors import CapacityError, ConfigError, StorageError

TOKENS_PER_BLOCK = 512
REFERENCES = ("infinite", "belady", "belady_store")
NVME_RECORD = 4096            # the NVMe log's unit: a 1-byte block still takes 4 KiB there


@dataclass(slots=True)
class Trace:
    """The requests' block ids and prompt lengths in tokens."""

    ids: list[list[int]]
    tokens: list[int]

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def accesses(self) -> int:
        return sum(len(i) for i in self.ids)


@dataclass(slots=True)
class Tiers:
    """Capacities of one replay point, in blocks."""

    host: int
    hbm: int = 0
    nvme: int = 0

    @property
    def total(self) -> int:
        return self.hbm + self.host + self.nvme

    def label(self) -> str:
        parts = [f"hbm {self.hbm * TOKENS_PER_BLOCK:.3g}"] if self.hbm else []
        parts.append(f"host {self.host * TOKENS_PER_BLOCK:.3g}")
        if self.nvme:
            parts.append(f"nvme {self.nvme * TOKENS_PER_BLOCK:.3g}")
        return " + ".join(parts)


@dataclass(slots=True)
class Result:
    policy: str
    tiers: Tiers
    hits: int
    blocks: int
    hit_tokens: int
    tokens: int
    tier_hits: dict[str, int] = field(default_factory=dict)
    cpu_s: float = 0.0
    gap_closed: float | None = None
    params: dict[str, str] = field(default_factory=dict)
    nvme_blocks_max: int = 0      # most blocks the NVMe tier held (sampled per request)

    @property
    def capacity_tokens(self) -> int:
        return self.tiers.total * TOKENS_PER_BLOCK

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        t = self.tiers
        return {"policy": self.policy, "params": self.params,
                "capacity_tokens": self.capacity_tokens,
                "hbm_tokens": t.hbm * TOKENS_PER_BLOCK, "host_tokens": t.host * TOKENS_PER_BLOCK,
                "nvme_tokens": t.nvme * TOKENS_PER_BLOCK,
                "hit_ratio": round(self.hit_ratio, 4),
                "token_hit_ratio": round(self.token_hit_ratio, 4),
                "gap_closed": None if self.gap_closed is None else round(self.gap_closed, 4),
                "hits": self.hits, "blocks": self.blocks, "hit_tokens": self.hit_tokens,
                "tokens": self.tokens,
                "tier_hit_ratio": {k: round(h / self.blocks, 4) if self.blocks else 0.0
                                   for k, h in self.tier_hits.items()},
                "cpu_s": round(self.cpu_s, 3), "nvme_blocks_max": self.nvme_blocks_max,
                "cpu_s_per_million_accesses": round(self.cpu_s / self.blocks * 1e6, 3)
                if self.blocks else 0.0}


def load_trace(path: str | Path) -> Trace:
    """The hash_ids and input_length of every request. Raises ConfigError naming the line of
    any bad record. A record without input_length counts as whole blocks."""
    out: list[list[int]] = []
    tokens: list[int] = []
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
                length = rec.get("input_length", len(ids) * TOKENS_PER_BLOCK)
                if not isinstance(length, int) or isinstance(length, bool) or length < 0:
                    raise TypeError("input_length must be a non-negative integer")
            except (ValueError, KeyError, TypeError, UnicodeDecodeError,
                    AttributeError) as exc:
                raise ConfigError(f"{path}:{n}: not a Mooncake trace record ({exc})") from None
            out.append(ids)
            tokens.append(min(length, len(ids) * TOKENS_PER_BLOCK))
    if not out:
        raise ConfigError(f"{path}: no requests in the trace")
    return Trace(out, tokens)


def parse_capacity(text: str) -> int:
    """Tokens ('3000000', '3e6'); returned as an int."""
    try:
        value = int(float(text))
    except (ValueError, OverflowError):
        raise ConfigError(f"capacity {text!r}: give tokens (3e6) or bytes with a unit "
                          "(4GiB)") from None
    if value < 0:
        raise ConfigError(f"capacity {text!r} is negative")
    return value


def _capacity_tokens(text: str, block_bytes: int) -> int:
    t = text.strip()
    if t and t[-1].isalpha():
        return parse_size(t, "capacity") // block_bytes * TOKENS_PER_BLOCK
    return parse_capacity(t)


def _tier_blocks(text: str, host_blocks: int, block_bytes: int, name: str) -> int:
    """An HBM or NVMe capacity: tokens, bytes with a unit, or a multiple of the host tier
    ('0.5x')."""
    t = text.strip().lower()
    if t.endswith("x"):
        try:
            mult = float(t[:-1])
        except ValueError:
            mult = -1.0
        if not mult >= 0:
            raise ConfigError(f"{name} {text!r}: a multiple of the host tier is written 0.5x")
        return int(round(mult * host_blocks))
    return _capacity_tokens(t, block_bytes) // TOKENS_PER_BLOCK


def sweep(text: str) -> list[int]:
    """'LO:HI:N' -> N capacities spaced evenly in log scale from LO to HI (tokens)."""
    parts = text.split(":")
    try:
        lo, hi, n = float(parts[0]), float(parts[1]), int(parts[2])
        if len(parts) != 3 or not 0 < lo <= hi or n < 1:
            raise ValueError
    except (ValueError, IndexError):
        raise ConfigError(f"--sweep {text!r}: expected LO:HI:N in tokens, such as 5e5:6e6:8, "
                          "with 0 < LO <= HI and N >= 1") from None
    if n == 1:
        return [int(lo)]
    return [int(round(lo * (hi / lo) ** (i / (n - 1)))) for i in range(n)]


# ---------------------------------------------------------------------- reference points

def _result(policy: str, trace: Trace, tiers: Tiers, hits_per_request: Sequence[int],
            cpu_s: float = 0.0) -> Result:
    hits = sum(hits_per_request)
    tok = sum(min(h * TOKENS_PER_BLOCK, t) for h, t in zip(hits_per_request, trace.tokens))
    return Result(policy, tiers, hits, trace.accesses, tok, sum(trace.tokens),
                  {"host": hits}, cpu_s)


def replay_infinite(trace: Trace) -> list[int]:
    """Hits per request with nothing ever evicted."""
    seen: set[int] = set()
    out = []
    for ids in trace.ids:
        n = 0
        while n < len(ids) and ids[n] in seen:
            n += 1
        out.append(n)
        seen.update(ids)
    return out


def replay_belady(trace: Trace, capacity_blocks: int, bypass: bool = True) -> list[int]:
    """Belady's MIN on the flattened access sequence, with leading-run hit counting. With
    bypass, a new block whose next use is further than every resident block's is not stored
    (the optimum for this counting rule); without, it is, and the furthest resident one goes."""
    flat = [b for ids in trace.ids for b in ids]
    nxt = [math.inf] * len(flat)
    last: dict[int, int] = {}
    for pos in range(len(flat) - 1, -1, -1):
        nxt[pos] = last.get(flat[pos], math.inf)
        last[flat[pos]] = pos
    cache: dict[int, float] = {}            # block -> its next use
    heap: list[tuple[float, int]] = []      # (-next use, block), lazily invalidated
    out = []
    pos = 0
    for ids in trace.ids:
        n = 0
        while n < len(ids) and ids[n] in cache:
            n += 1
        out.append(n)
        for b in ids:
            nu = nxt[pos]
            pos += 1
            if capacity_blocks <= 0:
                continue
            if b not in cache and len(cache) >= capacity_blocks:
                while cache.get(heap[0][1]) != -heap[0][0]:
                    heapq.heappop(heap)
                if bypass and -heap[0][0] <= nu:
                    continue                # the new block is the one used furthest away
                del cache[heapq.heappop(heap)[1]]
            cache[b] = nu
            heapq.heappush(heap, (-nu, b))
    return out


# ---------------------------------------------------------------------- through the engine

def _keys(trace: Trace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every access's 16-byte key (id + 1, big-endian) and its parent's (all zeros for none),
    as V16 arrays, and each request's start in them."""
    flat = np.fromiter((b for ids in trace.ids for b in ids), dtype=np.uint64,
                       count=trace.accesses)
    starts = np.zeros(len(trace) + 1, dtype=np.int64)
    starts[1:] = np.cumsum([len(i) for i in trace.ids])
    raw = np.zeros((flat.size, 2), dtype=">u8")
    raw[:, 1] = flat + np.uint64(1)
    keys = raw.view("V16").reshape(-1)
    praw = np.zeros_like(raw)
    praw[1:] = raw[:-1]
    praw[starts[:-1][starts[:-1] < flat.size]] = 0   # a request's first block has no parent
    return keys, praw.view("V16").reshape(-1), starts


def replay_engine(trace: Trace, policy: str, tiers: Tiers, block_bytes: int = 1,
                  progress: Callable[[], None] | None = None,
                  params: dict[str, str] | None = None, data_dir: str | None = None) -> Result:
    from kvtier.coherence.engine import Engine
    from kvtier.tiers.host import SlotPool
    from kvtier.types import Tier

    tmp = tempfile.mkdtemp(prefix="kvtier-replay-", dir=data_dir)
    params = params or {}
    try:
        from kvtier.coherence.space import capacity_for
        # The NVMe tier holds at most tiers.nvme blocks (segment headers and the reclaim
        # headroom are on top, as they are on disk).
        nvme_bytes, segment = capacity_for(tiers.nvme, block_bytes) if tiers.nvme else (0, 0)
        settings = make_settings({
            "data_dir": tmp, "host_capacity": max(1, tiers.host) * block_bytes,
            "hbm_capacity": tiers.hbm * block_bytes, "nvme_capacity": nvme_bytes,
            "write_policy": "write_back", "eviction": policy,
            "segment_bytes": max(segment, 1 << 20),
            "prefetch_blocks": 0,
            **{f"eviction_{k}": v for k, v in params.items()}})
        hbm = (lambda name, bb, n: SlotPool(name, bb, n)) if tiers.hbm else None
        eng = Engine(settings, hbm_pool_factory=hbm)
        eng.create_namespace("trace", block_bytes)
        top = Tier.HBM if tiers.hbm else Tier.HOST
        cap = max(1, tiers.host)
        before = {t: eng.counters.tiers[t].hits for t in Tier}
        payload = np.zeros((min(cap, max(map(len, trace.ids))), block_bytes), dtype=np.uint8)
        # The payload's first m rows for each m, made once: the same zero blocks the put
        # took as a fresh slice each time (a numpy slice is ~1.5k instructions).
        blocks = [payload[:m] for m in range(payload.shape[0] + 1)]
        keys, parents, starts = _keys(trace)
        out = []
        log = eng.namespace("trace").log
        try_get, lookup_prefix, lease_one = eng.try_get, eng.lookup_prefix, eng.lease_one
        ns, lock = eng.namespace("trace"), eng.lock
        nvme_max = 0
        cpu0 = time.process_time()
        bounds = starts.tolist()           # Python ints: no numpy scalar per request
        for i in range(len(trace)):
            a, b = bounds[i], bounds[i + 1]
            req = keys[a:b]
            n = lookup_prefix("trace", req)[0] if b > a else 0     # match_prefix's own
            out.append(n)
            if n:
                # As the service answers a host get of resident blocks (api/resident.py: on
                # its loop; one key through lease_one, no GetResult: _get_one_resident, the
                # replay's commonest get; more through try_get, not the general get's
                # steps); anything else, and every HBM get, goes the general way.
                lid = None
                if n == 1 and top is Tier.HOST:
                    with lock:
                        hit = lease_one(ns, req[:1], 0)
                    lid = None if hit is None else hit[0]
                if lid is None:
                    res = try_get("trace", req[:n]) if top is Tier.HOST else None
                    if res is None:
                        res = eng.get("trace", req[:n], tier=top)
                    lid = res.lease_id
                eng.release(lid)
            # Store the misses in order, each chained to the block before it; a run longer
            # than the tier goes in tier-sized pieces (the tail is what stays, as in LRU).
            for lo in range(a + n, b, cap):
                hi = b if b < lo + cap else lo + cap
                part = req if lo == a and hi == b else keys[lo:hi]    # a whole miss: req
                eng.put("trace", part, blocks[hi - lo], parents=parents[lo:hi])
            if log is not None:
                nvme_max = max(nvme_max, log.live_bytes() // log.record_bytes)
            if progress is not None:
                progress()
        cpu = time.process_time() - cpu0
        tier_hits = {t.label: eng.counters.tiers[t].hits - before[t]
                     for t in (Tier.HBM, Tier.HOST, Tier.NVME) if t is not Tier.HBM or tiers.hbm}
        eng.close(flush=False)
        res_ = _result(policy, trace, tiers, out, cpu)
        res_.tier_hits = tier_hits
        res_.params = dict(params)
        res_.nvme_blocks_max = nvme_max
        return res_
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(trace: Trace, policy: str, tiers: Tiers, block_bytes: int = 1,
        progress: Callable[[], None] | None = None,
        params: dict[str, str] | None = None, data_dir: str | None = None) -> Result:
    if policy == "infinite":
        return _result(policy, trace, tiers, replay_infinite(trace))
    if policy in ("belady", "belady_store"):
        t0 = time.process_time()
        hits = replay_belady(trace, tiers.total, bypass=policy == "belady")
        return _result(policy, trace, tiers, hits, time.process_time() - t0)
    if policy not in EVICTION_POLICIES:
        raise ConfigError(f"policy {policy!r}: use one of "
                          f"{', '.join((*EVICTION_POLICIES, *REFERENCES))}")
    return replay_engine(trace, policy, tiers, block_bytes, progress, params, data_dir)


def close_gaps(results: list[Result]) -> None:
    """Set each result's share of the lru -> belady gap at its capacity point."""
    def point(r: Result) -> tuple[int, int, int]:
        return (r.tiers.hbm, r.tiers.host, r.tiers.nvme)
    base = {(point(r), r.policy): r.hit_ratio for r in results if not r.params}
    for r in results:
        lo, hi = base.get((point(r), "lru")), base.get((point(r), "belady"))
        if lo is not None and hi is not None and hi > lo:
            r.gap_closed = (r.hit_ratio - lo) / (hi - lo)


def label(r: Result) -> str:
    extra = ",".join(f"{k}={v}" for k, v in sorted(r.params.items()))
    return r.policy + (f"[{extra}]" if extra else "")


def plot(results: list[Result], path: str, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, gx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in dict.fromkeys(label(r) for r in results):
        rs = sorted((r for r in results if label(r) == name), key=lambda r: r.capacity_tokens)
        ax.plot([r.capacity_tokens for r in rs], [r.hit_ratio for r in rs], marker="o",
                label=name)
        if name not in ("lru", "belady", "infinite") and any(r.gap_closed is not None
                                                              for r in rs):
            gx.plot([r.capacity_tokens for r in rs], [100 * (r.gap_closed or 0) for r in rs],
                    marker="o", label=name)
    for a in (ax, gx):
        a.set_xscale("log")
        a.set_xlabel("total capacity (tokens)")
        a.grid(True, alpha=0.3)
    ax.set_ylabel("prefix-block hit ratio")
    ax.set_ylim(0, None)
    ax.legend(fontsize=8)
    gx.set_ylabel("% of the lru -> belady gap closed")
    gx.axhline(0, color="black", lw=0.8)
    if gx.lines:
        gx.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


CSV_FIELDS = ("policy", "params", "capacity_tokens", "hbm_tokens", "host_tokens", "nvme_tokens",
              "hit_ratio", "token_hit_ratio", "gap_closed", "hits", "blocks", "hit_tokens",
              "tokens", "cpu_s", "cpu_s_per_million_accesses")


def to_csv(results: list[Result]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in results:
        d = r.as_dict()
        d["params"] = ";".join(f"{k}={v}" for k, v in sorted(r.params.items()))
        w.writerow(d)
    return buf.getvalue()


def table(results: list[Result]) -> str:
    lines = [f"{'policy':<24} {'capacity':>26} {'hit ratio':>9} {'tokens':>7} {'gap':>7} "
             f"{'cpu s/M':>8}"]
    for r in results:
        gap = "" if r.gap_closed is None else f"{100 * r.gap_closed:+.1f}%"
        cpu = "" if r.policy in REFERENCES else f"{r.cpu_s / r.blocks * 1e6:.2f}"
        lines.append(f"{label(r):<24} {r.tiers.label():>26} {r.hit_ratio:>9.4f} "
                     f"{r.token_hit_ratio:>7.4f} {gap:>7} {cpu:>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvtier replay", description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="Mooncake-format JSONL trace")
    ap.add_argument("--capacity", action="append", default=[],
                    help="host-tier capacity in tokens (3e6) or bytes (4GiB); repeat or "
                         "comma-separate for a curve")
    ap.add_argument("--sweep", help="LO:HI:N: N host capacities, log-spaced, in tokens")
    ap.add_argument("--hbm-capacity", default="0",
                    help="tiered mode: an HBM tier above host, in tokens, bytes, or a multiple "
                         "of the host capacity (0.25x)")
    ap.add_argument("--nvme-capacity", default="0",
                    help="tiered mode: an NVMe tier below host, in tokens, bytes or a multiple "
                         "of the host capacity (4x)")
    ap.add_argument("--policy", action="append",
                    help=f"{', '.join((*EVICTION_POLICIES, *REFERENCES))}; repeatable or "
                         "comma-separated (default: chain); lru and belady always run too")
    for name in POLICY_PARAMETERS:
        ap.add_argument(f"--{name.replace('_', '-')}", action="append",
                        help=f"s3fifo/chain parameter eviction_{name} (see kvtier config); "
                             "repeat or comma-separate to compare values (tier:value pairs, "
                             "such as host:4x,hbm:1x, are one value)")
    ap.add_argument("--block-bytes", type=int, default=4096,
                    help="bytes per block when data is carried")
    ap.add_argument("--metadata-only", action="store_true", help="1-byte blocks: no copying")
    ap.add_argument("--data-dir", help="where each run's engine keeps its files (default: the "
                    "system's temporary directory; /dev/shm spares a tiered replay its fsyncs)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--csv", help="also write the results to this CSV file")
    ap.add_argument("--plot", help="write the hit-ratio and gap-closed curves to this PNG")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    trace = load_trace(args.trace)
    bb = 1 if args.metadata_only else args.block_bytes
    if bb <= 0:
        raise ConfigError("--block-bytes must be positive")
    caps = [_capacity_tokens(c, bb) for arg in args.capacity for c in arg.split(",") if c]
    if args.sweep:
        caps += sweep(args.sweep)
    if not caps:
        raise ConfigError("give --capacity (tokens, such as 1e6) or --sweep LO:HI:N")
    if any(c < TOKENS_PER_BLOCK for c in caps):
        raise ConfigError(f"capacity below one block ({TOKENS_PER_BLOCK} tokens)")
    points = []
    for c in caps:
        host = c // TOKENS_PER_BLOCK
        points.append(Tiers(host, _tier_blocks(args.hbm_capacity, host, bb, "--hbm-capacity"),
                            _tier_blocks(args.nvme_capacity, host, bb, "--nvme-capacity")))
    asked = [p for arg in (args.policy or ["chain"]) for p in arg.split(",") if p]
    for p in asked:
        if p not in (*EVICTION_POLICIES, *REFERENCES):
            raise ConfigError(f"policy {p!r}: use one of "
                              f"{', '.join((*EVICTION_POLICIES, *REFERENCES))}")
    policies = list(dict.fromkeys(["lru", "belady", *asked]))
    variants = _param_variants(args)
    jobs = [(pol, pt, prm) for pt in points for pol in policies
            for prm in (variants if pol in ("s3fifo", "chain") else [{}])]
    results: list[Result] = []
    failed: list[dict[str, Any]] = []
    from rich.progress import Progress
    quiet = args.no_progress or not sys.stderr.isatty()
    with Progress(disable=quiet, transient=True) as prog:
        overall = prog.add_task("replay", total=len(jobs))
        for pol, pt, prm in jobs:
            task = prog.add_task(f"{pol} @ {pt.label()}", total=len(trace))
            # A hidden bar is not advanced: rich's advance runs inside the timed loop (~5 us
            # a request on the dev VM, 2-3% of the CPU figure) even when it draws nothing.
            tick = None if quiet else (lambda t=task: prog.advance(t))
            try:
                results.append(run(trace, pol, pt, bb, progress=tick,
                                   params=prm, data_dir=args.data_dir))
            except (CapacityError, StorageError) as exc:
                # The engine refused a put at this point (a tier that could not make room):
                # the point is reported as failed and the sweep goes on.
                failed.append({"policy": pol, "params": prm, "capacity": pt.label(),
                               "error": f"{type(exc).__name__}: {exc}"})
                print(f"kvtier replay: {pol} @ {pt.label()} failed: {exc}", file=sys.stderr)
            prog.remove_task(task)
            prog.advance(overall)
    close_gaps(results)
    if args.plot:
        plot(results, args.plot, Path(args.trace).name)
    if args.csv:
        Path(args.csv).write_text(to_csv(results), encoding="utf-8")
    if args.json:
        print(json.dumps({"trace": str(args.trace), "requests": len(trace),
                          "accesses": trace.accesses, "block_bytes": bb,
                          "results": [r.as_dict() for r in results], "failed": failed}))
    else:
        print(table(results))
    return 1 if failed else 0


def _param_variants(args: argparse.Namespace) -> list[dict[str, str]]:
    """Every combination of the parameter values given (one empty dict when none is)."""
    from kvtier.coherence.policies import parse_param
    variants: list[dict[str, str]] = [{}]
    for name in POLICY_PARAMETERS:
        given = getattr(args, name)
        if not given:
            continue
        # A value of tier:value pairs (host:true,nvme:false) is one value; else commas
        # separate the values to compare.
        values = [v for arg in given for v in ([arg] if ":" in arg else arg.split(",")) if v]
        for v in values:
            for one in tier_values(v, f"eviction_{name}").values():
                parse_param(name, one)
        variants = [{**d, name: v} for d in variants for v in values]
    return variants


if __name__ == "__main__":
    sys.exit(main())
