"""Steady-state soak: a working set 10x the NVMe capacity, against a real `kvtier serve`.

    python bench/soak.py --json                       # 10 minutes per write policy
    python bench/soak.py --seconds 5 --nvme-capacity 8MiB --json     # the CI smoke run

Several client processes put (new keys and rewrites, Zipf-skewed) and get (every block
checked) for --seconds under write_through, then under write_back. Each block carries its key
and a seed in its first 16 bytes and bytes derived from both after them, so a get can tell a
torn, foreign or garbage block from the real one; each client writes only its own keys and
remembers the seed of its last acknowledged put, so a get of its own key also catches a stale
one. Once a second the parent samples the bytes the segment files hold on disk (st_blocks),
the service's RSS, and the bytes it wrote to the device (/proc/PID/io).

Figures per policy: failed_puts, wrong_bytes (must both be 0), max_disk_bytes against
nvme_capacity (+ one segment), hit_ratio of the gets, write_amplification (bytes the service
wrote to disk / bytes put) and rss_mb_start (after the warm-up: a fifth of the run) /
rss_mb_end. The top level holds the worst of the two runs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header  # noqa: E402

BATCH = 8


def payload(k: int, seed: int, bb: int) -> np.ndarray:
    out = np.empty(bb, dtype=np.uint8)
    out[:16] = np.frombuffer(k.to_bytes(8, "little") + seed.to_bytes(8, "little"), np.uint8)
    out[16:] = np.frombuffer(np.random.default_rng([k, seed]).bytes(bb - 16), np.uint8)
    return out


def key(k: int) -> bytes:
    return (k + 1).to_bytes(16, "big")


def wrong_bytes(k: int, block: np.ndarray, latest: int | None) -> int:
    """Bytes of block that are not the block of key k it claims to be (0 when right); a
    block older than `latest` (the client's own last acknowledged seed) counts whole."""
    kk = int.from_bytes(block[:8].tobytes(), "little")
    seed = int.from_bytes(block[8:16].tobytes(), "little")
    if kk != k or (latest is not None and seed != latest):
        return block.size
    return int((payload(k, seed, block.size) != block).sum())


def client(sock: str, cid: int, clients: int, keyspace: int, bb: int, seconds: float,
           out: "mp.Queue") -> None:
    import kvtier
    from kvtier.errors import KvtierError
    rng = np.random.default_rng(cid + 1)
    perm = np.random.default_rng(0).permutation(keyspace)   # hot keys spread over the space
    latest: dict[int, int] = {}
    r = {"puts": 0, "failed_puts": 0, "put_bytes": 0, "gets": 0, "found": 0, "wrong_bytes": 0,
         "errors": []}
    c = kvtier.Client(sock, timeout=60, name=f"soak-{cid}")
    ns = c.namespace("soak", block_bytes=bb)
    end = time.monotonic() + seconds

    def pick() -> list[int]:
        ranks = np.minimum(rng.zipf(1.2, BATCH), keyspace) - 1
        return sorted({int(perm[x]) for x in ranks})

    while time.monotonic() < end:
        if rng.random() < 0.5:
            ks = [k - k % clients + cid for k in pick()]
            ks = sorted({k for k in ks if k < keyspace})
            seeds = [int(rng.integers(1, 1 << 62)) for _ in ks]
            data = np.stack([payload(k, s, bb) for k, s in zip(ks, seeds)])
            try:
                ns.put(b"".join(key(k) for k in ks), data)
                latest.update(zip(ks, seeds))
                r["puts"] += 1
                r["put_bytes"] += data.nbytes
            except KvtierError as exc:
                r["failed_puts"] += 1
                r["errors"] = (r["errors"] + [str(exc)])[-3:]
                for k in ks:              # unknown now: either version may be served
                    latest.pop(k, None)
        else:
            ks = pick()
            found, blocks = ns.get(b"".join(key(k) for k in ks))
            r["gets"] += len(ks)
            r["found"] += int(found.sum())
            for k, f, b in zip(ks, found.tolist(), blocks):
                if f:
                    own = latest.get(k) if k % clients == cid else None
                    r["wrong_bytes"] += wrong_bytes(k, b, own)
    c.close()
    out.put(r)


def disk_bytes(nvme_dir: Path) -> int:
    total = 0
    for p in nvme_dir.rglob("*.kvt"):
        try:
            total += p.stat().st_blocks * 512
        except FileNotFoundError:
            pass                          # reclaimed between the listing and the stat
    return total


def proc_field(pid: int, name: str, field: str) -> int:
    with open(f"/proc/{pid}/{name}") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def soak(policy: str, args: argparse.Namespace, base: str) -> dict:
    from kvtier.config import parse_size
    from tests.service import Service
    cap = parse_size(args.nvme_capacity, "nvme_capacity")
    seg = parse_size(args.segment_bytes, "segment_bytes")
    bb = parse_size(args.block_bytes, "block_bytes")
    keyspace = 10 * cap // bb
    svc = Service(Path(base) / policy, admin=False, host_capacity=args.host_capacity,
                  nvme_capacity=args.nvme_capacity, segment_bytes=args.segment_bytes,
                  write_policy=policy).start()
    pid = svc.proc.pid
    nvme_dir = svc.data_dir / "nvme"
    samples: list[tuple[float, int, int]] = []
    stop = threading.Event()
    wrote0 = proc_field(pid, "io", "write_bytes")

    def monitor() -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            samples.append((time.monotonic() - t0, disk_bytes(nvme_dir),
                            proc_field(pid, "status", "VmRSS") * 1024))
            stop.wait(1.0)

    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=client, args=(str(svc.socket), i, args.clients, keyspace, bb,
                                              args.seconds, q)) for i in range(args.clients)]
    mon = threading.Thread(target=monitor, daemon=True)
    mon.start()
    for p in procs:
        p.start()
    results = [q.get(timeout=args.seconds + 300) for _ in procs]
    for p in procs:
        p.join(60)
    stop.set()
    mon.join(5)
    wrote = proc_field(pid, "io", "write_bytes") - wrote0
    import kvtier
    with kvtier.Client(svc.socket) as c:
        stats = c.stats()
    svc.stop()
    warm = [s for s in samples if s[0] >= args.seconds / 5] or samples
    put_bytes = sum(r["put_bytes"] for r in results)
    gets = sum(r["gets"] for r in results)
    nv = stats["tiers"]["nvme"]
    return {
        "write_policy": policy, "seconds": args.seconds, "clients": args.clients,
        "block_bytes": bb, "keyspace_blocks": keyspace, "working_set_bytes": keyspace * bb,
        "nvme_capacity": cap, "segment_bytes": seg,
        "puts": sum(r["puts"] for r in results),
        "failed_puts": sum(r["failed_puts"] for r in results),
        "put_errors": sorted({e for r in results for e in r["errors"]})[:3],
        "gets": gets, "wrong_bytes": sum(r["wrong_bytes"] for r in results),
        "hit_ratio": round(sum(r["found"] for r in results) / gets, 4) if gets else None,
        "max_disk_bytes": max(s[1] for s in samples),
        "disk_within_capacity_plus_segment": max(s[1] for s in samples) <= cap + seg,
        "put_bytes": put_bytes, "device_bytes_written": wrote,
        "write_amplification": round(wrote / put_bytes, 3) if put_bytes else None,
        "log_write_amplification": nv.get("write_amplification"),
        "rss_mb_start": round(warm[0][2] / 2**20, 1), "rss_mb_end": round(samples[-1][2] / 2**20, 1),
        "rss_mb_max_after_warmup": round(max(s[2] for s in warm) / 2**20, 1),
        "nvme_evictions": nv["evictions"], "compactions": stats["compactions"],
        "nvme_full": stats["nvme_full"], "checksum_failures": stats["checksum_failures"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600.0, help="per write policy")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--host-capacity", default="16MiB")
    ap.add_argument("--nvme-capacity", default="64MiB")
    ap.add_argument("--segment-bytes", default="4MiB")
    ap.add_argument("--block-bytes", default="64KiB")
    ap.add_argument("--policy", action="append", choices=("write_through", "write_back"),
                    help="repeat; default both")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = header("bench/soak.py")
    base = tempfile.mkdtemp(prefix="kvtier-soak-", dir=os.getcwd())
    try:
        runs = [soak(p, args, base) for p in (args.policy or ["write_through", "write_back"])]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out = {
        "failed_puts": sum(r["failed_puts"] for r in runs),
        "wrong_bytes": sum(r["wrong_bytes"] for r in runs),
        "max_disk_bytes": max(r["max_disk_bytes"] for r in runs),
        "nvme_capacity": runs[0]["nvme_capacity"], "segment_bytes": runs[0]["segment_bytes"],
        "hit_ratio": min(r["hit_ratio"] or 0 for r in runs),
        "write_amplification": max(r["write_amplification"] or 0 for r in runs),
        "rss_mb_start": max(r["rss_mb_start"] for r in runs),
        "rss_mb_end": max(r["rss_mb_end"] for r in runs),
        "runs": runs, "machine": m,
    }
    emit(out, args.json)
    if out["failed_puts"] or out["wrong_bytes"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
