"""Load: many concurrent workers against one real `kvtier serve`, then a leak check.

    python bench/load.py --clients 64 --seconds 60 --json

Each client (a thread with its own kvtier.Client and connection) loops over a mix of ops on a
shared namespace: put (30%), get (40%), match_prefix (15%), leased get held briefly then
released (10%), delete (5%). Every get's bytes are checked against what was put for that key
(each key's block is a pure function of the key, so any mix-up is detected). Reported: ops,
errors (must be 0), wrong (must be 0), p50/p99 op latency, and the service's RSS at start and
end. After the load, leases, reservations and retired slots (old versions waiting for their
readers) must all be back to zero.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header, percentiles  # noqa: E402

BB = 16384


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def block(k: int) -> np.ndarray:
    b = np.full(BB, k % 251, dtype=np.uint8)
    b[:8] = np.frombuffer(k.to_bytes(8, "little"), dtype=np.uint8)
    return b


def key(k: int) -> bytes:
    return (k + 1).to_bytes(16, "big")


def worker(sock: str, cid: int, stop: threading.Event, keyspace: int, lat: list, counts: dict,
           lock: threading.Lock) -> None:
    import kvtier
    from kvtier.errors import KvtierError
    rng = random.Random(cid)
    ops = errors = wrong = 0
    mine: list[float] = []
    try:
        c = kvtier.Client(sock, timeout=30, name=f"load-{cid}")
        ns = c.namespace("load", block_bytes=BB)
    except KvtierError:
        with lock:
            counts["errors"] += 1
        return
    while not stop.is_set():
        ks = rng.sample(range(keyspace), rng.randint(1, 16))
        kb = b"".join(key(k) for k in ks)
        op = rng.random()
        t0 = time.perf_counter()
        try:
            if op < 0.30:
                ns.put(kb, np.stack([block(k) for k in ks]))
            elif op < 0.70:
                found, out = ns.get(kb)
                for k, f, row in zip(ks, found.tolist(), out):
                    if f and not np.array_equal(row, block(k)):
                        wrong += 1
            elif op < 0.85:
                ns.match_prefix(kb)
            elif op < 0.95:
                with ns.get_leased(kb) as lease:
                    for k, v in zip(ks, lease.views):
                        if v is not None and not np.array_equal(v, block(k)):
                            wrong += 1
            else:
                ns.delete(kb)
        except KvtierError:
            errors += 1
        mine.append(time.perf_counter() - t0)
        ops += 1
    c.close()
    with lock:
        counts["ops"] += ops
        counts["errors"] += errors
        counts["wrong"] += wrong
        lat.extend(mine)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--keys", type=int, default=4096)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = header("bench/load.py")
    import kvtier
    from tests.service import Service
    base = tempfile.mkdtemp(prefix="kvtier-load-", dir=os.getcwd())
    svc = Service(os.path.join(base, "svc"), admin=False, host_capacity="32MiB",
                  nvme_capacity="512MiB", write_policy="write_back", flush_interval=0.5).start()
    try:
        with kvtier.Client(svc.socket) as c:
            c.namespace("load", block_bytes=BB)
            base_stats = c.stats()
        rss_start = rss_mb(svc.proc.pid)
        stop = threading.Event()
        lat: list[float] = []
        counts = {"ops": 0, "errors": 0, "wrong": 0}
        lock = threading.Lock()
        threads = [threading.Thread(target=worker, args=(str(svc.socket), i, stop, args.keys,
                                                         lat, counts, lock))
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(args.seconds)
        stop.set()
        for t in threads:
            t.join()
        time.sleep(1.0)                      # let the last disconnects be processed
        rss_end = rss_mb(svc.proc.pid)
        with kvtier.Client(svc.socket) as c:
            end = c.stats()
        p = percentiles([x * 1000 for x in lat]) if lat else {"p50": 0, "p99": 0, "max": 0}
        out = {"clients": args.clients, "seconds": args.seconds, **counts,
               "ops_per_s": round(counts["ops"] / args.seconds, 1),
               "p50_ms": round(p["p50"], 3), "p99_ms": round(p["p99"], 3),
               "max_ms": round(p["max"], 3),
               "rss_start_mb": round(rss_start, 1), "rss_end_mb": round(rss_end, 1),
               "leases_after": end["leases"], "reservations_after": end["reservations"],
               "leases_before": base_stats["leases"],
               "host_blocks_after": end["tiers"]["host"]["blocks"],
               "retired_slots_after": end["retired_slots"],
               "expired_leases": end["expired_leases"],
               "checksum_failures": end["checksum_failures"]}
    finally:
        svc.stop()
        shutil.rmtree(base, ignore_errors=True)
    out["machine"] = m
    emit(out, args.json)
    if (out["errors"] or out["wrong"] or out["leases_after"] or out["reservations_after"]
            or out["retired_slots_after"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
