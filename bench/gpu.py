"""The GPU data path on an H200, end to end, against the device's own ceilings, in one run.

    python bench/gpu.py --json

Ceilings: torch's 1 GiB pinned host->device and device->host copies. Then, from a client of a
real `kvtier serve` (host tier pinned in both processes):

    onboard_gbps_16k / _64k   get of 4,096 scattered blocks from the host tier into a CUDA
                              tensor (scattered rows), from the call to data ready
    offload_gbps_16k / _64k   put of 4,096 blocks from a CUDA tensor, to the commit's reply
    kernel_gbps_16k           the gather launch alone over the same mapped segment (the 16-byte
                              row kernel; kernel8_gbps_16k: the 8-byte word kernel)
    control_ms_16k / _64k     a get of the 4,096 keys and its release, no bytes moved
    onboard_ms_by_chunk_*     the same get as one request (4096) or in pipelined chunks;
    offload_ms_by_chunk_*     the same for the put
    onboard_hbm_gbps_*        get with tier="hbm": blocks in the service's HBM pool, opened by
                              CUDA IPC, gathered device to device (ceiling: d2d_gbps, one 1 GiB
                              device copy); offload_hbm_gbps_*: put with tier="hbm", whose
                              commit writes through to host and hashes there
    first_request_ms          the first 4,096 x 16 KiB get after start (worker warmed with
                              kvtier.gpu.warm()), against steady_p50_ms
    nvme_to_hbm_gbps          kvikio reads of 64 KiB records into device memory, against a
                              plain POSIX read of the same file into host memory (nvme_ratio)
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

N = 4096


def med(fn, reps: int) -> float:
    import torch
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def onboard_timeline(ns, kb: bytes, out, rows: np.ndarray) -> list:
    """One pipelined onboard get, instrumented: for each chunk, [reply in, launch returned]
    in ms from the call, then the synchronisation's end (where the time of a get goes)."""
    import torch
    from kvtier.api import pipeline
    from kvtier.gpu import rows_view
    seg, dst = ns._gpu(), rows_view(out, N, ns.block_bytes)
    marks: list = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()

    def move(rep, lo: int) -> None:
        t1 = time.perf_counter()
        idx = np.flatnonzero(rep.found)
        seg.gather(rep.slots[idx], dst, rows[lo + idx])
        marks.append([round((t1 - t0) * 1e3, 3), round((time.perf_counter() - t0) * 1e3, 3)])

    def finish() -> None:
        seg.sync()
        marks.append(round((time.perf_counter() - t0) * 1e3, 3))
    pipeline.get(ns, kb, N, move, finish)
    return marks


def ceilings() -> dict:
    import torch
    size = 1 << 30
    h = torch.empty(size, dtype=torch.uint8).pin_memory()
    d = torch.empty(size, dtype=torch.uint8, device="cuda")
    h2d = med(lambda: d.copy_(h, non_blocking=True), 5)
    d2h = med(lambda: h.copy_(d, non_blocking=True), 5)
    d2 = torch.empty_like(d)
    d2d = med(lambda: d2.copy_(d), 5)
    return {"pinned_h2d_gbps": round(size / h2d / 1e9, 2),
            "pinned_d2h_gbps": round(size / d2h / 1e9, 2), "d2d_gbps": round(size / d2d / 1e9, 2)}


