"""Write_through puts into a full NVMe tier, with reclaimed segment files reused or not.

    python bench/spares.py --json [--rounds 3] [--seconds 6] [--dir DIR]

In process (kvtier.coherence.engine.Engine): puts of 16 new 64 KiB keys each, write_through,
into a 192 MiB tier of 16 MiB segments, after an untimed fill that has already reclaimed four
segments, so that every new segment of the timed part follows a reclaim (steady state). A: one
spare file kept per namespace (tiers.nvme.SPARES = 1; the default is 4 since fio10: the next segment reuses a
reclaimed file, and appends overwrite written blocks); B: none (every segment a new file, and
every append extends it). A and B alternate per round, A first in even rounds; the ratio is
the median over rounds of each pair's puts per second. Per-put latency percentiles per side.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header  # noqa: E402

BB = 64 << 10


def run(spares: int, seconds: float, where: str | None) -> dict:
    import kvtier.tiers.nvme as nvme
    from kvtier.coherence.engine import Engine
    from kvtier.config import make_settings
    nvme.SPARES = spares
    d = tempfile.mkdtemp(prefix="kvtier-spares-", dir=where)
    eng = Engine(make_settings({"data_dir": d, "host_capacity": 8 << 20,
                                "nvme_capacity": 192 << 20, "segment_bytes": 16 << 20,
                                "write_policy": "write_through"}))
    try:
        eng.create_namespace("s", BB)
        data = np.random.default_rng(1).integers(0, 256, (16, BB), dtype=np.uint8)
        i = 0

        def put() -> None:
            nonlocal i
            eng.put("s", b"".join((i * 16 + j + 1).to_bytes(16, "big") for j in range(16)), data)
            i += 1
        while eng.nvme.space.reclaimed < 4:
            put()
        lat = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            put()
            lat.append(time.perf_counter() - t0)
        a = np.asarray(lat) * 1e3
        return {"spares": spares, "puts": int(a.size), "puts_per_s": round(a.size / seconds, 1),
                "mib_s": round(a.size * 16 * BB / 2**20 / seconds, 1),
                "p50_ms": round(float(np.median(a)), 2),
                "p90_ms": round(float(np.percentile(a, 90)), 2),
                "p99_ms": round(float(np.percentile(a, 99)), 2),
                "reclaims": eng.nvme.space.reclaimed}
    finally:
        eng.close(flush=False)
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--dir", default=None, help="where the data directories go (TMPDIR)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = header("bench/spares.py")
    rounds = []
    for r in range(args.rounds):
        order = (1, 0) if r % 2 == 0 else (0, 1)
        got = {s: run(s, args.seconds, args.dir) for s in order}
        rounds.append({"reused": got[1], "new_files": got[0],
                       "ratio": round(got[1]["puts_per_s"] / max(got[0]["puts_per_s"], 1e-9), 3)})
    out = {"rounds": rounds, "ratio_median": float(np.median([r["ratio"] for r in rounds])),
           "load_avg": os.getloadavg(), "machine": m}
    emit(out, args.json)


if __name__ == "__main__":
    main()
