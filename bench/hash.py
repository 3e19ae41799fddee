"""The batch hash behind every commit, by thread count, against memcpy by thread count.

    python bench/hash.py --json [--blocks 4096] [--block-kib 64]

A batch of blocks (default 4,096 x 64 KiB = 256 MiB, one 64 KiB GPU offload) is hashed with
xxh3-64 by:

    xxhash_gbps[t]     python-xxhash, rows split over t threads (it holds the GIL)
    kvtier_gbps[t]     kvtier.checksums.block_checksums(threads=t): the system's libxxhash
                       through kvtier/_xxh.c, the GIL released for each thread's share
    memcpy_gbps[t]     numpy copies of the same rows over t threads: the memory's ceiling
    pinned_kvtier_gbps[t]  (CUDA hosts) kvtier's hash over the same pages registered with
                       cudaHostRegister and just written by a device-to-host copy, as a GPU
                       offload leaves them

Each figure is the best of 3 passes (a pass is 256 MiB; the spread is in the recorded output).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import xxhash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header  # noqa: E402
from kvtier import checksums  # noqa: E402


def best_gbps(fn: Callable[[], None], nbytes: int, passes: int = 3) -> float:
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return round(nbytes / best / 1e9, 2)


def split(n: int, t: int) -> list[tuple[int, int]]:
    step = -(-n // t)
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def run(args: argparse.Namespace) -> dict:
    n, bb = args.blocks, args.block_kib * 1024
    a = np.random.default_rng(0).integers(0, 256, (n, bb), dtype=np.uint8)
    out = np.empty_like(a)
    nbytes = a.nbytes
    threads = [t for t in (1, 2, 4, 8, 16) if t <= max(1, os.cpu_count() or 1)]
    res: dict = {"blocks": n, "block_bytes": bb, "threads": threads,
                 "libxxhash": checksums._fn is not None, "c_helper": checksums._xxh is not None,
                 "usable_threads": checksums.usable_threads()}
    for name in ("xxhash_gbps", "kvtier_gbps", "memcpy_gbps"):
        res[name] = {}
    for t in threads:
        with ThreadPoolExecutor(t) as ex:
            def py_hash() -> None:
                h = xxhash.xxh3_64_intdigest
                list(ex.map(lambda r: [h(a[i]) for i in range(*r)], split(n, t)))

            def copy() -> None:
                list(ex.map(lambda r: np.copyto(out[r[0]:r[1]], a[r[0]:r[1]]), split(n, t)))
            res["xxhash_gbps"][t] = best_gbps(py_hash, nbytes)
            res["memcpy_gbps"][t] = best_gbps(copy, nbytes)
        res["kvtier_gbps"][t] = best_gbps(lambda: checksums.block_checksums(a, threads=t),
                                          nbytes)
    want = [xxhash.xxh3_64_intdigest(a[i]) for i in range(0, n, max(1, n // 64))]
    got = checksums.block_checksums(a, threads=threads[-1])[::max(1, n // 64)].tolist()
    if got != want:
        raise SystemExit("kvtier's threaded hash disagrees with python-xxhash")
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception:            # no CUDA here: the pinned figures are for GPU hosts
        return res
    cupy.cuda.runtime.hostRegister(a.ctypes.data, nbytes, 0)
    try:
        d = cupy.full((n, bb), 7, dtype=cupy.uint8)
        res["pinned_kvtier_gbps"] = {}
        for t in threads:
            cupy.cuda.runtime.memcpy(a.ctypes.data, d.data.ptr, nbytes, 2)    # device to host
            cupy.cuda.runtime.deviceSynchronize()
            res["pinned_kvtier_gbps"][t] = best_gbps(
                lambda: checksums.block_checksums(a, threads=t), nbytes, passes=1)
    finally:
        cupy.cuda.runtime.hostUnregister(a.ctypes.data)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = header("bench/hash.py")
    result = run(args)
    result["machine"] = m
    emit(result, args.json)


if __name__ == "__main__":
    main()