def service_path(sock: str, bb: int, reps: int) -> dict:
    import torch
    import kvtier
    from kvtier.gpu import rows_view, warm
    warm(bb)
    keys = [(i + 1).to_bytes(16, "big") for i in range(N)]
    rng = np.random.default_rng(bb)
    with kvtier.Client(sock, timeout=120) as c:
        ns = c.namespace(f"gpu{bb}", block_bytes=bb)
        src = torch.randint(0, 255, (N, bb), dtype=torch.uint8, device="cuda")
        ns.put(b"".join(keys), src)                       # first put: maps and pins
        order = rng.permutation(N)
        kb = b"".join(keys[i] for i in order)
        rows = rng.permutation(N)
        out = torch.zeros_like(src)
        t0 = time.perf_counter()
        ns.get(kb, out=out, rows=rows)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        on = med(lambda: ns.get(kb, out=out, rows=rows), reps)
        timeline = onboard_timeline(ns, kb, out, rows)
        from kvtier.api import pipeline
        by_chunk = {}
        for size in (N, 1024, 512):           # N: one request, no pipelining
            pipeline.CHUNK = size
            by_chunk[str(size)] = round(med(lambda: ns.get(kb, out=out, rows=rows), reps) * 1e3,
                                        3)
        pipeline.CHUNK = 1024
        if not torch.equal(out[torch.as_tensor(rows, device="cuda")],
                           src[torch.as_tensor(order, device="cuda")]):
            raise SystemExit("onboard returned wrong bytes")
        off = med(lambda: ns.put(kb, out, rows=rows), reps)
        put_by_chunk = {}
        for size in (N, 1536, 1024):          # N: one request; 1536: 384 + 2 x 1536 + 640
            pipeline.CUDA_PUT_CHUNK = size
            put_by_chunk[str(size)] = round(med(lambda: ns.put(kb, out, rows=rows), reps) * 1e3,
                                            3)
        pipeline.CUDA_PUT_CHUNK = N
        # Where an offload's time goes: reserve, the scatter launch, the commit.
        parts = {"reserve": [], "scatter": [], "commit": []}
        seg0 = ns._gpu()
        src_view = rows_view(out, N, bb)
        for _ in range(reps):
            t0 = time.perf_counter()
            r = c._call("reserve", ns=ns.name, keys=kb)
            t1 = time.perf_counter()
            seg0.scatter(src_view, np.frombuffer(r["slots"], "<i4"), rows)
            seg0.sync()
            t2 = time.perf_counter()
            c._call("commit", rid=r["rid"])
            t3 = time.perf_counter()
            for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
                parts[k].append(v * 1000)
        breakdown = {f"offload_{k}_ms_{bb // 1024}k": round(float(np.median(v)), 3)
                     for k, v in parts.items()}
        # The control path alone: one get of the 4,096 keys (decode, lookup, leases, reply)
        # and its release, with no bytes moved.
        def control() -> None:
            rep = c._call("get", ns=ns.name, keys=kb)
            c._call("release", lease=rep["lease"])
        ctl = med(control, reps)
        # The HBM tier over CUDA IPC: blocks put into the service's HBM pool (written through
        # to host at commit), then gathered device to device.
        hbm_put = med(lambda: ns.put(kb, src, tier="hbm"), reps)
        hbm_get = med(lambda: ns.get(kb, out=out, rows=rows, tier="hbm"), reps)
        if not torch.equal(out[torch.as_tensor(rows, device="cuda")],
                           src[torch.as_tensor(np.arange(N), device="cuda")]):
            raise SystemExit("the HBM tier returned wrong bytes")
        seg = ns._gpu()
        dst = rows_view(out, N, bb)
        lease = c._call("get", ns=ns.name, keys=kb)
        slots = np.frombuffer(lease["slots"], "<i4")
        kern = med(lambda: (seg.gather(slots, dst, rows), seg.sync()), reps)
        kern8 = med(lambda: (seg._move(seg.dev, dst, slots, rows, seg.indices, wide=False),
                             seg.sync()), reps)
        c._call("release", lease=lease["lease"])
    nbytes = N * bb
    tag = f"{bb // 1024}k"
    return {f"onboard_gbps_{tag}": round(nbytes / on / 1e9, 2),
            f"offload_gbps_{tag}": round(nbytes / off / 1e9, 2),
            f"kernel_gbps_{tag}": round(nbytes / kern / 1e9, 2),
            f"kernel8_gbps_{tag}": round(nbytes / kern8 / 1e9, 2),
            f"onboard_hbm_gbps_{tag}": round(nbytes / hbm_get / 1e9, 2),
            f"offload_hbm_gbps_{tag}": round(nbytes / hbm_put / 1e9, 2),
            f"first_request_ms_{tag}": round(first * 1000, 3),
            f"control_ms_{tag}": round(ctl * 1000, 3),
            f"onboard_timeline_ms_{tag}": timeline,
            f"onboard_ms_by_chunk_{tag}": by_chunk,
            f"offload_ms_by_chunk_{tag}": put_by_chunk,
            f"steady_p50_ms_{tag}": round(on * 1000, 3), **breakdown}


