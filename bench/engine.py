"""In-process put and get throughput of 64 KiB blocks through the host and NVMe tiers.

    python bench/engine.py --json [--blocks 2048] [--batch 64] [--data-dir DIR]

Four paths, each against its ceiling measured in the same run on the same data directory:

    host put   engine.put into the host tier (write_back, no flush)   vs numpy memcpy into an
               array as large as the pool; a rewrite pass, after a first pass that faults the
               shared pages in (reported as host_put_cold)
    host get   engine.get + copy out of the leased slots + release     vs numpy memcpy
    nvme put   engine.put with write_through (append + fdatasync + LMDB commit per batch)
                                                                       vs os.pwrite + fdatasync
    nvme get   get of blocks only on NVMe (copy-on-read, checksummed)  vs os.pread

The pwrite/pread baselines use O_DIRECT where the file system allows it, as the NVMe tier does,
and write the same bytes in the same batch sizes. Figures are medians over batches; GB/s is
10^9 bytes per second.

Eviction cost by resident blocks (--evict-resident 1e5,1e6,1e7, metadata-only blocks of 1 byte):
for each policy, a host tier of R blocks is filled, a tenth of them read again (so that queues
hold accessed entries), and eng.evict(host, 64) is timed over rounds: the median time per
evicted block should not grow with R. Its baseline, in the same run at the same R, is what the
policies cost before they kept queues: one argsort of the resident blocks' last-access column
per eviction batch (the scan and sort every batch paid), per evicted block.

The control path of a GPU offload, in process (--control-rounds; issue 16): the engine's
reserve and commit of one 4,096-key batch of 16 KiB blocks with trusted checksums (as the CUDA
put sends them: the service hashes no byte), median microseconds of CPU (process time, which
a loaded VM's waits do not inflate) per key over rounds:
reserve_us_per_key_4096 / commit_us_per_key_4096 rewrite the same batch (no eviction), the
_new fields put new keys into a full tier (4,096 evicted per batch); lru, the host tier's
policy under an HBM tier, and _chain, the default. bench/api.py measures the same requests
through the socket. --skip-io runs these too.

NVMe eviction cost by resident blocks (--nvme-evict-resident 1e5,1e6,1e7): a host tier of R
1-byte blocks (so the page table holds R rows) over an NVMe tier of a fixed 32,768 records
(4 KiB each, 9 segments); blocks are flushed to NVMe a segment at a time until the tier has
reclaimed --nvme-evict-rounds segments, and each reclaim (coherence.space.Space.reclaim: the
segment's rows, re-admission, eviction from every tier, the file and LMDB deletes) is timed per
block it evicted. Its baseline, at the same R: the table scan that every reclaim paid before
segments kept their rows (the rows of one segment found among all R).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import emit, header, percentiles  # noqa: E402
from kvtier.coherence.engine import Engine  # noqa: E402
from kvtier.config import make_settings  # noqa: E402
from kvtier.memory import tune_malloc  # noqa: E402
from kvtier.types import Tier  # noqa: E402

BB = 64 * 1024


def keyset(lo: int, n: int) -> bytes:
    return b"".join((i + 1).to_bytes(16, "big") for i in range(lo, lo + n))


def rate(samples: list[float], nbytes: int) -> dict[str, float]:
    p = percentiles(samples)
    return {"gbps": round(nbytes / p["p50"] / 1e9, 3), "ops": round(nbytes / BB / p["p50"], 1)}


def run(args: argparse.Namespace) -> dict:
    base = args.data_dir or tempfile.mkdtemp(prefix="kvtier-bench-")
    n, b = args.blocks, args.batch
    nbytes = b * BB
    data = np.random.default_rng(0).integers(0, 256, (n, BB), dtype=np.uint8)
    out = {}

    # ---- ceilings: memcpy, pwrite+fdatasync, pread
    dst = np.empty((b, BB), dtype=np.uint8)
    big = np.ones((n, BB), dtype=np.uint8)       # as large as the host pool, pages touched
    memcpy = []
    for lo in range(0, n, b):
        t0 = time.perf_counter()
        np.copyto(big[lo:lo + b], data[lo:lo + b])
        memcpy.append(time.perf_counter() - t0)
    del big
    path = os.path.join(base, "baseline.bin")
    flags = os.O_RDWR | os.O_CREAT
    try:
        fd = os.open(path, flags | os.O_DIRECT, 0o600)
    except OSError:
        fd = os.open(path, flags, 0o600)
    buf = mmap.mmap(-1, nbytes)
    pw, pr = [], []
    for lo in range(0, n, b):
        buf[:] = data[lo:lo + b].tobytes()
        t0 = time.perf_counter()
        os.pwrite(fd, buf, lo * BB)
        os.fdatasync(fd)
        pw.append(time.perf_counter() - t0)
    order = np.random.default_rng(1).permutation(n // b)
    for j in order.tolist():
        t0 = time.perf_counter()
        # One pread per block, as a random-access reader would issue them.
        for i in range(b):
            os.preadv(fd, [memoryview(buf)[i * BB:(i + 1) * BB]], (j * b + i) * BB)
        pr.append(time.perf_counter() - t0)
    os.close(fd)
    os.unlink(path)

    # ---- host tier
    eng = Engine(make_settings({"data_dir": os.path.join(base, "host"), "host_capacity": n * BB,
                                "nvme_capacity": 0, "write_policy": "write_back"}))
    eng.create_namespace("b", BB)
    hp, hg, cold = [], [], []
    # The first pass touches the shared segment's pages for the first time (page faults, as a
    # service pays once after start); it is reported apart as host_put_cold.
    for samples in (cold, hp):
        for lo in range(0, n, b):
            t0 = time.perf_counter()
            eng.put("b", keyset(lo, b), data[lo:lo + b])
            samples.append(time.perf_counter() - t0)
    pool = eng.namespace("b").slots[Tier.HOST].pool
    for lo in range(0, n, b):
        t0 = time.perf_counter()
        res = eng.get("b", keyset(lo, b))
        pool.read(res.slots, out=dst)
        eng.release(res.lease_id)
        hg.append(time.perf_counter() - t0)
    if not (dst == data[n - b:n]).all():
        raise SystemExit("host get returned wrong bytes")
    eng.close(flush=False)

    # ---- NVMe tier
    eng = Engine(make_settings({"data_dir": os.path.join(base, "nvme"),
                                "host_capacity": max(4 * b, 256) * BB,
                                "nvme_capacity": 4 * n * BB, "write_policy": "write_through"}))
    eng.create_namespace("b", BB)
    np_, ng = [], []
    for lo in range(0, n, b):
        t0 = time.perf_counter()
        eng.put("b", keyset(lo, b), data[lo:lo + b])
        np_.append(time.perf_counter() - t0)
    eng.evict(Tier.HOST, n)
    pool = eng.namespace("b").slots[Tier.HOST].pool
    for j in order.tolist():
        lo = j * b
        t0 = time.perf_counter()
        res = eng.get("b", keyset(lo, b))
        pool.read(res.slots, out=dst)
        eng.release(res.lease_id)
        ng.append(time.perf_counter() - t0)
        eng.evict(Tier.HOST, b)
        if not res.found.all() or not (dst == data[lo:lo + b]).all():
            raise SystemExit("nvme get returned wrong bytes")
    wa = eng.stats()["tiers"]["nvme"]["write_amplification"]
    eng.close(flush=False)
    if not args.data_dir:
        shutil.rmtree(base, ignore_errors=True)

    for name, s in (("memcpy", memcpy), ("pwrite_fdatasync", pw), ("pread", pr),
                    ("host_put", hp), ("host_put_cold", cold), ("host_get", hg), ("nvme_put", np_), ("nvme_get", ng)):
        r = rate(s, nbytes)
        out[f"{name}_gbps"] = r["gbps"]
        out[f"{name}_ops"] = r["ops"]
    out["ratio_host_put_vs_memcpy"] = round(out["host_put_gbps"] / out["memcpy_gbps"], 3)
    out["ratio_host_get_vs_memcpy"] = round(out["host_get_gbps"] / out["memcpy_gbps"], 3)
    out["ratio_nvme_put_vs_pwrite"] = round(out["nvme_put_gbps"] / out["pwrite_fdatasync_gbps"], 3)
    out["ratio_nvme_get_vs_pread"] = round(out["nvme_get_gbps"] / out["pread_gbps"], 3)
    out["nvme_write_amplification"] = wa
    out.update({"block_bytes": BB, "batch": b, "blocks": n})
    return out


def evict_cost(resident: list[int], policies: list[str], rounds: int, batch: int = 64) -> dict:
    """Median microseconds per evicted block, per policy and resident count (see docstring)."""
    out: dict = {"evict_batch": batch, "evict_rounds": rounds, "evict_us_per_block": {},
                 "scan_sort_us_per_block": {}}
    rng = np.random.default_rng(1)
    chunk = 8192
    for r in resident:
        for policy in policies:
            base = tempfile.mkdtemp(prefix="kvtier-bench-evict-")
            eng = Engine(make_settings({"data_dir": base, "host_capacity": r,
                                        "nvme_capacity": 0, "write_policy": "write_back",
                                        "eviction": policy, **_slots(r)}))
            eng.create_namespace("e", 1)
            ones = np.zeros((chunk, 1), dtype=np.uint8)
            for lo in range(0, r, chunk):
                k = min(chunk, r - lo)
                eng.put("e", _keys(lo, k), ones[:k])
            for lo in rng.choice(r // chunk or 1, size=max(1, r // chunk // 10), replace=False):
                eng.release(eng.get("e", _keys(int(lo) * chunk, min(chunk, r))).lease_id)
            samples = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                done = eng.evict(Tier.HOST, batch)
                samples.append((time.perf_counter() - t0) / max(done, 1))
            out["evict_us_per_block"].setdefault(policy, {})[str(r)] = round(
                percentiles(samples)["p50"] * 1e6, 3)
            last = eng.namespace("e").table.cols["last_access"][:r]
            eng.close(flush=False)
            shutil.rmtree(base, ignore_errors=True)
        scan = []
        for _ in range(max(3, rounds // 20)):
            t0 = time.perf_counter()
            np.argsort(last, kind="stable")[:batch]
            scan.append((time.perf_counter() - t0) / batch)
        out["scan_sort_us_per_block"][str(r)] = round(percentiles(scan)["p50"] * 1e6, 3)
    lo, hi = str(resident[0]), str(resident[-1])
    out["evict_growth_first_to_last"] = {
        p: round(v[hi] / v[lo], 2) for p, v in out["evict_us_per_block"].items() if v[lo] > 0}
    out["scan_sort_growth_first_to_last"] = round(
        out["scan_sort_us_per_block"][hi] / max(out["scan_sort_us_per_block"][lo], 1e-9), 2)
    return out


def control_path(rounds: int, policy: str) -> dict:
    """Engine reserve and commit of 4,096-key batches, per key (see the module docstring)."""
    n, bb = 4096, 16 << 10
    base = tempfile.mkdtemp(prefix="kvtier-bench-ctl-")
    eng = Engine(make_settings({"data_dir": base, "host_capacity": 4 * n * bb,
                                "nvme_capacity": 0, "eviction": policy}))
    eng.create_namespace("c", bb)
    sums = np.random.default_rng(3).integers(0, 1 << 63, n, dtype=np.uint64)
    times: dict[str, list[float]] = {}

    def once(kb: np.ndarray, tag: str) -> None:
        t0 = time.process_time()
        res = eng.reserve("c", kb)
        t1 = time.process_time()
        eng.commit(res.rid, 0, sums, trusted=True)
        t2 = time.process_time()
        times.setdefault(f"reserve{tag}", []).append((t1 - t0) * 1e6 / n)
        times.setdefault(f"commit{tag}", []).append((t2 - t1) * 1e6 / n)

    for i in range(rounds + 2):
        once(_keys(0, n), "" if i >= 2 else "_warm")
    for i in range(rounds + 4):
        once(_keys((i + 1) * n, n), "_new" if i >= 4 else "_warm")
    eng.close(flush=False)
    shutil.rmtree(base, ignore_errors=True)
    sfx = "" if policy == "lru" else f"_{policy}"
    return {f"{k.split('_')[0]}_us_per_key_4096{'_new' if k.endswith('_new') else ''}{sfx}":
            round(percentiles(v)["p50"], 3) for k, v in times.items() if not k.endswith("_warm")}


def nvme_evict_cost(resident: list[int], rounds: int, data_dir: str = "") -> dict:
    """Median microseconds per block evicted by an NVMe reclaim, by resident rows (docstring)."""
    from kvtier.coherence.space import Space, capacity_for
    out: dict = {"nvme_evict_records": 32768, "nvme_evict_rounds": rounds,
                 "nvme_evict_us_per_block": {}, "nvme_scan_us_per_block": {}}
    nvme_bytes, segment = capacity_for(32768, 1)
    per_seg = 32768 // 8
    real = Space.reclaim
    for r in resident:
        base = tempfile.mkdtemp(prefix="kvtier-bench-nvme-evict-", dir=data_dir or None)
        eng = Engine(make_settings({"data_dir": base, "host_capacity": r,
                                    "nvme_capacity": nvme_bytes, "segment_bytes": segment,
                                    "write_policy": "write_back", "prefetch_blocks": 0,
                                    **_slots(r)}))
        eng.create_namespace("e", 1)
        ns = eng.namespace("e")
        chunk = 8192
        ones = np.zeros((chunk, 1), dtype=np.uint8)
        for lo in range(0, r, chunk):
            k = min(chunk, r - lo)
            eng.put("e", _keys(lo, k), ones[:k])
        samples: list[float] = []
        scans: list[float] = []

        def timed(self, ns_, seg, keep_all, _s=samples, _c=scans):
            before = eng.counters.tiers[Tier.NVME].evictions
            t0 = time.perf_counter()
            real(self, ns_, seg, keep_all)
            dt = time.perf_counter() - t0
            gone = eng.counters.tiers[Tier.NVME].evictions - before
            if gone:
                _s.append(dt / gone)
                cols, n = ns_.table.cols, ns_.table.n_rows
                t0 = time.perf_counter()
                np.flatnonzero((cols["copy_ver"][:n, Tier.NVME] > 0)
                               & (cols["slot"][:n, Tier.NVME] == seg.seg_id))
                _c.append((time.perf_counter() - t0) / gone)
        Space.reclaim = timed
        try:
            lo = 0
            while len(samples) < rounds and lo < r:
                rows = ns.table.lookup(_keys(lo, min(per_seg, r - lo)))
                eng.nvme.flush(ns, rows[rows >= 0], strict=False)
                lo += per_seg
        finally:
            Space.reclaim = real
        out["nvme_evict_us_per_block"][str(r)] = round(percentiles(samples)["p50"] * 1e6, 3) \
            if samples else None
        out["nvme_scan_us_per_block"][str(r)] = round(percentiles(scans)["p50"] * 1e6, 3) \
            if scans else None
        out.setdefault("nvme_evict_reclaims", {})[str(r)] = len(samples)
        eng.close(flush=False)
        shutil.rmtree(base, ignore_errors=True)
    v, sc = out["nvme_evict_us_per_block"], out["nvme_scan_us_per_block"]
    lo_, hi_ = str(resident[0]), str(resident[-1])
    if v.get(lo_) and v.get(hi_):
        out["nvme_evict_growth_first_to_last"] = round(v[hi_] / v[lo_], 2)
    if sc.get(lo_) and sc.get(hi_):
        out["nvme_scan_growth_first_to_last"] = round(sc[hi_] / sc[lo_], 2)
    return out


def _slots(r: int) -> dict:
    """Settings that let one namespace hold r 1-byte host slots (24 B of metadata each)."""
    return {"max_host_slots": max(r, 1 << 20), "max_slot_metadata": max(r * 32, 512 << 20)}


def _keys(lo: int, n: int) -> np.ndarray:
    raw = np.zeros((n, 2), dtype=">u8")
    raw[:, 1] = np.arange(lo + 1, lo + n + 1, dtype=np.uint64)
    return raw.view("V16").reshape(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--data-dir", default="", help="where to put the files (default: a temp dir)")
    ap.add_argument("--evict-resident", default="1e5,1e6,1e7",
                    help="resident block counts of the eviction-cost runs; empty: skip them")
    ap.add_argument("--evict-policies", default="lru,s3fifo,chain")
    ap.add_argument("--evict-rounds", type=int, default=200)
    ap.add_argument("--nvme-evict-resident", default="",
                    help="resident block counts of the NVMe eviction-cost runs (1e5,1e6,1e7); "
                         "empty: skip them")
    ap.add_argument("--nvme-evict-rounds", type=int, default=12)
    ap.add_argument("--control-rounds", type=int, default=30,
                    help="rounds of the 4,096-key reserve and commit; 0: skip them")
    ap.add_argument("--skip-io", action="store_true",
                    help="only the eviction-cost and control-path runs")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = header("bench/engine.py")
    tune_malloc()
    result = {} if args.skip_io else run(args)
    if args.evict_resident:
        result.update(evict_cost([int(float(x)) for x in args.evict_resident.split(",")],
                                 args.evict_policies.split(","), args.evict_rounds))
    if args.nvme_evict_resident:
        result.update(nvme_evict_cost(
            [int(float(x)) for x in args.nvme_evict_resident.split(",")],
            args.nvme_evict_rounds, args.data_dir))
    if args.control_rounds:
        for policy in ("lru", "chain"):
            result.update(control_path(args.control_rounds, policy))
    result["machine"] = m
    emit(result, args.json)


if __name__ == "__main__":
    main()
