"""Page-table footprint and batched lookup speed at N entries.

    python bench/pagetable.py --entries 10000000 --json

bytes_per_entry is the growth in resident memory (RSS) while N entries are inserted, with every
column written (so untouched zero pages do not flatter the figure), divided by N. lookup_1k_ms is
the median time of one batched lookup of 1,000 random present keys. The baseline, measured in the
same run, is what DESIGN.md calls the naive layout: a Python dict from 16-byte key to row, at
min(N, 1,000,000) entries, with lookups through a list comprehension.
Targets at N = 10,000,000: bytes_per_entry <= 160, lookup_1k_ms <= 1.0.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import emit, header, percentiles, rss_bytes  # noqa: E402
from kvtier.memory import tune_malloc  # noqa: E402
from kvtier.pagetable.table import PageTable  # noqa: E402


def fill(table: PageTable, n: int, batch: int = 1 << 20) -> None:
    rng = np.random.default_rng(1)
    for lo in range(0, n, batch):
        k = min(batch, n - lo)
        rows, _ = table.insert(rng.bytes(16 * k))
        c = table.cols
        c["version"][rows] = 1
        c["size"][rows] = 65536
        c["checksum"][rows] = rows
        c["state"][rows] = 2
        c["slot"][rows] = rows[:, None] % 1000
        c["nvme_off"][rows] = rows
        c["nvme_checksum"][rows] = rows
        c["copy_ver"][rows] = 1
        c["parent"][rows] = rows - 1
        c["first_child"][rows] = rows + 1
        c["next_sib"][rows] = -1
        c["last_access"][rows] = rows
        c["prev_access"][rows] = rows
        c["freq"][rows] = 1
        c["leases"][rows] = 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = header("bench/pagetable.py")
    tune_malloc()    # as `kvtier serve` does; see kvtier/memory.py
    n = args.entries

    gc.collect()
    before = rss_bytes()
    t0 = time.perf_counter()
    table = PageTable(16)
    fill(table, n)
    build_s = time.perf_counter() - t0
    grown = rss_bytes() - before
    rng = np.random.default_rng(2)
    live = table.cols["key"][: table.n_rows]
    samples = []
    for _ in range(args.repeat):
        q = live[rng.integers(0, n, 1000)]
        t0 = time.perf_counter()
        rows = table.lookup(q)
        samples.append(time.perf_counter() - t0)
    if (rows < 0).any():
        raise SystemExit("lookup missed a present key")
    look = percentiles([s * 1000 for s in samples])

    # Baseline: dict key -> row, at up to 1M entries.
    bn = min(n, 1_000_000)
    keys = [bytes(k) for k in live[:bn]]
    del table, live
    gc.collect()
    b0 = rss_bytes()
    d = {k: i for i, k in enumerate(keys)}
    dict_bpe = (rss_bytes() - b0) / bn
    dsamples = []
    for _ in range(args.repeat):
        q = [keys[i] for i in rng.integers(0, bn, 1000).tolist()]
        t0 = time.perf_counter()
        _ = [d.get(k, -1) for k in q]
        dsamples.append(time.perf_counter() - t0)
    dlook = percentiles([s * 1000 for s in dsamples])
    emit({"entries": n, "bytes_per_entry": round(grown / n, 1),
          "lookup_1k_ms": round(look["p50"], 4), "lookup_1k_ms_p99": round(look["p99"], 4),
          "build_s": round(build_s, 2),
          "baseline_dict_entries": bn,
          "baseline_dict_bytes_per_entry_key_to_row_only": round(dict_bpe, 1),
          "baseline_dict_lookup_1k_ms": round(dlook["p50"], 4),
          "ratio_lookup_vs_dict": round(look["p50"] / dlook["p50"], 3),
          "machine": m}, args.json)


if __name__ == "__main__":
    main()
