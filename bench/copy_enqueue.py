"""Why a 64 KiB onboard is bound by its copies' enqueue in some processes and not in others.

    python bench/copy_enqueue.py --json

Sessions 39 and 40 saw bench/gpu.py's 4,096 x 64 KiB onboard split in two by process, on the
same hosts: where the host took ~0.65 us to hand one copy to cuMemcpyBatchAsync
(kvtier.gpu.copies.copy_batch: 1,024 copies a chunk in 0.66 ms) the row read 0.85-0.87 of H2D,
and where it took ~1.3 us (1.2-1.35 ms a chunk, as long as the copy engine needs for the same
64 MiB) it read 0.79-0.83: the GPU waited for the enqueue. This measures the enqueue alone, in
one process, on the things that differ between processes:

- the CPU the enqueuing thread runs on (pinned to each allowed CPU in turn);
- a busy thread beside it: a Python spinner process (what the service's busy-poll loop is:
  the interpreter polling) on the same core's SMT sibling, on another core, or on the same CPU;
- more registered host ranges (a full bench/gpu.py run registers one segment a namespace).

Each figure: median over --reps of the host time of one copy_batch of --blocks copies of --bb
bytes from a mapped, registered shared region into random rows of a device buffer, and the GPU
time of those copies (events), per copy and in GB/s. The CPU topology is reported beside it.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header  # noqa: E402


def topology() -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    out: dict = {"allowed": cpus, "siblings": {}, "nodes": {}}
    for c in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as f:
                out["siblings"][c] = f.read().strip()
        except OSError:
            pass
    base = "/sys/devices/system/node"
    if os.path.isdir(base):
        for n in sorted(os.listdir(base)):
            if n.startswith("node"):
                try:
                    with open(f"{base}/{n}/cpulist") as f:
                        out["nodes"][n] = f.read().strip()
                except OSError:
                    pass
    return out


def sibling_of(c: int, topo: dict) -> int | None:
    text = topo["siblings"].get(c, "")
    ids: list[int] = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            ids.extend(range(int(a), int(b) + 1))
        elif part:
            ids.append(int(part))
    others = [i for i in ids if i != c and i in topo["allowed"]]
    return others[0] if others else None


def spin(cpu: int, ready: "mp.Event", stop: "mp.Event") -> None:
    os.sched_setaffinity(0, {cpu})
    ready.set()
    n = 0
    while not stop.is_set():
        for _ in range(1000):
            n += 1


class Case:
    """A registered shared region of slots, a device buffer of rows, and random copies."""

    def __init__(self, blocks: int, bb: int, region_bytes: int) -> None:
        import cupy
        from kvtier.gpu.streams import own
        self.map = mmap.mmap(-1, region_bytes, flags=mmap.MAP_SHARED)
        self.host = np.frombuffer(self.map, dtype=np.uint8)
        self.host[::4096] = 1                                  # touch every page
        cupy.cuda.runtime.hostRegister(self.host.ctypes.data, self.host.nbytes, 0x01 | 0x02)
        self.dev = cupy.empty(blocks * bb, dtype=cupy.uint8)
        rng = np.random.default_rng(bb)
        nslots = region_bytes // bb
        slots = rng.permutation(nslots)[:blocks]
        rows = rng.permutation(blocks)
        self.src = (self.host.ctypes.data + slots.astype(np.uint64) * np.uint64(bb)).astype(np.uint64)
        self.dst = (int(self.dev.data.ptr) + rows.astype(np.uint64) * np.uint64(bb)).astype(np.uint64)
        self.sizes = np.full(blocks, bb, dtype=np.uint64)
        self.stream = own(0, "enqueue-probe")
        self.blocks, self.bb = blocks, bb
        self.extra: list = []

    def register_more(self, n: int, nbytes: int) -> None:
        import cupy
        for _ in range(n):
            m = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED)
            a = np.frombuffer(m, dtype=np.uint8)
            a[::4096] = 1
            cupy.cuda.runtime.hostRegister(a.ctypes.data, a.nbytes, 0x01 | 0x02)
            self.extra.append((m, a))

    def once(self) -> tuple[float, float]:
        import cupy
        from kvtier.gpu.copies import copy_batch
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(self.stream.cupy)
        t0 = time.perf_counter()
        copy_batch(self.dst, self.src, self.sizes, self.stream, 1 << 20)
        host = time.perf_counter() - t0
        end.record(self.stream.cupy)
        end.synchronize()
        return host, cupy.cuda.get_elapsed_time(start, end) / 1e3

    def two_threads(self) -> tuple[float, float]:
        """The same copies, half each from two threads onto two streams at once (forked from
        one event, both ends waited for): whether the driver hands copies over faster from
        two threads than from one."""
        import threading
        import cupy
        from kvtier.gpu.copies import copy_batch
        from kvtier.gpu.streams import own
        other = own(0, "enqueue-probe-2")
        start, ends = cupy.cuda.Event(), [cupy.cuda.Event(), cupy.cuda.Event()]
        start.record(self.stream.cupy)
        other.wait(start)
        half = self.blocks // 2
        parts = [(self.stream, slice(0, half)), (other, slice(half, self.blocks))]
        go = threading.Barrier(2)
        spent = [0.0, 0.0]

        def run(i: int) -> None:
            st, sl = parts[i]
            cupy.cuda.runtime.setDevice(0)    # the driver's batch call needs a current context
            go.wait()
            t0 = time.perf_counter()
            copy_batch(self.dst[sl], self.src[sl], self.sizes[sl], st, 1 << 20)
            spent[i] = time.perf_counter() - t0
        ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for ev, (st, _) in zip(ends, parts):
            ev.record(st.cupy)
        for ev in ends:
            ev.synchronize()
        gpu = max(cupy.cuda.get_elapsed_time(start, ev) for ev in ends) / 1e3
        return max(spent), gpu

    def measure(self, reps: int, fn=None) -> dict:
        fn = fn or self.once
        fn()
        hs, gs = zip(*(fn() for _ in range(reps)))
        h, g = float(np.median(hs)), float(np.median(gs))
        return {"enqueue_us_per_copy": round(h / self.blocks * 1e6, 3),
                "enqueue_ms": round(h * 1e3, 3), "gpu_ms": round(g * 1e3, 3),
                "gpu_gbps": round(self.blocks * self.bb / g / 1e9, 2),
                "enqueue_spread_ms": [round(min(hs) * 1e3, 3), round(max(hs) * 1e3, 3)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--bb", type=int, default=65536)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--region-mib", type=int, default=1024)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from kvtier.gpu import warm
    warm(0)
    topo = topology()
    case = Case(args.blocks, args.bb, args.region_mib << 20)
    res: dict = {"machine": header("copy_enqueue"), "topology": topo, "blocks": args.blocks, "bb": args.bb, "per_cpu": {}}
    main_mask = os.sched_getaffinity(0)
    res["unpinned"] = case.measure(args.reps)
    for c in topo["allowed"]:
        os.sched_setaffinity(0, {c})
        res["per_cpu"][c] = case.measure(args.reps)
    os.sched_setaffinity(0, main_mask)
    per = {c: r["enqueue_us_per_copy"] for c, r in res["per_cpu"].items()}
    fast = min(per, key=per.get)
    res["fastest_cpu"], res["slowest_cpu"] = fast, max(per, key=per.get)
    spinners: dict = {}
    sib = sibling_of(fast, topo)
    other = next((c for c in topo["allowed"] if c != fast and c != sib
                  and sibling_of(c, topo) != fast), None)
    for name, cpu in (("sibling", sib), ("other_core", other), ("same_cpu", fast)):
        if cpu is None:
            spinners[name] = None
            continue
        ready, stop = mp.Event(), mp.Event()
        p = mp.Process(target=spin, args=(cpu, ready, stop), daemon=True)
        p.start()
        ready.wait(10)
        time.sleep(0.2)
        os.sched_setaffinity(0, {fast})
        spinners[name] = {"spinner_cpu": cpu, **case.measure(args.reps)}
        os.sched_setaffinity(0, main_mask)
        stop.set()
        p.join(5)
    res["beside_spinner"] = spinners
    os.sched_setaffinity(0, {fast})
    alone_again = case.measure(args.reps)
    os.sched_setaffinity(0, main_mask)            # two threads: on any CPUs, as one is here
    res["two_threads"] = {"one": case.measure(args.reps),
                          "two": case.measure(args.reps, case.two_threads)}
    os.sched_setaffinity(0, {fast})
    case.register_more(16, 64 << 20)
    res["with_16_more_ranges"] = {"alone": alone_again, "more": case.measure(args.reps)}
    os.sched_setaffinity(0, main_mask)
    emit(res, args.json)


if __name__ == "__main__":
    mp.set_start_method("spawn")
    main()
