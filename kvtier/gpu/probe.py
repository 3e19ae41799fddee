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

measure(device) runs once per device and process, from kvtier.gpu.warm() (which the vLLM
connector calls when it registers the KV cache), never inside a get: a device not measured
keeps chunked gets. It reads 2,048 pages of 16 KiB from every other slot of a 64 MiB
registered buffer by the transfer kernel (its direct path, as a chunked get's: on the kernel
stream, forked from and joined to the probe's stream), and the same 32 MiB by one copy-engine
copy, each five times behind a short sleep of the probe's stream (so the interval timed is the
GPU's, not the host's enqueue), medians of timing events; ~20-40 ms with the registration. A
probe that fails or reads wrong bytes leaves the chunked gets, the choice before it.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import threading
from typing import Any

import numpy as np

from kvtier.gpu.plan import PageTable, TransferPolicy

log = logging.getLogger("kvtier.gpu")

PAGE = 16 << 10
PAGES = 2048
REPS = 5
_results: dict[int, dict[str, Any]] = {}
_lock = threading.RLock()


def results() -> dict[int, dict[str, Any]]:
    """What measure found per device: kernel_gbps, copy_gbps, ratio, sorted (or error)."""
    with _lock:
        return {d: dict(r) for d, r in _results.items()}


def prefers_sorted(device: int, policy: TransferPolicy) -> bool:
    """Whether gets of small pages on device go in the service's slot order under policy
    ("auto": the device was measured and reads mapped memory under the floor)."""
    if policy.sorted_gets != "auto":
        return policy.sorted_gets == "on"
    r = _results.get(device)
    return r is not None and r.get("ratio", 1.0) < policy.mapped_read_floor


def any_sorted(policy: TransferPolicy) -> bool:
    """Whether gets of small pages go sorted on any device under policy."""
    if policy.sorted_gets != "auto":
        return policy.sorted_gets == "on"
    with _lock:
        ratios = [r.get("ratio", 1.0) for r in _results.values()]
    return any(x < policy.mapped_read_floor for x in ratios)


def measure(device: int, policy: TransferPolicy | None = None) -> dict[str, Any]:
    """The probe (module docstring), once per device; a failure is logged and recorded."""
    with _lock:
        if device in _results:
            return _results[device]
        policy = policy or TransferPolicy()
        try:
            r = _measure(device, policy)
        except Exception as exc:        # a probe must not fail the engine's start
            log.warning("kvtier: GPU %d's mapped-read probe failed (%s: %s); gets of small "
                        "pages go in chunks", device, type(exc).__name__, exc)
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
    import torch
    from kvtier.gpu.device import Mover
    from kvtier.gpu.slots import MappedSegment
    from kvtier.gpu.staging import Staging
    from kvtier.gpu.streams import own
    buf = mmap.mmap(-1, 2 * PAGES * PAGE)
    host = np.frombuffer(buf, np.uint8).reshape(2 * PAGES, PAGE)
    slots = np.arange(0, 2 * PAGES, 2, dtype=np.int64)       # every other slot: not dense
    rows = np.random.default_rng(0).permutation(PAGES).astype(np.int64)
    host[:, :8].view(np.int64)[:, 0] = np.arange(2 * PAGES) + 1
    nbytes = PAGES * PAGE
    times: dict[str, list[float]] = {"kernel": [], "copy": []}
    kept: list[Staging] = []
    with cupy.cuda.Device(device):
        seg = MappedSegment(host)
        dst = 0
        try:
            dst = cupy.cuda.runtime.malloc(nbytes)
            st = own(device, "probe")
            table = PageTable.make([dst], [PAGE], [PAGE], PAGES, device)
            # The direct kernel, as a chunked get of scattered slots runs it.
            kernel_pol = dataclasses.replace(policy, staged=False, copy_engine_bytes=1 << 40,
                                             onboard_copy_engine_bytes=0)

            def kernel() -> None:
                staging = Staging(st)
                kept.append(staging)            # released once st has run it
                m = Mover(seg, table, st, kernel_pol, staging)
                m.move(slots, rows, 0, 1, False)
                m.event()                       # the kernel stream joined back into st

            def copy() -> None:
                cupy.cuda.runtime.memcpyAsync(dst, seg.ptr, nbytes, 1, st.ptr)

            kernel()
            st.cupy.synchronize()
            got = np.empty((PAGES, 8), np.uint8)
            cupy.cuda.runtime.memcpy2D(got.ctypes.data, 8, dst, PAGE, 8, PAGES, 2)
            if not np.array_equal(got.view(np.int64)[:, 0][rows], slots + 1):
                raise RuntimeError("the probe's kernel moved the wrong pages")
            for _ in range(REPS):
                for name, fn in (("kernel", kernel), ("copy", copy)):
                    with torch.cuda.stream(st.owner):
                        torch.cuda._sleep(2_000_000)        # ~1 ms: the enqueue hides behind
                    a, b = cupy.cuda.Event(), cupy.cuda.Event()
                    a.record(st.cupy)
                    fn()
                    b.record(st.cupy)
                    b.synchronize()
                    times[name].append(cupy.cuda.get_elapsed_time(a, b) / 1e3)
        finally:
            try:                                # nothing may still read or write them
                cupy.cuda.Device(device).synchronize()
            except Exception:
                pass
            for staging in kept:
                staging.release()
            if dst:
                cupy.cuda.runtime.free(dst)
            seg.close()
    k = nbytes / float(np.median(times["kernel"])) / 1e9
    c = nbytes / float(np.median(times["copy"])) / 1e9
    return {"kernel_gbps": round(k, 2), "copy_gbps": round(c, 2), "ratio": round(k / c, 3)}
