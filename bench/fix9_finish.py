"""The CPU of a get's finish step (fix9: its except blocks, the lease made last), in process.

    python bench/fix9_finish.py [--reps N] [--json]

Thread CPU time (time.thread_time_ns) per call, median and p90 over --reps calls, of:
- miss: a get of 8 resident keys and 1 never stored (the general path's split, then
  Gets._finish_get and _lease_get with no read), and its release;
- nvme: a get of 8 keys on NVMe only (the decide, the read, the install: _install_read,
  the C check and set_copy), timed alone; their host copies are dropped again, untimed, between.
Run it from two trees alternately (the base and the head, same built C helpers) to compare:
bench/results/fix9-finish-*.txt names the runs. CPU time, not wall time: the dev VM's 2
cores are shared with other sessions.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from kvtier.coherence.engine import Engine
    from kvtier.config import make_settings
    from kvtier.types import Tier

    info = header("fix9_finish")
    bb = 4096

    def key(i: int) -> bytes:
        return (i + 1).to_bytes(16, "big")

    with tempfile.TemporaryDirectory() as tmp:
        eng = Engine(make_settings({"data_dir": tmp, "host_capacity": "1MiB",
                                    "nvme_capacity": "64MiB", "write_policy": "write_back"}))
        eng.create_namespace("m", bb)
        data = np.random.default_rng(1).integers(0, 256, (16, bb), dtype=np.uint8)
        eng.put("m", b"".join(key(i) for i in range(8, 16)), data[8:])
        eng.flush()
        eng.evict(Tier.HOST, 1 << 20)
        eng.put("m", b"".join(key(i) for i in range(8)), data[:8])
        miss = b"".join(key(i) for i in range(8)) + key(999)
        nvme = b"".join(key(i) for i in range(8, 16))
        ns = eng.namespace("m")
        nrows = ns.table.lookup(ns.table.keys_array(nvme))
        t_miss = np.empty(args.reps, dtype=np.int64)
        t_nvme = np.empty(args.reps, dtype=np.int64)
        for i in range(args.reps):
            t0 = time.thread_time_ns()
            res = eng.get("m", miss)
            eng.release(res.lease_id)
            t_miss[i] = time.thread_time_ns() - t0
            t0 = time.thread_time_ns()
            res = eng.get("m", nvme)
            t_nvme[i] = time.thread_time_ns() - t0
            assert res.found.all()
            eng.release(res.lease_id)
            with eng.lock:                  # back to NVMe only (their copies are clean)
                eng.drop_copies(ns, nrows, Tier.HOST)
        eng.close(flush=False)
    out = {"machine": info, "reps": args.reps}
    for name, t in (("miss", t_miss), ("nvme", t_nvme)):
        out[name] = {"p50_us": float(np.percentile(t, 50)) / 1e3,
                     "p90_us": float(np.percentile(t, 90)) / 1e3}
    emit(out, args.json)


if __name__ == "__main__":
    main()
