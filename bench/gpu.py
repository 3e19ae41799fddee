"""The GPU data path on an H200, as an engine uses it, against the device's own ceilings, in one run.

    python bench/gpu.py --json            (--quick: fewer repetitions, same fields)

Ceilings, measured first: torch's 1 GiB pinned host->device and device->host copies, a 1 GiB
device copy, and a bf16 8192^3 matmul loop alone. Then, from a client of a real `kvtier serve`
(host tier pinned in both processes), every figure end to end from the call to data ready (a
get) or to the commit's reply (a put), blocks in scattered slots and scattered engine rows:

    onboard_ratio_2m / offload_ratio_2m      1,024 blocks of 2 MiB as BLHNC rows, / H2D, D2H
    onboard_ratio_layers / offload_..        the same blocks as 32 per-layer pages of 64 KiB
                                             (Pages over 32 tensors: vLLM's LBHNC)
    ratio_onboard_gbps_64k / _16k, ratio_offload_gbps_64k / _16k
                                             4,096 rows of 64 / 16 KiB
    matmul_ratio_beside_onboard              the matmul loop's throughput while 2 MiB blocks
    onboard_ratio_beside_matmul              onboard on another stream, against alone; the
                                             same for 64 KiB rows (_64k)
    variants_2m / _64k / _16k                the same transfers under other policies (copy-
                                             engine lanes, kernel only, no stream priority,
                                             4..132 thread blocks, copy engines only; 64 KiB:
                                             kernel_onboard, the onboard by the kernel;
                                             kernel_share_12/25/50, that share of each chunk
                                             by the kernel beside the copies; 64 and
                                             16 KiB: whole_gets (one request, stage_sorted),
                                             chunked_gets (whole gets off),
                                             late_commits (no early commits), credits
                                             (the first chunk into a credit the put before
                                             asked for, kvtier.api.credits), staged_offload
                                             (each put chunk gathered on the GPU, then one
                                             copy-engine copy a run of slots); 16 KiB:
                                             prepared (the first launch set up before the
                                             first reply)): onboard alone,
                                             and beside the matmul or the offload; the basis
                                             of the defaults (kvtier.gpu.plan)
    layerwise_overlap                        a 32-layer load, each layer's compute waiting for
                                             that layer only: total / max(load, compute) alone
    layerwise_timeline                       its staged layers' copies, placements and
                                             computes from timing events (layer_timeline)
    layerwise_variant_*                      the same with the placements' stream, ring and
                                             thread blocks of TransferPolicy varied
    single_cuda_get_p50_us (p99)             one 64 KiB block into a CUDA tensor (ns.get: its
                                             latency path); _async_p50_us: get_async().wait()
    small_cuda_get_p50_us (p99)              64 scattered 16 KiB blocks into a CUDA tensor,
                                             beside small_host_get_p50_us: the same get into
                                             host memory (what the GPU path adds per get)
    hbm_onboard_ratio_2m                     1,024 x 2 MiB from the HBM tier (CUDA IPC), / D2D
    mapped_read_probe                        kvtier.gpu.probe at warm(): the SMs' read rate of
                                             mapped host memory against a copy engine, and
                                             whether gpu_sorted_gets = auto sorts small gets
    staging_*                                the 64 / 16 KiB rows' move alone (leased once):
                                             stage_sorted, its copies alone, Mover.move
    offload_commit_ms_*                      the commit's share of a put (GPU checksums sent)
    offload_ratio_*_chunks_K                 the same put in chunks of K keys (4,096: one
                                             request); offload_chunks_*: the default's count
    offload_hash_ms_*                        the put's GPU checksums alone
    onboard_control_ms_64k / _16k            the onboard's leases alone (nothing moved);
                                             _enqueue_ms: until get_async returns; _profile:
                                             the client's top functions (cProfile; _whole:
                                             under whole gets); _chunk_K:
                                             the get in chunks of K keys (4,096: one request)
    onboard_timeline_64k / _16k              the chunked get chunk by chunk: each reply read,
                                             its move enqueued, and its GPU start and end
                                             (timing events), from get_async's entry, ms;
                                             gpu_idle_ms before and between the chunks
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

from bench.common import emit, header, percentiles  # noqa: E402

MM = 8192
LAYERS = 32


class WrongBytes(Exception):
    """A transfer moved the wrong bytes: the case's figures are void."""


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


def ceilings(reps: int) -> dict:
    """1 GiB copies after three unmeasured ones (run 6's first copies read 51 GB/s where the
    same run's later 2 GiB copy moved 55), median of 3 x reps; the spread is reported."""
    import torch
    size = 1 << 30
    h = torch.empty(size, dtype=torch.uint8).pin_memory()
    h.random_(0, 255)
    d = torch.empty(size, dtype=torch.uint8, device="cuda")
    d2 = torch.empty_like(d)
    out = {}
    for name, fn in (("pinned_h2d", lambda: d.copy_(h, non_blocking=True)),
                     ("pinned_d2h", lambda: h.copy_(d, non_blocking=True)),
                     ("d2d", lambda: d2.copy_(d))):
        med(fn, 3)
        ts = []
        for _ in range(3 * reps):
            ts.append(med(fn, 1))
        out[f"{name}_gbps"] = round(size / float(np.median(ts)) / 1e9, 2)
        out[f"{name}_gbps_spread"] = [round(size / max(ts) / 1e9, 2), round(size / min(ts) / 1e9, 2)]
    return out


class Matmul:
    """The model beside the transfers: bf16 MM^3 products on the default stream, random data."""

    def __init__(self) -> None:
        import torch
        self.a = torch.randn(MM, MM, dtype=torch.bfloat16, device="cuda")
        self.b = torch.randn(MM, MM, dtype=torch.bfloat16, device="cuda")
        self.c = torch.empty_like(self.a)
        self.flop = 2 * MM ** 3

    def enqueue(self, k: int) -> tuple:
        import torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(k):
            torch.matmul(self.a, self.b, out=self.c)
        end.record()
        return start, end

    def tflops(self, k: int) -> float:
        import torch
        s, e = self.enqueue(k)
        torch.cuda.synchronize()
        return k * self.flop / (s.elapsed_time(e) * 1e-3) / 1e12


def beside(mm: "Matmul", alone_tflops: float, onboard, nbytes: int, reps: int) -> tuple:
    """(matmul TFLOP/s while onboard() runs reps times on its own stream, onboard GB/s then)."""
    import torch
    t_one = med(onboard, 3)
    k = max(4, int(reps * t_one / (mm.flop / (alone_tflops * 1e12))) + 2)
    torch.cuda.synchronize()
    s, e = mm.enqueue(k)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        onboard()
        ts.append(time.perf_counter() - t0)
    e.synchronize()
    t_mm = s.elapsed_time(e) * 1e-3
    busy = sum(ts)
    return (k * mm.flop / t_mm / 1e12, nbytes / float(np.median(ts)) / 1e9,
            round(min(1.0, busy / t_mm), 3))


