"""How fast this host's GPU reads mapped host memory with its SMs, against a copy engine: the
measurement behind TransferPolicy.sorted_gets = "auto".

A chunked get of small pages (under gpu_onboard_copy_engine_bytes, 16 KiB rows) is moved by the
SM-bounded kernel straight from the mapped segment, so it runs at the rate the SMs read host
memory over PCIe. That rate is the host's, not the GPU's: H100 hosts of the same kind read at
44-49 GB/s in session 37 and at ~33 GB/s in sessions 36 and 38, where a copy engine reached 55
in all of them. A sorted get (kvtier.api.sortedgets, Mover.stage_sorted) moves the same pages by
copy engines into device staging and places them from there: it costs a lookup of the batch in
the service's slot order, and pays only where the kernel's reads are slow. Measured end to end
(bench/gpu.py variants_16k): on the fast hosts chunked 0.69-0.72 of H2D against sorted
0.60-0.66; on the slow ones chunked 0.51-0.54 against sorted 0.60-0.68. The kernel's own 64 KiB
rows read 0.82-0.86 of H2D on the fast hosts and 0.58-0.60 on the slow ones, so the crossover
lies near 0.75 (TransferPolicy.mapped_read_floor).

measure(device) runs once per device and process (kvtier.gpu.warm, or the first get that the
choice decides): 2,048 pages of 16 KiB from every other slot of a 64 MiB registered buffer by
the transfer kernel (its direct path, as a chunked get's), and the same 32 MiB by one
copy-engine copy, each five times on a stream of its own, medians of timing events; ~15 ms. A
probe that fails or reads wrong bytes leaves the chunked gets, the choice before it.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
from typing import Any

import numpy as np

from kvtier.gpu.plan import PageTable, TransferPolicy

log = logging.getLogger("kvtier.gpu")

PAGE = 16 << 10
PAGES = 2048
REPS = 5
_results: dict[int, dict[str, Any]] = {}


def results() -> dict[int, dict[str, Any]]:
    """What measure found per device: kernel_gbps, copy_gbps, ratio, sorted (or error)."""
    return {d: dict(r) for d, r in _results.items()}


def prefers_sorted(device: int, policy: TransferPolicy) -> bool:
    """Whether gets of small pages on device go in the service's slot order under policy."""
    if policy.sorted_gets != "auto":
        return policy.sorted_gets == "on"
    r = _results.get(device) or measure(device, policy)
    return bool(r.get("ratio", 1.0) < policy.mapped_read_floor)


def any_sorted(policy: TransferPolicy) -> bool | None:
    """Whether any device measured so far prefers sorted gets (None: none measured yet)."""
    if policy.sorted_gets != "auto":
        return policy.sorted_gets == "on"
    if not _results:
        return None
    return any(r.get("ratio", 1.0) < policy.mapped_read_floor for r in _results.values())


def measure(device: int, policy: TransferPolicy | None = None) -> dict[str, Any]:
    """The probe (module docstring), once per device; a failure is logged and recorded."""
    if device in _results:
        return _results[device]
    policy = policy or TransferPolicy()
    try:
        r = _measure(device, policy)
    except Exception as exc:            # a probe must not fail the get that asked for it
        log.warning("kvtier: GPU %d's mapped-read probe failed (%s: %s); gets of small pages "
                    "go in chunks", device, type(exc).__name__, exc)
        r = {"error": f"{type(exc).__name__}: {exc}"}
    else:
        r["sorted"] = r["ratio"] < policy.mapped_read_floor
        log.info("kvtier: GPU %d reads mapped host memory at %.1f GB/s, %.2f of a copy "
                 "engine's %.1f: gets of small pages go %s", device, r["kernel_gbps"],
                 r["ratio"], r["copy_gbps"], "in slot order" if r["sorted"] else "in chunks")
    _results[device] = r
    return r


def _measure(device: int, policy: TransferPolicy) -> dict[str, Any]:
    import cupy
    from kvtier.gpu.device import Mover
    from kvtier.gpu.slots import MappedSegment
    from kvtier.gpu.staging import Staging
    from kvtier.gpu.streams import Stream
    buf = mmap.mmap(-1, 2 * PAGES * PAGE)
    host = np.frombuffer(buf, np.uint8).reshape(2 * PAGES, PAGE)
    slots = np.arange(0, 2 * PAGES, 2, dtype=np.int64)       # every other slot: not dense
    rows = np.random.default_rng(0).permutation(PAGES).astype(np.int64)
    host[:, :8].view(np.int64)[:, 0] = np.arange(2 * PAGES) + 1
    seg = MappedSegment(host)
    try:
        with cupy.cuda.Device(device):
            dst = cupy.zeros((PAGES, PAGE), cupy.uint8)
            st = Stream.resolve(cupy.cuda.Stream(non_blocking=True), device)
            table = PageTable.make([dst.data.ptr], [PAGE], [PAGE], PAGES, device)
            # The direct kernel, as a chunked get of scattered slots runs it.
            kernel_pol = dataclasses.replace(policy, staged=False, copy_engine_bytes=1 << 40,
                                             onboard_copy_engine_bytes=0)

            def kernel() -> Staging:
                staging = Staging(st)
                m = Mover(seg, table, st, kernel_pol, staging)
                m.move(slots, rows, 0, 1, False)
                m.event()                       # the kernel stream joined back into st
                return staging                  # released once st has run it

            def copy() -> None:
                cupy.cuda.runtime.memcpyAsync(dst.data.ptr, seg.ptr, PAGES * PAGE, 1, st.ptr)

            first = kernel()
            st.cupy.synchronize()
            first.release()
            got = cupy.asnumpy(dst[:, :8]).view(np.int64)[:, 0]
            if not np.array_equal(got[rows], slots + 1):
                raise RuntimeError("the probe's kernel moved the wrong pages")
            times = {"kernel": [], "copy": []}
            for _ in range(REPS):
                for name, fn in (("kernel", kernel), ("copy", copy)):
                    a, b = cupy.cuda.Event(), cupy.cuda.Event()
                    a.record(st.cupy)
                    staging = fn()
                    b.record(st.cupy)
                    b.synchronize()
                    if staging is not None:
                        staging.release()
                    times[name].append(cupy.cuda.get_elapsed_time(a, b) / 1e3)
            st.cupy.synchronize()
            del dst
    finally:
        seg.close()
    nbytes = PAGES * PAGE
    k = nbytes / float(np.median(times["kernel"])) / 1e9
    c = nbytes / float(np.median(times["copy"])) / 1e9
    return {"kernel_gbps": round(k, 2), "copy_gbps": round(c, 2), "ratio": round(k / c, 3)}
