"""A randrw fio job on the NVMe tier in process, with every compaction and reclaim timed
(issue 17, session 41: compaction after a flush paced, one candidate at a time).

    PYTHONPATH=TREE python bench/compaction_pace.py [--mix 50] [--runtime 4] [--dir DIR] --json

Reports the job's read / write MiB/s, the write latency's p99, p99.9 and max, the NVMe write
amplification, and per call of Space.compact and Space.reclaim their count, total, median and
longest time, with the rows each reclaim looked at. Run it against two trees alternated: the
machine's noise falls on both.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mix", type=int, default=50)
    ap.add_argument("--runtime", type=float, default=4)
    ap.add_argument("--dir", default="")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from kvtier import fio
    from kvtier.coherence import space as sp
    times: dict[str, list[float]] = collections.defaultdict(list)
    rows_seen: list[int] = []

    def timed(name: str):
        orig = getattr(sp.Space, name)

        def f(self, *a, **k):
            if name == "reclaim":
                rows_seen.append(int(self.of_segment(a[0], a[1].seg_id)[0].size))
            t0 = time.perf_counter()
            try:
                return orig(self, *a, **k)
            finally:
                times[name].append(time.perf_counter() - t0)
        setattr(sp.Space, name, f)
    for name in ("compact", "reclaim"):
        timed(name)
    job = fio.Job(name=f"rw{args.mix}", rw="randrw", bs=65536, iodepth=16, size=256 << 20,
                  runtime=args.runtime, tier="nvme", rwmixread=args.mix, directory=args.dir)
    res = fio.run_job(job)
    w, r = res["write"], res["read"]
    pct = w["clat_ns"]["percentile"]
    out = {"machine": header("compaction_pace"), "tree": ROOT, "mix": args.mix,
           "read_mib_s": round(r["bw_bytes"] / 2**20, 1),
           "write_mib_s": round(w["bw_bytes"] / 2**20, 1),
           "write_p99_ms": round(pct.get("99.000000", 0) / 1e6, 2),
           "write_p999_ms": round(pct.get("99.900000", 0) / 1e6, 2),
           "write_max_ms": round(w["clat_ns"]["max"] / 1e6, 2),
           "write_amplification": res["kvtier"].get("nvme_write_amplification"),
           "rows_per_reclaim": rows_seen}
    for name, ts in times.items():
        ts = sorted(ts)
        out[name] = {"n": len(ts), "total_ms": round(sum(ts) * 1e3, 1),
                     "median_ms": round(ts[len(ts) // 2] * 1e3, 2), "max_ms": round(ts[-1] * 1e3, 1)}
    emit(out, args.json)


if __name__ == "__main__":
    main()
