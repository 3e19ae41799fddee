"""The locked steps of an NVMe reader's get, timed in process (what bench/stall.py's probe waits
behind: the server runs them on its loop, one per iteration).

    python bench/stall_steps.py --json
    python bench/stall_steps.py --cold-blocks 512 --host-capacity 8MiB --gets 20 --json  # smoke

An engine shaped as bench/stall.py's service (64 MiB host tier, write-back, the cold set on
NVMe), driven by get_steps as the server drives it (room first). Each locked step is timed
under the lock; the evictions each step made are counted (the decide should find the room that
the room step made). The read runs between them, untimed. "steps": the three steps' time per
get (the decide with its read's batch, the install with its lease: stall10 split each in two
slices); "slices": each locked step alone, as the server's loop runs it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import TYPE_CHECKING

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header, percentiles  # noqa: E402

if TYPE_CHECKING:
    from kvtier.coherence.engine import Engine


# The locked steps an NVMe get's three steps were split into (stall10, stall12: each a slice
# of the server's loop), counted in "steps" with the step they came from, and alone in
# "slices".
STEP_OF = {"_bring_up_step": "_get_decide", "_read_step": "_get_decide",
           "_lease_step": "_finish_get", "_room_rest": "_room_for_get"}


def key(i: int) -> bytes:
    return (i + 2).to_bytes(16, "big")


def stall_engine(base: str, args: argparse.Namespace, **settings: object) -> "Engine":
    """bench/stall.py's service shape in process (args' host capacity, write-back, NVMe room
    for twice the cold set): namespace s with args.cold_blocks blocks of args.block_bytes
    put and flushed, most of them on NVMe only. settings: more of the engine's settings."""
    from kvtier.coherence.engine import Engine
    from kvtier.config import make_settings
    bb = args.block_bytes
    eng = Engine(make_settings({
        "data_dir": base, "host_capacity": args.host_capacity,
        "nvme_capacity": str(args.cold_blocks * bb * 2 + (64 << 20)),
        "segment_bytes": "64MiB", "write_policy": "write_back", **settings}))
    try:
        eng.create_namespace("s", bb)
        data = np.random.default_rng(0).integers(0, 256, (64, bb), dtype=np.uint8)
        for lo in range(0, args.cold_blocks, 64):
            n = min(64, args.cold_blocks - lo)
            eng.put("s", b"".join(key(i) for i in range(lo, lo + n)), data[:n])
        eng.flush()
    except BaseException:
        eng.close(flush=False)
        raise
    return eng


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--block-bytes", type=int, default=64 << 10)
    ap.add_argument("--cold-blocks", type=int, default=4096)
    ap.add_argument("--host-capacity", default="64MiB")
    ap.add_argument("--gets", type=int, default=400, help="timed gets (after 100 warm ones)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = header("bench/stall_steps.py")
    from kvtier.coherence.gets import advance
    from kvtier.types import Tier
    base = tempfile.mkdtemp(prefix="kvtier-stall-steps-", dir=os.getcwd())
    bb = args.block_bytes
    eng = stall_engine(base, args)
    try:
        rng = np.random.default_rng(1)
        host = eng.counters.tiers[Tier.HOST]
        times: dict[str, list[float]] = {}
        slices: dict[str, list[float]] = {}
        evictions: dict[str, int] = {}

        def one() -> None:
            ks = b"".join(key(int(k)) for k in rng.choice(args.cold_blocks, args.batch,
                                                            replace=False))
            steps = eng.get_steps("s", ks, 0)
            step, out = advance(steps, None, None)
            per_get: dict[str, float] = {}
            while step is not None:
                if step.locked:
                    name = step.fn.func.__name__
                    before = host.evictions
                    with eng.lock:
                        t0 = time.perf_counter()
                        value = step.fn()
                        dt = time.perf_counter() - t0
                    slices.setdefault(name, []).append(dt)
                    name = STEP_OF.get(name, name)
                    per_get[name] = per_get.get(name, 0.0) + dt
                    evictions[name] = evictions.get(name, 0) + (host.evictions > before)
                else:
                    value = step.fn()
                step, out = advance(steps, value, None)
            for name, dt in per_get.items():
                times.setdefault(name, []).append(dt)
            eng.release(out.lease_id)

        for _ in range(100):
            one()
        times.clear()
        slices.clear()
        evictions.clear()
        for _ in range(args.gets):
            one()
    finally:
        eng.close(flush=False)
        shutil.rmtree(base, ignore_errors=True)
    out = {"batch": args.batch, "block_bytes": bb, "cold_blocks": args.cold_blocks,
           "gets": args.gets, "steps": {},
           "slices": {name: {"p50_us": round(percentiles(v)["p50"] * 1e6, 1),
                             "p90_us": round(percentiles(v)["p90"] * 1e6, 1)}
                      for name, v in slices.items()}}
    for name, v in times.items():
        p = percentiles(v)
        out["steps"][name] = {"p50_us": round(p["p50"] * 1e6, 1),
                              "p90_us": round(p["p90"] * 1e6, 1),
                              "p99_us": round(p["p99"] * 1e6, 1),
                              "steps_that_evicted": evictions.get(name, 0)}
    out["machine"] = m
    emit(out, args.json)


if __name__ == "__main__":
    main()