_NS: dict = {}


def namespace(c, name: str, bb: int):
    """One handle per namespace for the whole run (each maps and registers the segment)."""
    if name not in _NS:
        _NS[name] = c.namespace(name, block_bytes=bb)
    return _NS[name]


def scattered_rows(ns, bb: int, n: int) -> tuple:
    """n random blocks of bb bytes in a CUDA tensor, put in ns, and the transfers' case: their
    keys in a shuffled order (kb) with the tensor rows they go to or come from (rows), seeded by
    bb. Returns (src, order, kb, rows): kb holds the keys of src[order]."""
    import torch
    rng = np.random.default_rng(bb)
    keys = b"".join((i + 1).to_bytes(16, "big") for i in range(n))
    src = torch.randint(0, 255, (n, bb), dtype=torch.uint8, device="cuda")
    ns.put(keys, src)
    order = rng.permutation(n)
    kb = b"".join(keys[16 * i:16 * i + 16] for i in order)
    return src, order, kb, rng.permutation(n)


def rows_case(c, name: str, bb: int, n: int, reps: int, ceil: dict, mm: Matmul,
              mm_alone: float, variants: dict | None = None) -> dict:
    """n scattered blocks of bb bytes as rows: onboard, offload (and, where the put is cut in
    chunks, the same put as one request), and beside the matmul; then each variant of the
    transfer policy (onboard alone, and beside the matmul or offload)."""
    import torch
    from kvtier.api import pipeline
    ns = namespace(c, name, bb)
    src, order, kb, rows = scattered_rows(ns, bb, n)
    out = torch.zeros_like(src)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()          # the data exists before another stream reads or writes it
    get = lambda: ns.get_async(kb, out=out, rows=rows, stream=stream).wait()   # noqa: E731
    get()
    if not torch.equal(out[torch.as_tensor(rows, device="cuda")],
                       src[torch.as_tensor(order, device="cuda")]):
        raise WrongBytes(f"onboard of {name} returned wrong bytes")
    h = ns.get_async(kb, out=out, rows=rows, stream=stream)
    methods = sorted(h.methods) + (["staged"] if h.staged else []) + (
        ["batched"] if h.batched else [])
    h.wait()
    on = med(get, reps)
    put = lambda: ns.put_async(kb, out, rows=rows, stream=stream).wait()   # noqa: E731
    off = med(put, reps)
    tag = {2 << 20: "2m", 65536: "64k", 16384: "16k"}[bb]
    # The same put cut otherwise (chunks of k keys; 4,096: one request): what chunks buy.
    extra = {}
    saved = pipeline.CUDA_PUT_CHUNK_BYTES, pipeline.CUDA_PUT_CHUNK_MIN, pipeline.CUDA_PUT_CHUNK
    for k in {"2m": (64, 256), "64k": (256, 4096), "16k": (512, 4096)}[tag]:
        pipeline.CUDA_PUT_CHUNK_BYTES, pipeline.CUDA_PUT_CHUNK_MIN = k * bb, k
        pipeline.CUDA_PUT_CHUNK = max(k, saved[2])
        try:
            extra[f"offload_ratio_{tag}_chunks_{k}"] = round(
                n * bb / med(put, reps) / 1e9 / ceil["pinned_d2h_gbps"], 3)
        finally:
            (pipeline.CUDA_PUT_CHUNK_BYTES, pipeline.CUDA_PUT_CHUNK_MIN,
             pipeline.CUDA_PUT_CHUNK) = saved
    # Short edge chunks: a first one whose reply comes back sooner, a last one whose commit
    # after the last copy is short (the middle cut as before).
    cut = pipeline.cuda_put_chunks
    for first, last in ((64, 64), (32, 128)):
        def edged(m, b, _f=first, _l=last):
            if m <= 2 * (_f + _l):
                return cut(m, b)
            return ([(0, _f)] + [(_f + lo, _f + hi) for lo, hi in cut(m - _f - _l, b)]
                    + [(m - _l, m)])
        pipeline.cuda_put_chunks = edged
        try:
            extra[f"offload_ratio_{tag}_edges_{first}_{last}"] = round(
                n * bb / med(put, reps) / 1e9 / ceil["pinned_d2h_gbps"], 3)
        finally:
            pipeline.cuda_put_chunks = cut
    extra[f"offload_chunks_{tag}"] = len(pipeline.cuda_put_chunks(n, bb))
    if tag != "2m":
        extra.update(onboard_split(ns, kb, n, get, lambda: ns.get_async(
            kb, out=out, rows=rows, stream=stream), tag, reps))
    extra[f"offload_hash_ms_{tag}"] = round(hash_ms(ns, out, rows, reps) * 1e3, 3)
    if tag != "2m":
        from kvtier.gpu import transfer
        from kvtier.gpu.plan import TransferPolicy
        put_h = lambda: ns.put_async(kb, out, rows=rows, stream=stream)   # noqa: E731
        extra[f"offload_timeline_{tag}"] = put_timeline(ns, put_h, reps)
        transfer.set_policy(TransferPolicy(staged_out_bytes=0))   # every chunk gathered first
        try:
            extra[f"offload_timeline_{tag}_staged"] = put_timeline(ns, put_h, reps)
        finally:
            transfer.set_policy(None)
    host = np.empty((n, bb), np.uint8)
    ns.get(kb, out=host)
    if not (host[:64] == out[torch.as_tensor(rows[:64], device="cuda")].cpu().numpy()).all():
        raise WrongBytes(f"offload of {name} stored wrong bytes")
    nbytes = n * bb
    res = {**extra, f"onboard_gbps_{tag}": round(nbytes / on / 1e9, 2),
           f"offload_gbps_{tag}": round(nbytes / off / 1e9, 2),
           f"methods_{tag}": methods,
           f"onboard_ms_{tag}": round(on * 1e3, 3), f"offload_ms_{tag}": round(off * 1e3, 3)}
    res.update(commit_share(c, ns, kb, out, rows, tag, reps))
    if tag in ("2m", "64k"):
        tf, gbps, cover = beside(mm, mm_alone, get, nbytes, max(3, reps // 2))
        sfx = "" if tag == "2m" else "_64k"
        res[f"matmul_ratio_beside_onboard{sfx}"] = round(tf / mm_alone, 3)
        res[f"onboard_ratio_beside_matmul{sfx}"] = round(gbps / ceil["pinned_h2d_gbps"], 3)
        res[f"beside_overlap{sfx}"] = cover
    for vname, pol in (variants or {}).items():
        from kvtier.gpu import transfer
        transfer.set_policy(pol)
        try:
            t = med(get, reps)
            row = {"onboard_ratio": round(nbytes / t / 1e9 / ceil["pinned_h2d_gbps"], 3)}
            row["offload_ratio"] = round(nbytes / med(put, reps) / 1e9 /
                                         ceil["pinned_d2h_gbps"], 3)
            tf, gbps, _ = beside(mm, mm_alone, get, nbytes, 3)
            row["matmul_ratio_beside"] = round(tf / mm_alone, 3)
            row["onboard_ratio_beside"] = round(gbps / ceil["pinned_h2d_gbps"], 3)
        finally:
            transfer.set_policy(None)
        res.setdefault(f"variants_{tag}", {})[vname] = row
    return res


def onboard_split(ns, kb: bytes, n: int, get, get_async, tag: str, reps: int) -> dict:
    """Where a small-page onboard's time goes: the control path alone (every chunk leased and
    released, nothing moved), the time until get_async returns (every reply read and every
    chunk's move enqueued), and the client's top functions under cProfile."""
    import torch
    from kvtier.api import pipeline
    c = ns._client

    def control() -> None:
        _found, leases, error, _moved = pipeline.lease(ns, kb, n, lambda rep, lo: None)
        for lease in leases:
            c._release_later(lease)
        if error is not None:
            raise error
    enq = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h = get_async()
        enq.append(time.perf_counter() - t0)
        h.wait()
    out = {}
    saved = pipeline.CHUNK
    from kvtier.gpu import transfer
    from kvtier.gpu.plan import TransferPolicy
    for k in (512, 2048, 4096):          # the get's chunk size otherwise (4,096: one request)
        pipeline.CHUNK = k
        transfer.set_policy(TransferPolicy(whole_onboard_keys=0))     # chunks, never whole
        try:
            out[f"onboard_ms_{tag}_chunk_{k}"] = round(med(get, reps) * 1e3, 3)
            out[f"onboard_control_ms_{tag}_chunk_{k}"] = round(med(control, reps) * 1e3, 3)
        finally:
            pipeline.CHUNK = saved
            transfer.set_policy(None)
    transfer.set_policy(TransferPolicy(sorted_gets="on"))    # one request, staged
    try:
        out[f"onboard_profile_whole_{tag}"] = profile(get, 30, 10)
    finally:
        transfer.set_policy(None)
    return {**out, f"onboard_control_ms_{tag}": round(med(control, reps) * 1e3, 3),
            f"onboard_enqueue_ms_{tag}": round(float(np.median(enq)) * 1e3, 3),
            f"onboard_profile_{tag}": profile(get, 30, 10),
            **timeline_variant(get_async, tag, reps, "", sorted_gets="off"),   # chunked
            **timeline_variant(get_async, tag, reps, "sorted", sorted_gets="on"),
            **timeline_variant(get_async, tag, reps, "sorted_64m", sorted_gets="on",
                               stage_piece_bytes=64 << 20),
            **({} if tag != "16k" else timeline_variant(get_async, tag, reps, "prepared",
                                                        prepare_launch=True,
                                                        sorted_gets="off"))}


def timeline_variant(get_async, tag: str, reps: int, name: str, **policy) -> dict:
    """chunk_timeline under TransferPolicy(**policy) (name "": onboard_timeline_<tag>)."""
    from kvtier.gpu import transfer
    from kvtier.gpu.plan import TransferPolicy
    transfer.set_policy(TransferPolicy(**policy))
    try:
        return {f"onboard_timeline_{tag}" + (f"_{name}" if name else ""):
                chunk_timeline(get_async, reps)}
    finally:
        transfer.set_policy(None)


def chunk_timeline(get_async, reps: int) -> dict:
    """Where a chunked get's time goes, chunk by chunk (transfer.TRACE; round 5): host times
    from get_async's entry of each reply read (reply) and of its move enqueued (enq), GPU times
    (timing events on the stream of the chunk's copies or kernel, from one recorded at entry)
    before and after its move, get_async's return (ret) and wait()'s (done). gpu_idle_ms: the
    GPU time before the first chunk's move began plus every gap between one chunk's end and the
    next one's start; median get of reps by done_ms, ms."""
    import cupy
    import torch
    from kvtier.gpu import transfer
    gets = []
    for _ in range(max(3, reps)):
        torch.cuda.synchronize()
        transfer.TRACE = []
        try:
            h = get_async()
            h.wait()
            done = time.perf_counter()
            tr = transfer.TRACE[0]
        finally:
            transfer.TRACE = None
        ev0, t0 = tr["start"][0], tr["t0"]

        def gpu(mark) -> float:
            return round(float(cupy.cuda.get_elapsed_time(ev0, mark[0])), 4)
        rows = [[round((r - t0) * 1e3, 4), round((e - t0) * 1e3, 4), gpu(b), gpu(a)]
                for r, b, a, e in tr["chunks"]]
        idle = rows[0][2] + sum(max(0.0, rows[k][2] - rows[k - 1][3])
                                for k in range(1, len(rows))) if rows else 0.0
        gets.append({"done_ms": round((done - t0) * 1e3, 4),
                     "ret_ms": round((tr["ret"] - t0) * 1e3, 4),
                     "gpu_end_ms": max((r[3] for r in rows), default=0.0),
                     "gpu_idle_ms": round(idle, 4),
                     "gpu_busy_ms": round(sum(r[3] - r[2] for r in rows), 4),
                     "chunks": rows})
    gets.sort(key=lambda g: g["done_ms"])
    return gets[len(gets) // 2]


def put_timeline(ns, put_async, reps: int) -> dict:
    """Where a put's time goes, from the client's side of the socket: each request sent and
    its reply read (reserve, commit), host ms from put_async's entry, the return of put_async
    (ret) and of wait() (done). A chunk's commit is sent as the host finds its copies (and
    the GPU hash) complete, so a commit's send is when its chunk's move was seen done; the
    gap from the last commit's send to done is what the service's last commit costs the put.
    Median put of reps by done_ms. (The client's _send and _reply wrapped on this instance,
    nothing of the library changed.)"""
    import torch
    c = ns._client
    log: list[tuple[str, str, float]] = []
    send, reply = c._send, c._reply
    ops: dict[int, str] = {}

    def traced_send(op, args, piggyback=True):
        rid = send(op, args, piggyback)
        ops[rid] = op
        log.append((op, "sent", time.perf_counter()))
        return rid

    def traced_reply(rid, raw=False):
        try:
            return reply(rid, raw)
        finally:
            log.append((ops.get(rid, "?"), "reply", time.perf_counter()))
    puts = []
    c._send, c._reply = traced_send, traced_reply
    try:
        for _ in range(max(3, reps)):
            torch.cuda.synchronize()
            log.clear()
            t0 = time.perf_counter()
            h = put_async()
            t_ret = time.perf_counter()
            h.wait()
            done = time.perf_counter()
            ms = lambda t: round((t - t0) * 1e3, 4)   # noqa: E731
            ev = {f"{op}_{kind}": [ms(t) for o, k, t in log if (o, k) == (op, kind)]
                  for op in ("reserve", "commit") for kind in ("sent", "reply")}
            ev.update(ret_ms=ms(t_ret), done_ms=ms(done),
                      last_commit_ms=round(ms(done) - max(ev["commit_sent"] or [0.0]), 4))
            puts.append(ev)
    finally:
        del c._send, c._reply
    puts.sort(key=lambda g: g["done_ms"])
    return puts[len(puts) // 2]


def hash_ms(ns, src, rows: np.ndarray, reps: int) -> float:
    """The GPU checksums of a put alone (kvtier.gpu.xxh3 on its side stream): every chunk's
    commit waits for them."""
    from kvtier.gpu import transfer
    from kvtier.gpu.device import Mover, Staging, target_table
    from kvtier.gpu.streams import Stream
    table = target_table(src, ns.block_bytes)
    st = Stream.resolve(None, table.device)

    def once() -> None:
        staging = Staging(st)
        _side, _sums, done = transfer._hash(ns, Mover(None, table, st, transfer.policy(),
                                                      staging), table, rows, rows.size)
        if done is not None:
            done.synchronize()
        staging.release()
    return med(once, reps)


def commit_share(c, ns, kb: bytes, src, rows: np.ndarray, tag: str, reps: int) -> dict:
    """Where a put's time goes, its steps kept apart: reserve (until put_async returns: every
    reserve reply read and every copy enqueued, the first chunks already moving), the copies
    (and GPU hash) left, the commits (all sent only then, one after the other; a put that is
    waited for at once sends each as its chunk completes)."""
    import torch
    from kvtier.gpu import transfer
    parts = {"reserve": [], "copy": [], "commit": []}
    n = rows.size
    for _ in range(max(3, reps // 2)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h = transfer.put_async(ns, kb, n, src, None, rows, None, "host", None)
        t1 = time.perf_counter()
        for ev in h.events:
            ev.synchronize()
        t2 = time.perf_counter()
        h.wait()
        t3 = time.perf_counter()
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
            parts[k].append(v * 1e3)
    return {f"offload_{k}_ms_{tag}": round(float(np.median(v)), 3) for k, v in parts.items()}


def layers_case(c, reps: int, ceil: dict, n: int) -> dict:
    """n blocks of 2 MiB as 32 per-layer pages of 64 KiB (Pages over 32 tensors)."""
    import torch
    from kvtier.api.layouts import Pages
    page = 65536
    ns = namespace(c, "rows2m", LAYERS * page)   # the same blocks as rows2m, rewritten
    rng = np.random.default_rng(7)
    keys = b"".join((i + 1).to_bytes(16, "big") for i in range(n))
    caches = [torch.randint(0, 255, (n, page), dtype=torch.uint8, device="cuda")
              for _ in range(LAYERS)]
    pages = Pages.from_layers(caches)
    rows = rng.permutation(n)
    stream = torch.cuda.Stream()
    fresh = [torch.zeros_like(t) for t in caches]
    dst = Pages.from_layers(fresh)
    torch.cuda.synchronize()          # the data exists before another stream reads or writes it
    put = lambda: ns.put_async(keys, pages, rows=rows, stream=stream).wait()   # noqa: E731
    put()
    get = lambda: ns.get_async(keys, out=dst, rows=rows, stream=stream).wait()   # noqa: E731
    get()
    if not all(torch.equal(a, b) for a, b in zip(fresh, caches)):
        raise WrongBytes("the per-layer onboard returned wrong bytes")
    on = med(get, reps)
    off = med(put, reps)
    nbytes = n * LAYERS * page
    res = {"onboard_gbps_layers": round(nbytes / on / 1e9, 2),
           "offload_gbps_layers": round(nbytes / off / 1e9, 2),
           "onboard_ratio_layers": round(nbytes / on / 1e9 / ceil["pinned_h2d_gbps"], 3),
           "offload_ratio_layers": round(nbytes / off / 1e9 / ceil["pinned_d2h_gbps"], 3)}
    res.update(overlap(ns, keys, dst, rows, reps, timeline=True))
    from kvtier.gpu import transfer
    from kvtier.gpu.plan import TransferPolicy
    # The staged placements' stream and ring (TransferPolicy.layer_fork, layer_ring).
    # Or every page by copy engines (enqueued before get_async returns).
    defaults, variants = TransferPolicy(), {}
    for fork, ring, kb in ((False, 2, 16), (True, 2, 16), (True, 3, 16), (True, 4, 16),
                           (True, 3, 8), (True, 3, 32)):
        if (fork, ring, kb) != (defaults.layer_fork, defaults.layer_ring,
                                defaults.kernel_blocks):
            tag = (f"{'fork' if fork else 'inline'}_ring{ring}"
                   + ("" if kb == 16 else f"_blocks{kb}"))
            # _blocks{kb}: every kernel in kb thread blocks, the placements too
            variants[tag] = TransferPolicy(layer_fork=fork, layer_ring=ring, kernel_blocks=kb,
                                           place_blocks=0 if kb == 16 else kb)
    # The placements' thread blocks (TransferPolicy.place_blocks; 0: one per SM).
    for pb in (16, 33, 66, 264):           # 16: kernel_blocks, the placements' before
        variants[f"fork_ring3_place{pb}"] = TransferPolicy(place_blocks=pb)
    variants["copies"] = TransferPolicy(copy_engine_bytes=0)
    for tag, pol in variants.items():
        transfer.set_policy(pol)
        try:
            o = overlap(ns, keys, dst, rows, reps, timeline=True)
        except Exception as exc:                # the other variants still run
            res[f"layerwise_variant_{tag}"] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        finally:
            transfer.set_policy(None)
        res[f"layerwise_variant_{tag}"] = {
            key: o[key] for key in ("layerwise_overlap", "layerwise_load_ms",
                                    "layerwise_compute_ms", "layerwise_total_ms",
                                    "layerwise_timeline") if key in o}
    transfer.set_policy(TransferPolicy(staged=False))
    try:                                # the offload by the kernel into mapped host memory
        res["offload_ratio_layers_direct_kernel"] = round(
            nbytes / med(put, reps) / 1e9 / ceil["pinned_d2h_gbps"], 3)
    finally:
        transfer.set_policy(None)
    # The get's placements in 16 thread blocks, the count before place_blocks (0: one per
    # SM), against the default in this process.
    transfer.set_policy(TransferPolicy(place_blocks=16))
    try:
        res["onboard_ratio_layers_place16"] = round(
            nbytes / med(get, reps) / 1e9 / ceil["pinned_h2d_gbps"], 3)
    finally:
        transfer.set_policy(None)
    for name, pol in (("one_launch", TransferPolicy(staged=False)),
                      ("launch_per_layer", TransferPolicy(staged=False, one_launch_layers=False))):
        transfer.set_policy(pol)
        try:
            res[f"layerwise_overlap_{name}"] = overlap(ns, keys, dst, rows,
                                                       reps)["layerwise_overlap"]
        finally:
            transfer.set_policy(None)
    return res


def overlap(ns, keys: bytes, dst, rows: np.ndarray, reps: int, timeline: bool = False) -> dict:
    """Layer-wise load: layer i's compute (a fixed chain of matmuls on the compute stream)
    waits for layer i's event only. Total against max(load alone, compute alone)."""
    import torch
    load, comp = torch.cuda.Stream(), torch.cuda.Stream()
    t_load = med(lambda: ns.get_async(keys, out=dst, rows=rows, stream=load, layers=LAYERS)
                 .wait(), reps)
    x = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)

    def layer_kernel(k: int) -> None:
        for _ in range(k):
            torch.matmul(x, x, out=y)

    def compute(k: int) -> None:
        with torch.cuda.stream(comp):
            for _ in range(LAYERS):
                layer_kernel(k)
        comp.synchronize()
    one = med(lambda: compute(1), 3)
    k = max(1, round(t_load / one))          # compute alone ~ load alone: the hardest overlap
    t_comp = med(lambda: compute(k), reps)

    def both() -> None:
        h = ns.get_async(keys, out=dst, rows=rows, stream=load, layers=LAYERS)
        with torch.cuda.stream(comp):
            for i in range(LAYERS):
                h.wait_layer(i, comp)
                layer_kernel(k)
        comp.synchronize()
        h.wait()
    t_both = med(both, reps)
    probe = ns.get_async(keys, out=dst, rows=rows, stream=load, layers=LAYERS)
    probe.wait()
    res = {"layerwise_load_ms": round(t_load * 1e3, 3),
           "layerwise_compute_ms": round(t_comp * 1e3, 3),
           "layerwise_total_ms": round(t_both * 1e3, 3),
           "layerwise_overlap": round(t_both / max(t_load, t_comp), 3),
           "layerwise_one_launch": probe.one_launch, "layerwise_staged": probe.staged}
    if timeline and probe.staged:
        res["layerwise_timeline"] = layer_timeline(ns, keys, dst, rows, load, comp,
                                                   layer_kernel, k)
    return res


def layer_timeline(ns, keys: bytes, dst, rows: np.ndarray, load, comp, layer_kernel,
                   k: int) -> dict:
    """Where a staged layer-wise load beside its compute loses time, from timing events
    (Mover.trace_all: each layer's copy start and end on the load stream, its placement's on
    the kernel's; each layer's compute on the compute stream), the median over three runs after
    one unmeasured, in ms: copy_gap (the copy engine idle between layers, summed), place_wait
    (a copy's end to its placement's start, summed), compute_wait (the compute stream idle
    before layer l's compute, l >= 1, summed), copy_ms and compute_ms (per layer, medians),
    first_place_end and total (from the first copy's start to the last compute's end)."""
    import cupy
    import torch
    from kvtier.gpu.device import Mover
    ms = cupy.cuda.get_elapsed_time
    cs = cupy.cuda.ExternalStream(comp.cuda_stream)
    runs = []
    for _ in range(4):
        Mover.trace_all, marks = [], []
        try:
            h = ns.get_async(keys, out=dst, rows=rows, stream=load, layers=LAYERS)
            trace = Mover.trace_all
        finally:
            Mover.trace_all = None
        with torch.cuda.stream(comp):
            for i in range(LAYERS):
                h.wait_layer(i, comp)
                a, b = cupy.cuda.Event(), cupy.cuda.Event()
                a.record(cs)
                layer_kernel(k)
                b.record(cs)
                marks.append((a, b))
        comp.synchronize()
        h.wait()
        if len(trace) != LAYERS:
            return {"error": f"{len(trace)} staged pieces traced for {LAYERS} layers"}
        t0 = trace[0][0]
        at = lambda ev: ms(t0, ev)     # noqa: E731
        cp = [(at(x[0]), at(x[1])) for x in trace]
        pl = [(at(x[2]), at(x[3])) for x in trace]
        cm = [(at(a), at(b)) for a, b in marks]
        runs.append({
            "copy_gap": sum(cp[i + 1][0] - cp[i][1] for i in range(LAYERS - 1)),
            "place_wait": sum(pl[i][0] - cp[i][1] for i in range(LAYERS)),
            "compute_wait": sum(cm[i][0] - cm[i - 1][1] for i in range(1, LAYERS)),
            "copy_ms": float(np.median([b - a for a, b in cp])),
            "place_ms": float(np.median([b - a for a, b in pl])),
            "compute_ms": float(np.median([b - a for a, b in cm])),
            "first_place_end": pl[0][1], "last_copy_end": cp[-1][1], "total": cm[-1][1]})
    return {key: round(float(np.median([r[key] for r in runs[1:]])), 3) for key in runs[0]}


def copy_engine_diagnosis(c, reps: int, ceil: dict) -> dict:
    """Why 2 MiB copy-engine onboards stop short of the 1 GiB ceiling: 1,024 raw
    cudaMemcpyAsync of 2 MiB, scattered to scattered, from torch's pinned memory and from the
    host tier's registered segment; and the host's transparent huge pages for shared memory."""
    import cupy
    import torch
    bb, n = 2 << 20, 1024
    ns = namespace(c, "rows2m", bb)
    seg = ns._gpu().ranges[0].base
    pinned = torch.empty(n * bb, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n * bb, dtype=torch.uint8, device="cuda")
    rng = np.random.default_rng(11)
    src_rows, dst_rows = rng.permutation(n), rng.permutation(n)
    stream = torch.cuda.current_stream().cuda_stream

    def loop(base: int) -> None:
        for s_, d_ in zip(src_rows.tolist(), dst_rows.tolist()):
            cupy.cuda.runtime.memcpyAsync(dev.data_ptr() + d_ * bb, base + s_ * bb, bb, 4, stream)
    out = {}
    for name, base in (("pinned", pinned.data_ptr()), ("registered_segment", seg)):
        t = med(lambda: loop(base), reps)
        out[f"raw_copies_ratio_2m_{name}"] = round(n * bb / t / 1e9 / ceil["pinned_h2d_gbps"], 3)
        t1 = med(lambda: cupy.cuda.runtime.memcpyAsync(dev.data_ptr(), base, n * bb, 4, stream),
                 reps)
        out[f"one_copy_ratio_2g_{name}"] = round(n * bb / t1 / 1e9 / ceil["pinned_h2d_gbps"], 3)
    from kvtier.gpu.device import batch_available, copy_batch
    from kvtier.gpu.streams import Stream
    if batch_available():
        st = Stream.resolve(torch.cuda.Stream(), 0)
        host = pinned.data_ptr() + bb * src_rows.astype(np.uint64)
        devs = dev.data_ptr() + bb * dst_rows.astype(np.uint64)
        sizes = np.full(n, bb, np.uint64)

        def timed(fn) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            st.event().synchronize()
            return time.perf_counter() - t0
        for per in (16, 128, 1024):
            for way, (d_, s_, ceil_) in (("h2d", (devs, host, "pinned_h2d_gbps")),
                                         ("d2h", (host, devs, "pinned_d2h_gbps"))):
                timed(lambda: copy_batch(d_, s_, sizes, st, per))
                t = float(np.median([timed(lambda: copy_batch(d_, s_, sizes, st, per))
                                     for _ in range(reps)]))
                out[f"raw_batch_ratio_2m_{way}_{per}"] = round(n * bb / t / 1e9 / ceil[ceil_], 3)
    for knob in ("enabled", "shmem_enabled"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{knob}") as fh:
                out[f"thp_{knob}"] = fh.read().strip()
        except OSError as exc:
            out[f"thp_{knob}"] = str(exc)
    return out


def staging_case(c, reps: int, ceil: dict) -> dict:
    """Why whole gets lost (gpu3's first H200 call): the move alone of the rows cases' 4,096
    blocks of 64 / 16 KiB, leased once, into scattered rows, host waits on the transfer's event
    only, no control path: Mover.stage_sorted (16 MiB pieces; with 4 or 132 thread blocks for
    its placement kernel; with 4 MiB pieces; with move_pages16 placing (pages_kernel); with
    each piece's indices uploaded on the kernel stream (uploads_per_piece); both, as in round 3
    (as_round3); and its copies alone, into the staging ring, no kernel) against Mover.move
    (64 KiB: batched copy engines; 16 KiB: the direct kernel). _enqueue_ms: until the last
    launch returned; ratios to pinned H2D; staging_timeline_*: timeline()'s per-piece events."""
    import torch
    from kvtier.api import pipeline
    from kvtier.gpu.device import Mover, Staging, target_table
    from kvtier.gpu.plan import TransferPolicy
    from kvtier.gpu.streams import Stream
    out = {}
    for tag, bb in (("64k", 65536), ("16k", 16384)):
        n = 4096
        ns = namespace(c, f"rows{tag}", bb)
        kb = b"".join((i + 1).to_bytes(16, "big") for i in range(n))
        got = []
        _found, leases, error, _moved = pipeline.lease(ns, kb, n, lambda rep, lo: got.append(
            (rep.slots.copy(), lo)), None, n)
        try:
            if error is not None:
                raise error
            slots = np.concatenate([s_ for s_, _lo in got]).astype(np.int64)
            rows = np.random.default_rng(5).permutation(n)
            dst = torch.empty((n, bb), dtype=torch.uint8, device="cuda")
            table = target_table(dst, bb)
            st = Stream.resolve(torch.cuda.Stream(), table.device)
            seg = ns._gpu()

            def timed(pol, how, ahead=True):
                ts, enq = [], []
                for _ in range(reps + 1):
                    staging = Staging(st)
                    m = Mover(seg, table, st, pol, staging)
                    m.upload_ahead = ahead
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    if how == "sorted":
                        if not m.stage_sorted(slots, rows, 0, 1):
                            raise WrongBytes(f"stage_sorted refused the {tag} rows")
                    elif how == "copies":       # stage_sorted's copies, no kernel
                        order = np.argsort(slots)
                        sl = slots[order] - seg.ranges[0].first
                        per = pol.stage_piece_bytes // bb
                        for p0 in range(0, n, per):
                            piece = sl[p0:p0 + per]
                            span = int(piece[-1] - piece[0] + 1)
                            buf = m._buffer(span * bb)
                            import cupy
                            cupy.cuda.runtime.memcpyAsync(
                                buf[0], seg.ranges[0].base + int(piece[0]) * bb, span * bb,
                                4, st.ptr)
                    else:
                        m.move(slots, rows, 0, 1, False)
                    t1 = time.perf_counter()
                    m.event().synchronize()
                    ts.append(time.perf_counter() - t0)
                    enq.append(t1 - t0)
                    staging.release()
                t = float(np.median(ts[1:]))
                return (round(n * bb / t / 1e9 / ceil["pinned_h2d_gbps"], 3),
                        round(float(np.median(enq[1:])) * 1e3, 3), round(t * 1e3, 3))
            base = TransferPolicy(sorted_gets="on")
            old = TransferPolicy(sorted_gets="on", stage_items_kernel=False)
            runs = (("stage_sorted", base, "sorted", True),
                    ("stage_sorted_pages_kernel", old, "sorted", True),
                    ("stage_sorted_as_round3", old, "sorted", False),
                    ("stage_sorted_uploads_per_piece", base, "sorted", False),
                    ("stage_sorted_blocks_4", TransferPolicy(
                        sorted_gets="on", kernel_blocks=4), "sorted", True),
                    ("stage_sorted_blocks_132", TransferPolicy(
                        sorted_gets="on", kernel_blocks=132), "sorted", True),
                    ("stage_sorted_pieces_4m", TransferPolicy(
                        sorted_gets="on", stage_piece_bytes=4 << 20), "sorted", True),
                    ("stage_copies_only", base, "copies", True),
                    ("move", TransferPolicy(), "move", True))
            for name, pol, how, ahead in runs:
                r, e, t = timed(pol, how, ahead)
                out[f"staging_{name}_ratio_{tag}"] = r
                out[f"staging_{name}_enqueue_ms_{tag}"] = e
                out[f"staging_{name}_ms_{tag}"] = t
            for name, pol, _how, ahead in runs[:4]:
                out[f"staging_timeline_{name}_{tag}"] = timeline(
                    seg, table, st, pol, ahead, slots, rows)
            span = int(slots.max() - slots.min() + 1)
            out[f"staging_span_over_count_{tag}"] = round(span / n, 3)
        finally:
            for lease in leases:
                c._release_later(lease)
            c.ping()
    return out


def timeline(seg, table, st, pol, ahead: bool, slots: np.ndarray, rows: np.ndarray) -> dict:
    """stage_sorted's pieces on the GPU, from timing events around each piece's copy and
    its placement kernel (Mover.trace), medians of three runs after one unmeasured: copy_ms
    and place_ms per piece, wait_ms from a copy's end to its placement's start (a kernel that
    waits for more than its copy: failed overlap), total_ms from the first copy's start to the
    last placement's end, and exposed_ms: total less the copies' sum."""
    import cupy
    import torch
    from kvtier.gpu.device import Mover, Staging
    rounds = []
    for _ in range(4):
        staging = Staging(st)
        m = Mover(seg, table, st, pol, staging)
        m.upload_ahead, m.trace = ahead, []
        torch.cuda.synchronize()
        m.stage_sorted(slots, rows, 0, 1)
        m.event().synchronize()
        tr = m.trace
        ms = cupy.cuda.get_elapsed_time
        copy = [ms(x[0], x[1]) for x in tr]
        place = [ms(x[2], x[3]) for x in tr]
        wait = [ms(x[1], x[2]) for x in tr]
        total = ms(tr[0][0], tr[-1][3])
        rounds.append((float(np.median(copy)), float(np.median(place)), float(np.median(wait)),
                       float(max(wait)), total, total - sum(copy), len(tr)))
        staging.release()
    r = np.median(np.array(rounds[1:]), axis=0)
    return {"pieces": int(r[6]), "copy_ms": round(r[0], 4), "place_ms": round(r[1], 4),
            "wait_ms": round(r[2], 4), "wait_max_ms": round(r[3], 4),
            "total_ms": round(r[4], 3), "exposed_ms": round(r[5], 3)}


def profile_single(ns, key: bytes, out, n: int = 300) -> list:
    """Where a single-block CUDA get's time goes: cProfile's top functions by own time."""
    return profile(lambda: ns.get(key, out=out), n)


def profile(fn, n: int, top: int = 14) -> list:
    """cProfile's top functions by own time over n calls of fn, per call."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [f"{fn[2]} ({os.path.basename(fn[0])}:{fn[1]}): {v[2] / n * 1e6:.1f} us own, "
            f"{v[3] / n * 1e6:.1f} us cumulative" for fn, v in rows]


def single_get(c, reps: int) -> dict:
    import torch
    ns = namespace(c, "rows64k", 65536)
    keys = [(i + 1).to_bytes(16, "big") for i in range(64)]
    src = torch.randint(0, 255, (64, 65536), dtype=torch.uint8, device="cuda")
    ns.put(b"".join(keys), src)
    out = torch.empty(1, 65536, dtype=torch.uint8, device="cuda")
    for k in keys:
        ns.get(k, out=out)
    ts = []
    for i in range(max(200, reps * 20)):
        t0 = time.perf_counter()
        ns.get(keys[i % 64], out=out)
        ts.append((time.perf_counter() - t0) * 1e6)
    p = percentiles(ts)
    host = np.empty((1, 65536), np.uint8)
    th = []
    for i in range(200):
        t0 = time.perf_counter()
        ns.get(keys[i % 64], out=host)
        th.append((time.perf_counter() - t0) * 1e6)
    ta = []
    for i in range(200):
        t0 = time.perf_counter()
        ns.get_async(keys[i % 64], out=out).wait()
        ta.append((time.perf_counter() - t0) * 1e6)
    tp = []
    for _ in range(200):
        tp.append(c.ping() * 1e6)
    busy = c.stats().get("busy_poll")
    return {**small_gets(c), "single_ping_p50_us": round(float(np.median(tp)), 1),
            "service_busy_poll": busy,
            "single_cuda_get_p50_us": round(p["p50"], 1), "single_cuda_get_p99_us":
            round(p["p99"], 1), "single_host_get_p50_us": round(float(np.median(th)), 1),
            "single_cuda_get_async_p50_us": round(float(np.median(ta)), 1),
            "single_cuda_get_profile": profile_single(ns, keys[0], out)}


def small_gets(c, n: int = 64, bb: int = 16384) -> dict:
    """A get of n scattered blocks of bb bytes (a short prompt's worth of a small-page cache:
    the transfer kernel's path, one chunk) into a CUDA tensor and into host memory, p50 and
    p99 of 300 each, alternated: what the GPU path adds to the same leases per get (its
    table, staging, stream fork, launch and event), not bandwidth."""
    import torch
    ns = namespace(c, "small16k", bb)
    keys = b"".join((i + 1).to_bytes(16, "big") for i in range(n))
    src = torch.randint(0, 255, (n, bb), dtype=torch.uint8, device="cuda")
    ns.put(keys, src)
    rows = np.random.default_rng(5).permutation(4 * n)[:n]
    out = torch.zeros(4 * n, bb, dtype=torch.uint8, device="cuda")
    host = np.empty((n, bb), np.uint8)
    ns.get(keys, out=out, rows=rows)
    torch.cuda.synchronize()
    if not torch.equal(out[torch.as_tensor(rows, device="cuda")], src):
        raise WrongBytes("a small CUDA get returned wrong bytes")
    tc, th = [], []
    for _ in range(300):
        t0 = time.perf_counter()
        ns.get(keys, out=out, rows=rows)
        t1 = time.perf_counter()
        ns.get(keys, out=host)
        t2 = time.perf_counter()
        tc.append((t1 - t0) * 1e6)
        th.append((t2 - t1) * 1e6)
    pc, ph = percentiles(tc), percentiles(th)
    return {"small_cuda_get_p50_us": round(pc["p50"], 1),
            "small_cuda_get_p99_us": round(pc["p99"], 1),
            "small_host_get_p50_us": round(ph["p50"], 1),
            "small_host_get_p99_us": round(ph["p99"], 1),
            "small_get_blocks": n, "small_get_block_bytes": bb}


def hbm_case(c, reps: int, ceil: dict, n: int) -> dict:
    import torch
    bb = 2 << 20
    ns = namespace(c, "rows2m", bb)
    keys = b"".join((i + 1).to_bytes(16, "big") for i in range(n))
    src = torch.randint(0, 255, (n, bb), dtype=torch.uint8, device="cuda")
    rows = np.random.default_rng(3).permutation(n)
    ns.put(keys, src, tier="hbm")
    out = torch.zeros_like(src)
    get = lambda: ns.get(keys, out=out, rows=rows, tier="hbm")   # noqa: E731
    get()
    if not torch.equal(out[torch.as_tensor(rows, device="cuda")], src):
        raise WrongBytes("the HBM tier returned wrong bytes")
    t = med(get, reps)
    t_ctl = med(lambda: c._call("release", lease=c._call("get", ns=ns.name, keys=keys,
                                                        tier="hbm")["lease"]), reps)
    gbps = n * bb / t / 1e9
    from kvtier.gpu import transfer
    from kvtier.gpu.plan import TransferPolicy
    variants = {}
    for name, pol in (("copy_engines_batched", TransferPolicy(device_copy_engines=True)),
                      ("pages_kernel", TransferPolicy(device_items_kernel=False)),
                      ("kernel_blocks_132", TransferPolicy(device_kernel_blocks=132)),
                      ("kernel_blocks_528", TransferPolicy(device_kernel_blocks=528)),
                      ("copy_engines_per_call", TransferPolicy(device_copy_engines=True,
                                                               batch_copies=0))):
        transfer.set_policy(pol)
        try:
            get()
            if not torch.equal(out[torch.as_tensor(rows, device="cuda")], src):
                raise WrongBytes(f"the HBM tier returned wrong bytes ({name})")
            variants[name] = round(n * bb / med(get, reps) / 1e9 / ceil["d2d_gbps"], 3)
        finally:
            transfer.set_policy(None)
    return {"hbm_onboard_gbps_2m": round(gbps, 2), "hbm_variants_2m": variants,
            "hbm_onboard_ratio_2m": round(gbps / ceil["d2d_gbps"], 3),
            "hbm_onboard_ms_2m": round(t * 1e3, 3), "hbm_control_ms_2m": round(t_ctl * 1e3, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="3 repetitions")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cases", default="", help="comma-separated subset of the cases (rows2m, "
                    "layers, rows64k, rows16k, diagnosis, staging (after rows64k and rows16k), "
                    "single, hbm); default: all")
    ap.add_argument("--variants", default=None, help="comma-separated subset of the transfer "
                    "policy variants run after each rows case (default: all; '' for none)")
    args = ap.parse_args()
    reps = 3 if args.quick else args.reps
    m = header("bench/gpu.py")
    import torch
    import kvtier
    from kvtier.gpu import warm
    from tests.service import Service
    warm()
    out = ceilings(reps)
    mm = Matmul()
    mm.tflops(5)
    mm_alone = float(np.median([mm.tflops(20) for _ in range(3)]))
    out["matmul_tflops_alone"] = round(mm_alone, 1)
    work = tempfile.mkdtemp(prefix="kvtier-gpu-")
    svc = Service(os.path.join(work, "svc"), admin=False, host_capacity="6GiB",
                  nvme_capacity="0", hbm_capacity="2200MiB").start()
    from kvtier.gpu.plan import TransferPolicy as TP
    v2m = {"kernel": TP(copy_engine_bytes=1 << 40), "copy_per_call": TP(batch_copies=0),
           "batch_16": TP(batch_copies=16), "batch_1024": TP(batch_copies=1024),
           "credits": TP(put_credits=True)}
    k64 = {"onboard_copy_engine_bytes": 0}      # the 64 KiB onboard by the kernel, as before
    # Sorted gets forced on and off (the default is auto: kvtier.gpu.probe decides) and
    # puts that commit only from wait() (before early commits).
    whole = {"whole_gets": TP(sorted_gets="on"), "chunked_gets": TP(whole_onboard_keys=0),
             "sorted_512": TP(sorted_gets="on", sorted_piece_keys=512),
             "sorted_2048": TP(sorted_gets="on", sorted_piece_keys=2048),
             **{name: TP(get_ramp=ramp, sorted_gets="off") for name, ramp in (
                 ("ramp_64_256", (64, 256)), ("ramp_32_128_512", (32, 128, 512)),
                 ("ramp_128", (128,)), ("ramp_64", (64,)))},
             "sorted_64m": TP(sorted_gets="on", stage_piece_bytes=64 << 20),
             "sorted_2048_64m": TP(sorted_gets="on", sorted_piece_keys=2048,
                                   stage_piece_bytes=64 << 20),
             "late_commits": TP(early_commits=False),
             "credits": TP(put_credits=True)}
    v64k = {"kernel_onboard": TP(**k64),
            "direct_kernel": TP(staged=False, **k64),
            "kernel_without_priority": TP(kernel_priority=False, **k64),
            "copy_engines_only": TP(copy_engine_bytes=0),
            "batch_512": TP(batch_copies=512),
            "staged_offload": TP(staged_out_bytes=0),   # every put chunk gathered, then copied
            **{f"blocks_{b}": TP(kernel_blocks=b, **k64) for b in (4, 16, 32, 132)},
            # a share of each chunk's blocks read by the kernel beside the batched copies
            **{f"kernel_share_{round(x * 100)}": TP(kernel_share=x) for x in (0.125, 0.25, 0.5)},
            **whole}
    v16k = {"direct_kernel": TP(staged=False), "kernel_without_priority": TP(kernel_priority=False),
            "prepared": TP(prepare_launch=True, sorted_gets="off"),
            "staged_offload": TP(staged_out_bytes=0),
            "copy_engines_only": TP(copy_engine_bytes=0), **whole}
    if args.variants is not None:
        pick = set(filter(None, args.variants.split(",")))
        v2m, v64k, v16k = ({k: v for k, v in d.items() if k in pick} for d in (v2m, v64k, v16k))
    cases = [("rows2m", lambda c: rows_case(c, "rows2m", 2 << 20, 1024, reps, out, mm,
                                            mm_alone, v2m)),
             ("layers", lambda c: layers_case(c, reps, out, 1024)),
             ("rows64k", lambda c: rows_case(c, "rows64k", 65536, 4096, reps, out, mm,
                                             mm_alone, v64k)),
             ("rows16k", lambda c: rows_case(c, "rows16k", 16384, 4096, reps, out, mm,
                                             mm_alone, v16k)),
             ("diagnosis", lambda c: copy_engine_diagnosis(c, reps, out)),
             ("staging", lambda c: staging_case(c, reps, out)),
             ("single", lambda c: single_get(c, reps)),
             ("hbm", lambda c: hbm_case(c, reps, out, 1024))]
    if args.cases:
        wanted = args.cases.split(",")
        unknown = set(wanted) - {name for name, _case in cases}
        if unknown:
            raise SystemExit(f"unknown cases {sorted(unknown)}; known: "
                             f"{', '.join(name for name, _case in cases)}")
        cases = [(name, case) for name, case in cases if name in wanted]
    try:
        with kvtier.Client(str(svc.socket), timeout=300) as c:
            for name, case in cases:
                t0 = time.perf_counter()
                try:
                    out.update(case(c))
                except Exception as exc:          # the other cases still run; the field says
                    import traceback
                    traceback.print_exc()
                    out[f"error_{name}"] = f"{type(exc).__name__}: {exc}"
                print(f"# {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr,
                      flush=True)
    finally:
        svc.stop()
    h2d, d2h = out["pinned_h2d_gbps"], out["pinned_d2h_gbps"]
    for k, src, ceil in (("onboard_ratio_2m", "onboard_gbps_2m", h2d),
                         ("offload_ratio_2m", "offload_gbps_2m", d2h),
                         ("ratio_onboard_gbps_64k", "onboard_gbps_64k", h2d),
                         ("ratio_onboard_gbps_16k", "onboard_gbps_16k", h2d),
                         ("ratio_offload_gbps_64k", "offload_gbps_64k", d2h),
                         ("ratio_offload_gbps_16k", "offload_gbps_16k", d2h)):
        if src in out:
            out[k] = round(out[src] / ceil, 3)
    from kvtier.gpu import probe
    from kvtier.gpu.streams import PRIORITY
    out["kernel_priority_available"] = PRIORITY["available"]
    # What gpu_sorted_gets = auto found at warm(): the default's 16 KiB get is sorted where
    # the ratio is under the floor; variants_16k's whole_gets (on) and chunked_gets (off) are
    # the two choices measured in the same process.
    out["mapped_read_probe"] = {str(d): r for d, r in probe.results().items()}
    out["torch"] = torch.__version__
    out["machine"] = m
    emit(out, args.json)


if __name__ == "__main__":
    main()