def nvme_path(workdir: str) -> dict:
    import cupy
    import kvikio
    from kvtier.tiers.kvikio_backend import KvikioBackend, kvikio_backend
    from kvtier.tiers.nvme import SegmentLog, _aligned
    bb, n = 65536, N
    backend = kvikio_backend()            # sizes kvikio's pool as the service does
    log = SegmentLog(os.path.join(workdir, "kv"), 1, bb, 1 << 30, backend=backend)
    buf = _aligned(64 * bb)
    np.frombuffer(buf, np.uint8)[:] = 3
    views = [memoryview(buf)[i * bb:(i + 1) * bb] for i in range(64)]
    segs, offs = [], []
    for lo in range(0, n, 64):
        s, o = log.append(views)
        segs.append(s)
        offs.append(o)
    offs = np.concatenate(offs).astype(np.int64) * 4096
    path = str(log.segments[int(segs[0][0])].path)
    log.close()
    os.system("sync")
    dev = cupy.empty(n * bb, dtype=cupy.uint8)
    f = kvikio.CuFile(path, "r")

    # The records of one batch are contiguous in the log, so the tier reads them as one run
    # (SegmentLog merges adjacent records); kvikio splits it into task_size pieces over its
    # thread pool (KVIKIO_NTHREADS, KVIKIO_TASK_SIZE).
    contiguous = bool((np.diff(offs) == bb).all())

    def kv() -> None:
        if contiguous:
            f.pread(dev, n * bb, int(offs[0])).get()
        else:
            futs = [f.pread(dev[i * bb:(i + 1) * bb], bb, int(offs[i])) for i in range(n)]
            for fu in futs:
                fu.get()
        cupy.cuda.Device().synchronize()

    host = _aligned(n * bb)
    fd = os.open(path, os.O_RDONLY)

    def plain() -> None:
        os.preadv(fd, [memoryview(host)], int(offs[0]))

    kv_t = float(np.median([_timed(kv) for _ in range(5)]))
    pl_t = float(np.median([_timed(plain) for _ in range(5)]))
    os.close(fd)
    f.close()
    b = KvikioBackend(kvikio)           # reads the settings now in force
    mode = b.compat_mode
    return {"kvikio_threads": b.threads, "kvikio_task_size": b.task_size,"nvme_to_hbm_gbps": round(n * bb / kv_t / 1e9, 2),
            "plain_read_gbps": round(n * bb / pl_t / 1e9, 2),
            "nvme_ratio": round(pl_t / kv_t, 3), "kvikio_compat_mode": mode}


def hash_rates() -> dict:
    """The service's commit hash (kvtier.checksums) over 4,096 x 64 KiB slots of a memfd
    segment: what bounds an offload's commit."""
    from kvtier.checksums import block_checksums
    from kvtier.tiers.host import SlotPool
    pool = SlotPool("hash", 65536, N)
    pool.array[:] = np.random.default_rng(0).integers(0, 256, pool.array.shape, dtype=np.uint8)
    slots = list(range(N))
    t = float(np.median([_timed(lambda: block_checksums(pool.array, slots)) for _ in range(5)]))
    pool.close()
    return {"commit_hash_gbps": round(N * 65536 / t / 1e9, 2)}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = header("bench/gpu.py")
    from tests.service import Service
    work = tempfile.mkdtemp(prefix="kvtier-gpu-")
    out = ceilings()
    svc = Service(os.path.join(work, "svc"), admin=False, host_capacity="3GiB",
                  nvme_capacity="0", hbm_capacity="1GiB").start()
    try:
        out.update(service_path(str(svc.socket), 16384, args.reps))
        out.update(service_path(str(svc.socket), 65536, args.reps))
    finally:
        svc.stop()
    try:
        out.update(nvme_path(work))
    except ImportError as exc:
        out["nvme_error"] = str(exc)
    out.update(hash_rates())
    ceil = out["pinned_h2d_gbps"]
    for k in ("onboard_gbps_16k", "onboard_gbps_64k", "kernel_gbps_16k"):
        out[f"ratio_{k}"] = round(out[k] / ceil, 3)
    for k in ("offload_gbps_16k", "offload_gbps_64k"):
        out[f"ratio_{k}"] = round(out[k] / out["pinned_d2h_gbps"], 3)
    out["machine"] = m
    emit(out, args.json)


if __name__ == "__main__":
    main()
