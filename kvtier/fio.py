"""`kvtier bench`: an fio-style benchmark of one tier, in fio's words.

    kvtier bench --rw=randread --bs=64k --iodepth=32 --numjobs=2 --size=512m --runtime=10 \\
                 --tier=nvme --direct=1 [--compare] [--output-format=json] [--plot out.png]
    kvtier bench jobs.fio            # fio's INI syntax: [global] plus one section per job

How fio's options map onto kvtier. A job owns ``size`` bytes of blocks of ``bs`` bytes each (one
namespace, block_bytes = bs). ``iodepth`` is the job's blocks in flight: ``calls`` (kvtier's own
option, 1 unless given) calls of iodepth / calls blocks each, each
call complete (a put synced and applied) before its lane issues the next, so a job never has
more than iodepth blocks in flight, as fio never has more than iodepth I/Os. ``numjobs`` jobs
each run the job. ``rw`` picks sequential
or random block order and reads (gets), writes (puts) or both (randrw: ``rwmixread`` percent
reads, 50 by default, or ``rwmixwrite``);
``random_distribution=zipf:THETA`` skews random picks. ``direct`` is passed to fio for --compare;
kvtier's NVMe tier always uses O_DIRECT where the block size allows.

Tiers: ``host`` (blocks resident in the host tier), ``nvme`` (reads come from the NVMe log: the
host tier is sized to one batch per job and emptied after each get, and after each put of a
randrw job, so every read is copy-on-read from the disk, as fio's direct=1 reads are), ``hbm`` (needs CUDA) and
``service`` (a running `kvtier serve`, through kvtier.Client; --socket).

Baselines (--compare), in the same run: fio itself on a file in the same directory with the same
options (nvme), a numpy copy of the same bytes (host), a real redis-server with pipelined
GET/SET (service). Each report line carries the ratio to its baseline.

Output: fio's shape (IOPS, bandwidth in MiB/s and MB/s, clat min/avg/max/stdev and percentiles),
plus kvtier's own: tier hits, promotions, demotions, NVMe write amplification. With
--output-format=json the field names are fio's (jobs[].read.iops, bw_bytes, clat_ns.percentile).
"""

from __future__ import annotations

import argparse
import configparser
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

import numpy as np

from kvtier.config import make_settings, parse_size
from kvtier.errors import ConfigError, KvtierError

RW = ("read", "write", "randread", "randwrite", "randrw")
TIERS = ("host", "nvme", "hbm", "service")
# Calls in flight per job on the NVMe tier unless calls= says otherwise (issue 17, fio5: on the
# H200 host 2 calls of 8 ran 0.88-0.90x one call of 16, the lanes' Python then near one core;
# docs/DESIGN-NOTES.md).
AUTO_CALLS = 1
PCTS = (1.0, 5.0, 10.0, 50.0, 90.0, 95.0, 99.0, 99.9, 99.99)


@dataclass(slots=True)
class Job:
    name: str = "job"
    rw: str = "randread"
    bs: int = 4096
    iodepth: int = 1
    numjobs: int = 1
    size: int = 64 << 20
    runtime: float = 5.0
    ramp_time: float = 0.0
    direct: bool = False
    zipf: float | None = None
    rwmixread: int = 50
    tier: str = "host"
    directory: str = ""
    socket: str = ""
    calls: int = 0          # kvtier's own: iodepth split over this many calls in flight (0: auto)

    def validate(self) -> "Job":
        if self.rw not in RW:
            raise ConfigError(f"rw={self.rw!r}: use one of {', '.join(RW)}")
        if self.tier not in TIERS:
            raise ConfigError(f"tier={self.tier!r}: use one of {', '.join(TIERS)}")
        if self.bs <= 0 or self.size < self.bs:
            raise ConfigError(f"bs={self.bs} and size={self.size}: need 0 < bs <= size")
        if not 1 <= self.iodepth <= 4096 or not 1 <= self.numjobs <= 256:
            raise ConfigError("iodepth must be 1..4096 and numjobs 1..256")
        if self.runtime <= 0 or self.ramp_time < 0:
            raise ConfigError("runtime must be positive and ramp_time not negative")
        if self.zipf is not None and not 0 < self.zipf < 10:
            raise ConfigError("random_distribution=zipf:THETA needs 0 < THETA < 10")
        if not 0 <= self.rwmixread <= 100:
            raise ConfigError(f"rwmixread={self.rwmixread}: a percentage, 0..100")
        if not 0 <= self.calls <= self.iodepth:
            raise ConfigError(f"calls={self.calls}: split iodepth={self.iodepth} over 1..iodepth "
                              "calls in flight (0: kvtier picks)")
        if self.calls > 1 and self.tier == "service":
            raise ConfigError("calls > 1 needs an in-process tier; through the service each "
                              "job has one call in flight")
        if self.directory and not os.path.isdir(self.directory):
            raise ConfigError(f"directory={self.directory!r} does not exist or is not a "
                              "directory; create it or point --directory elsewhere")
        return self

    def call_sizes(self) -> list[int]:
        """The blocks of each call a job keeps in flight: iodepth split as evenly as it goes
        over ``calls`` calls (auto: AUTO_CALLS on the NVMe tier, one elsewhere)."""
        k = self.calls or (min(AUTO_CALLS, self.iodepth) if self.tier == "nvme" else 1)
        return [self.iodepth // k + (i < self.iodepth % k) for i in range(k)]


def _time(text: str, name: str) -> float:
    t = str(text).strip().lower()
    mult = 1.0
    for suffix, m in (("ms", 1e-3), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if t.endswith(suffix):
            t, mult = t[: -len(suffix)], m
            break
    try:
        return float(t) * mult
    except ValueError:
        raise ConfigError(f"{name}={text!r}: expected seconds, e.g. 10 or 10s") from None


def _fio_size(text: str, name: str) -> int:
    t = str(text).strip()
    # fio's k/m/g are binary (1k = 1024), unlike kvtier's config sizes.
    if t and t[-1].lower() in "kmgt" and t[:-1].replace(".", "").isdigit():
        return int(float(t[:-1]) * 1024 ** ("kmgt".index(t[-1].lower()) + 1))
    return parse_size(t, name)


def apply_option(job: Job, key: str, value: str | None) -> Job:
    """One fio option onto a job. Unknown options are an error, not ignored."""
    key = key.strip().lower().replace("-", "_")
    v = "" if value is None else str(value).strip()
    try:
        match key:
            case "rw" | "readwrite":
                return replace(job, rw=v)
            case "bs" | "blocksize":
                return replace(job, bs=_fio_size(v, "bs"))
            case "size":
                return replace(job, size=_fio_size(v, "size"))
            case "iodepth" | "numjobs" | "rwmixread" | "calls":
                return replace(job, **{key: int(v)})
            case "rwmixwrite":
                return replace(job, rwmixread=100 - int(v))
            case "runtime" | "ramp_time":
                return replace(job, **{key: _time(v, key)})
            case "direct":
                return replace(job, direct=v in ("", "1", "true"))
            case "random_distribution":
                if v == "random":
                    return replace(job, zipf=None)
                kind, _, theta = v.partition(":")
                if kind != "zipf" or not theta:
                    raise ConfigError(f"random_distribution={v!r}: kvtier supports random and "
                                      "zipf:THETA")
                return replace(job, zipf=float(theta))
            case "tier" | "directory" | "socket" | "name":
                return replace(job, **{key: v})
            case "ioengine" | "group_reporting" | "time_based" | "filename":
                return job            # accepted for fio compatibility; kvtier has its own I/O
    except ValueError:
        raise ConfigError(f"{key}={v!r}: not a valid value") from None
    raise ConfigError(f"unknown fio option {key!r}")


def parse_jobfile(text: str) -> list[Job]:
    """fio's INI syntax: [global] options apply to every following job section."""
    cp = configparser.ConfigParser(allow_no_value=True, interpolation=None, strict=False,
                                   default_section="__none__")
    try:
        cp.read_string(text)
    except configparser.Error as exc:
        raise ConfigError(f"job file: {exc.message.splitlines()[0]}") from None
    base = Job()
    if cp.has_section("global"):
        for k, v in cp.items("global"):
            base = apply_option(base, k, v)
    jobs = []
    for section in cp.sections():
        if section == "global":
            continue
        job = replace(base, name=section)
        for k, v in cp.items(section):
            job = apply_option(job, k, v)
        jobs.append(job.validate())
    if not jobs:
        raise ConfigError("job file has no job section (only [global]?)")
    return jobs


# ---------------------------------------------------------------------- running a job

@dataclass(slots=True)
class Samples:
    read: list[float] = field(default_factory=list)     # seconds per block
    write: list[float] = field(default_factory=list)
    errors: int = 0
    timeline: list[tuple[float, int]] = field(default_factory=list)   # (t, bytes)


def _order(job: Job, nblocks: int, rng: np.random.Generator, n: int) -> np.ndarray:
    if not job.rw.startswith("rand"):
        return np.arange(n) % nblocks
    if job.zipf is not None:
        # fio's zipf:THETA: rank k of the file's nblocks with probability proportional to
        # k^-THETA, the ranks scattered over the file (fio hashes them). numpy's zipf(1 +
        # THETA), used before, is unbounded and far steeper: at THETA 1.1 over 4,096 blocks it
        # gave rank 1 64% of the picks (fio: 16%) and a 16-block batch 4.6 distinct blocks
        # (fio: 13), so kvtier read and wrote fewer distinct blocks than fio did.
        ranks = _zipf_ranks(job.zipf, nblocks, rng, n)
        return (ranks * _scatter_step(nblocks) + nblocks // 3) % nblocks
    return rng.integers(0, nblocks, n)


_ZIPF_EXACT = 1 << 20      # ranks drawn from exact weights; past them, the continuous tail


def _zipf_ranks(theta: float, nblocks: int, rng: np.random.Generator, n: int) -> np.ndarray:
    """n ranks in 0..nblocks-1, rank k (from 0) with probability proportional to (k+1)^-theta.
    Exact over the first _ZIPF_EXACT ranks; beyond (a tier of millions of blocks), the tail
    is the integral's inverse, so memory stays O(_ZIPF_EXACT) whatever the size."""
    head = min(nblocks, _ZIPF_EXACT)
    w = np.arange(1, head + 1, dtype=np.float64) ** -theta
    lo, hi = head + 0.5, nblocks + 0.5

    def integral(a: float, b: float) -> float:
        return np.log(b / a) if theta == 1 else (b ** (1 - theta) - a ** (1 - theta)) / (1 - theta)

    tail = integral(lo, hi) if nblocks > head else 0.0
    ranks = rng.choice(head, n, p=w / w.sum())
    if tail > 0:
        in_tail = rng.random(n) < tail / (tail + w.sum())
        u = rng.random(int(in_tail.sum())) * tail
        x = (np.exp(u) * lo if theta == 1
             else (lo ** (1 - theta) + u * (1 - theta)) ** (1 / (1 - theta)))
        ranks[in_tail] = np.clip(np.rint(x).astype(np.int64) - 1, head, nblocks - 1)
    return ranks


def _scatter_step(nblocks: int) -> int:
    """A step coprime to nblocks near 0.618 nblocks: k -> k x step mod nblocks is a bijection
    that puts neighbouring ranks far apart, as fio's hash of the rank does."""
    step = max(1, int(nblocks * 0.6180339887)) | 1
    while np.gcd(step, nblocks) != 1:
        step += 2
    return step


def page_aligned(n: int, bs: int) -> np.ndarray:
    """n x bs bytes starting on a page boundary, as fio's own I/O buffers and the host tier's
    slots do. A copy between buffers not aligned alike (malloc's large blocks start 16 bytes
    into a page) runs the CPU's string copy on its slow path: 16 x 64 KiB from the pool into a
    malloc'd array took 0.46 ms of CPU, into a page-aligned one 0.045 (issue 17, fio6, dev VM);
    the bench's puts copy from such a buffer into the pool too."""
    buf = mmap.mmap(-1, max(1, n * bs))
    return np.frombuffer(buf, dtype=np.uint8)[: n * bs].reshape(n, bs)


class _Target:
    """put/get of a batch of block indices against one tier."""

    def __init__(self, job: Job, workdir: str) -> None:
        self.job = job
        self.nblocks = max(1, job.size // job.bs)
        self.data = page_aligned(job.iodepth, job.bs)
        self.data[:] = np.random.default_rng(7).integers(0, 256, (job.iodepth, job.bs),
                                                         dtype=np.uint8)
        self.keys = np.array([(i + 1).to_bytes(16, "big") for i in range(self.nblocks)],
                             dtype="V16")
        self.client = None
        if job.tier == "service":
            import kvtier
            self.client = kvtier.Client(job.socket or None)
            self.ns = self.client.namespace(f"bench/{job.name}/{job.bs}", block_bytes=job.bs)
            self.engine = None
            return
        from kvtier.coherence.engine import Engine
        per_batch = job.iodepth * job.bs
        host = (self.nblocks * job.bs + per_batch * job.numjobs * 2 if job.tier == "host"
                else per_batch * job.numjobs * 2)
        self.engine = Engine(make_settings({
            "data_dir": workdir, "host_capacity": host,
            "nvme_capacity": 0 if job.tier == "host" else 4 * self.nblocks * job.bs + (64 << 20),
            "write_policy": "write_back" if job.tier == "host" else "write_through",
            "segment_bytes": max(64 << 20, 16 * job.bs), "io_threads": min(64, job.iodepth)}))
        self.engine.create_namespace("bench", job.bs)

    def fill(self) -> None:
        for lo in range(0, self.nblocks, self.job.iodepth):
            idx = np.arange(lo, min(self.nblocks, lo + self.job.iodepth))
            self.put(idx, owner=0)

    def put(self, idx: np.ndarray, owner: int) -> None:
        kb = self.keys[idx].tobytes()
        if self.client is not None:
            self.ns.put(kb, self.data[: idx.size])
        else:
            self.engine.put("bench", kb, self.data[: idx.size], owner=owner)
            if self.job.tier == "nvme" and self.job.rw == "randrw":
                from kvtier.types import Tier
                self.engine.evict(Tier.HOST, 1 << 30, "bench")   # a read after it: from NVMe

    def get(self, idx: np.ndarray, owner: int, out: np.ndarray) -> bool:
        kb = self.keys[idx].tobytes()
        if self.client is not None:
            found, _ = self.ns.get(kb, out=out[: idx.size])
            return bool(found.all())
        from kvtier.types import Tier
        res = self.engine.get("bench", kb, owner=owner)
        pool = self.engine.namespace("bench").slots[Tier.HOST].pool
        slots = pool.check_slots(res.slots[res.found])
        # mode="clip" on slots checked just above: numpy's default mode="raise" copies through
        # a temporary buffer when out is given, a fresh 1 MiB each get (issue 17, fio6: with
        # out page-aligned, 16 x 64 KiB 0.14 ms of CPU against 0.045, dev VM).
        np.take(pool.array, slots, axis=0, out=out[: slots.size], mode="clip")
        self.engine.release(res.lease_id, owner)
        if self.job.tier == "nvme":
            # Every read from NVMe, as fio's direct=1 reads from the disk: the lane's host copies
            # go (those just read and those just written). Evicting idx.size in the policy's
            # order left the batch just read resident, and 22-32% of a zipf job's reads were
            # host hits (fio10; uniform jobs under 1%).
            self.engine.evict(Tier.HOST, 1 << 30, "bench")
        return bool(res.found.all())

    def stats(self) -> dict[str, Any]:
        return self.client.stats() if self.client is not None else self.engine.stats()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        else:
            self.engine.close(flush=False)


def _workdir(prefix: str, job: Job) -> str:
    try:
        return tempfile.mkdtemp(prefix=prefix, dir=job.directory or None)
    except OSError as exc:
        raise ConfigError(f"cannot create a work directory in {job.directory or 'TMPDIR'}: "
                          f"{exc.strerror}; point --directory at a writable directory") from None


def run_job(job: Job, progress: Any = None) -> dict[str, Any]:
    job.validate()
    workdir = _workdir("kvtier-fio-", job)
    target = _Target(job, workdir)
    try:
        if job.rw in ("read", "randread", "randrw"):
            target.fill()
        before = target.stats()
        sizes = job.call_sizes()
        per_lane = [Samples() for _ in range(job.numjobs * len(sizes))]
        cpu = [0.0] * len(per_lane)
        failed: list[BaseException] = []
        start = time.perf_counter()
        stop_at = start + job.ramp_time + job.runtime

        def stream(j: int) -> Callable[[int], tuple[np.ndarray, bool]]:
            """Job j's one stream of blocks and of read / write picks, shared by its calls in
            flight (as fio's iodepth slots share one job's stream): the next n blocks."""
            rng = np.random.default_rng(100 + j)
            order = _order(job, target.nblocks, rng, 1 << 16)
            pos = (j * target.nblocks // job.numjobs) if not job.rw.startswith("rand") else 0
            lock = threading.Lock()

            def take(n: int) -> tuple[np.ndarray, bool]:
                nonlocal pos
                with lock:
                    idx = order[(pos + np.arange(n)) % order.size]
                    pos += n
                    write = job.rw in ("write", "randwrite") or (
                        job.rw == "randrw" and rng.random() * 100 >= job.rwmixread)
                return idx, write
            return take

        def lane(j: int, n: int, s: Samples, slot: int,
                 take: Callable[[int], tuple[np.ndarray, bool]]) -> None:
            """One call of n blocks in flight at a time, each complete (a put acknowledged:
            synced and applied) before this lane's next; a job's lanes hold at most iodepth
            blocks in flight together."""
            out = page_aligned(n, job.bs)
            t_cpu = time.thread_time()
            try:
                while time.perf_counter() < stop_at:
                    idx, write = take(n)
                    t0 = time.perf_counter()
                    try:
                        if write:
                            target.put(idx, owner=j + 1)
                        elif not target.get(idx, owner=j + 1, out=out):
                            s.errors += 1
                    except KvtierError:     # counted, as fio counts I/O errors
                        s.errors += 1
                        continue
                    t1 = time.perf_counter()
                    if t0 - start >= job.ramp_time:
                        # Every block of a call completes when it returns: its completion
                        # latency is the call's, as fio's clat is per I/O at that depth.
                        (s.write if write else s.read).extend([t1 - t0] * n)
                        s.timeline.append((t1 - start, n * job.bs))
            except BaseException as exc:    # not an I/O error: the run fails, loudly
                failed.append(exc)
            finally:
                cpu[slot] = time.thread_time() - t_cpu

        threads = []
        for j in range(job.numjobs):
            take = stream(j)
            for i, n in enumerate(sizes):
                slot = j * len(sizes) + i
                threads.append(threading.Thread(target=lane,
                                                args=(j, n, per_lane[slot], slot, take)))
        cpu_before = time.process_time()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(0.1)
            if progress is not None:
                progress(min(1.0, (time.perf_counter() - start) / (job.ramp_time + job.runtime)))
        for t in threads:
            t.join()
        if failed:
            raise failed[0]
        cpu_s = {"lanes": round(sum(cpu), 3), "process": round(time.process_time() - cpu_before, 3)}
        after = target.stats()
    finally:
        target.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return report(job, per_lane, before, after, cpu_s)


def _clat(samples: list[float]) -> dict[str, Any]:
    if not samples:
        return {"min": 0, "max": 0, "mean": 0.0, "stddev": 0.0, "N": 0, "percentile": {}}
    a = np.asarray(samples) * 1e9
    return {"min": int(a.min()), "max": int(a.max()), "mean": float(a.mean()),
            "stddev": float(a.std()), "N": int(a.size),
            "percentile": {f"{p:.6f}": int(np.percentile(a, p)) for p in PCTS}}


def _dir(samples: list[float], bs: int, runtime: float) -> dict[str, Any]:
    n = len(samples)
    bw = n * bs / runtime if runtime else 0.0
    return {"io_bytes": n * bs, "bw_bytes": int(bw), "bw": int(bw / 1024),
            "iops": n / runtime if runtime else 0.0, "runtime": int(runtime * 1000),
            "total_ios": n, "clat_ns": _clat(samples)}


def report(job: Job, per_job: list[Samples], before: dict, after: dict,
           cpu_s: dict[str, float] | None = None) -> dict[str, Any]:
    reads = [x for s in per_job for x in s.read]
    writes = [x for s in per_job for x in s.write]
    errors = sum(s.errors for s in per_job)
    kv: dict[str, Any] = {}
    for tier, d in after.get("tiers", {}).items():
        b = before.get("tiers", {}).get(tier, {})
        kv[tier] = {k: d.get(k, 0) - b.get(k, 0) for k in
                    ("hits", "misses", "promotions", "demotions", "evictions")}
    gets = after.get("gets", 0) - before.get("gets", 0)
    hits = after.get("get_hits", 0) - before.get("get_hits", 0)
    wa = after.get("tiers", {}).get("nvme", {}).get("write_amplification")
    timeline = sorted(t for s in per_job for t in s.timeline)
    return {
        "jobname": job.name, "groupid": 0, "error": errors,
        "job options": {"rw": job.rw, "rwmixread": str(job.rwmixread),
                        "bs": str(job.bs), "iodepth": str(job.iodepth),
                        "numjobs": str(job.numjobs), "size": str(job.size),
                        "runtime": str(job.runtime), "tier": job.tier,
                        "calls": str(len(job.call_sizes()))},
        "read": _dir(reads, job.bs, job.runtime), "write": _dir(writes, job.bs, job.runtime),
        "kvtier": {"tiers": kv, "hit_ratio": hits / gets if gets else None,
                   "nvme_write_amplification": wa, "calls_in_flight": len(job.call_sizes()),
                   "cpu_s": cpu_s},
        "_timeline": timeline,
    }


# ---------------------------------------------------------------------- baselines

def fio_baseline(job: Job) -> dict[str, Any] | None:
    """fio on a file in the job's directory with the same options; None without fio."""
    fio = shutil.which("fio")
    if fio is None:
        return None
    workdir = _workdir("kvtier-fio-base-", job)
    try:
        args = [fio, "--name", job.name, "--filename", os.path.join(workdir, "fio.dat"),
                "--rw", job.rw, "--bs", str(job.bs), "--iodepth", str(job.iodepth),
                "--numjobs", str(job.numjobs), "--size", str(job.size),
                "--runtime", str(job.runtime), "--ramp_time", str(job.ramp_time),
                "--time_based", "--direct", "1" if job.direct else "0",
                "--ioengine", "libaio", "--group_reporting", "--output-format", "json"]
        if job.zipf is not None:
            args += ["--random_distribution", f"zipf:{job.zipf}"]
        if job.rw == "randrw":
            args += ["--rwmixread", str(job.rwmixread)]
        if job.rw in ("write", "randwrite", "randrw"):
            args += ["--fdatasync", str(job.iodepth)]
        out = subprocess.run(args, capture_output=True, text=True, timeout=job.runtime + 600)
        if out.returncode != 0:
            raise ConfigError(f"fio failed: {out.stderr.strip()[:300]}")
        return json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def memcpy_baseline(job: Job) -> dict[str, Any]:
    n = max(1, job.size // job.bs)
    src = np.ones((n, job.bs), dtype=np.uint8)
    dst = np.empty((job.iodepth, job.bs), dtype=np.uint8)
    rng = np.random.default_rng(1)
    samples = []
    end = time.perf_counter() + min(job.runtime, 3.0)
    while time.perf_counter() < end:
        idx = _order(job, n, rng, job.iodepth)
        t0 = time.perf_counter()
        np.take(src, idx, axis=0, out=dst)
        samples.append(time.perf_counter() - t0)
    total = sum(samples)
    samples = samples * job.iodepth
    return {"read": {"bw_bytes": int(len(samples) * job.bs / total), "iops": len(samples) / total},
            "write": {"bw_bytes": int(len(samples) * job.bs / total),
                      "iops": len(samples) / total}}


def redis_baseline(job: Job) -> dict[str, Any] | None:
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    import redis
    tmp = tempfile.mkdtemp(prefix="kvtier-redis-")
    sock = os.path.join(tmp, "r.sock")
    proc = subprocess.Popen([exe, "--port", "0", "--unixsocket", sock, "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        for _ in range(200):
            if os.path.exists(sock):
                break
            time.sleep(0.025)
        r = redis.Redis(unix_socket_path=sock)
        n = max(1, job.size // job.bs)
        val = b"x" * job.bs
        p = r.pipeline(transaction=False)
        for i in range(n):
            p.set(i.to_bytes(8, "big"), val)
        p.execute()
        rng = np.random.default_rng(1)
        out: dict[str, Any] = {}
        for kind in ("read", "write"):
            count, spent = 0, 0.0
            end = time.perf_counter() + min(job.runtime, 3.0)
            while time.perf_counter() < end:
                idx = _order(job, n, rng, job.iodepth)
                p = r.pipeline(transaction=False)
                for i in idx.tolist():
                    p.get(i.to_bytes(8, "big")) if kind == "read" else p.set(i.to_bytes(8, "big"),
                                                                            val)
                t0 = time.perf_counter()
                p.execute()
                spent += time.perf_counter() - t0
                count += idx.size
            out[kind] = {"bw_bytes": int(count * job.bs / spent), "iops": count / spent}
        r.close()
        return out
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def baseline(job: Job) -> tuple[str, dict[str, Any] | None]:
    if job.tier == "nvme":
        return "fio", fio_baseline(job)
    if job.tier == "service":
        return "redis", redis_baseline(job)
    return "memcpy", memcpy_baseline(job)


# ---------------------------------------------------------------------- output

def _text(res: dict[str, Any], base: tuple[str, dict | None] | None) -> str:
    lines = [f"{res['jobname']}: (groupid=0): err={res['error']:>2}: "
             f"rw={res['job options']['rw']}, bs={res['job options']['bs']}, "
             f"iodepth={res['job options']['iodepth']}, tier={res['job options']['tier']}"]
    for d in ("read", "write"):
        r = res[d]
        if not r["total_ios"]:
            continue
        c = r["clat_ns"]
        ratio = ""
        if base and base[1] and base[1].get(d, {}).get("bw_bytes"):
            ratio = f"  ({r['bw_bytes'] / base[1][d]['bw_bytes']:.2f}x {base[0]})"
        lines.append(f"  {d}: IOPS={r['iops']:.0f}, BW={r['bw_bytes'] / 2**20:.1f}MiB/s "
                     f"({r['bw_bytes'] / 1e6:.1f}MB/s)({r['io_bytes'] / 2**20:.0f}MiB/"
                     f"{r['runtime']}msec){ratio}")
        lines.append(f"    clat (usec): min={c['min'] / 1e3:.1f}, max={c['max'] / 1e3:.1f}, "
                     f"avg={c['mean'] / 1e3:.2f}, stdev={c['stddev'] / 1e3:.2f}")
        pct = ", ".join(f"{float(k):g}th=[{v / 1e3:.1f}]" for k, v in c["percentile"].items()
                        if float(k) in (50.0, 90.0, 99.0, 99.9, 99.99))
        lines.append(f"    clat percentiles (usec): {pct}")
    kv = res["kvtier"]
    hr = kv["hit_ratio"]
    lines.append(f"  kvtier: hit ratio {'-' if hr is None else f'{hr:.3f}'}, "
                 f"NVMe write amplification {kv['nvme_write_amplification'] or '-'}")
    for tier, d in kv["tiers"].items():
        lines.append(f"    {tier}: " + ", ".join(f"{k}={v}" for k, v in d.items()))
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        for d in ("read", "write"):
            pct = r[d]["clat_ns"]["percentile"]
            if pct:
                xs = [v / 1e3 for v in pct.values()]
                a.plot(xs, [float(k) / 100 for k in pct], marker=".", label=f"{r['jobname']} {d}")
        tl = r["_timeline"]
        if tl:
            t = np.array([x[0] for x in tl])
            by = np.array([x[1] for x in tl])
            edges = np.arange(0, t.max() + 0.25, 0.25)
            sums, _ = np.histogram(t, bins=edges, weights=by)
            b.plot(edges[1:], sums / 0.25 / 1e6, label=r["jobname"])
    a.set_xscale("log")
    a.set_xlabel("completion latency per block (us)")
    a.set_ylabel("fraction")
    a.set_title("latency CDF")
    b.set_xlabel("time (s)")
    b.set_ylabel("MB/s")
    b.set_title("bandwidth over time")
    for ax in (a, b):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvtier bench", description=__doc__.splitlines()[0])
    ap.add_argument("jobfile", nargs="?", help="a fio job file ([global] + job sections)")
    for f in fields(Job):
        if f.name != "zipf":
            ap.add_argument(f"--{f.name}", default=None)
    ap.add_argument("--random_distribution", default=None)
    ap.add_argument("--rwmixwrite", default=None)
    ap.add_argument("--output-format", "--output_format", dest="fmt", default="normal",
                    choices=("normal", "json"))
    ap.add_argument("--compare", action="store_true", help="measure the baseline in this run")
    ap.add_argument("--plot", help="latency CDF and bandwidth-over-time PNG")
    args = ap.parse_args(argv)
    if args.jobfile:
        try:
            with open(args.jobfile, encoding="utf-8") as fh:
                jobs = parse_jobfile(fh.read())
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read job file {args.jobfile}: {exc}") from None
    else:
        jobs = [Job()]
    cli = {f.name: getattr(args, f.name) for f in fields(Job)
           if f.name != "zipf" and getattr(args, f.name) is not None}
    if args.random_distribution:
        cli["random_distribution"] = args.random_distribution
    if args.rwmixwrite is not None:
        cli["rwmixwrite"] = args.rwmixwrite
    jobs = [_apply_all(j, cli).validate() for j in jobs]
    from rich.progress import Progress
    results, bases = [], []
    load_before = os.getloadavg()       # a shared machine's load, reported beside the figures
    with Progress(disable=not sys.stderr.isatty(), transient=True) as prog:
        for job in jobs:
            task = prog.add_task(f"{job.name} {job.rw} {job.tier}", total=1.0)
            results.append(run_job(job, progress=lambda f, t=task: prog.update(t, completed=f)))
            bases.append(baseline(job) if args.compare else None)
    if args.plot:
        plot(results, args.plot)
    if args.fmt == "json":
        out = {"fio version": "kvtier-bench-1", "timestamp": int(time.time()), "jobs": [],
               "load_avg": {"before": load_before, "after": os.getloadavg()}}
        for r, b in zip(results, bases):
            r = {k: v for k, v in r.items() if not k.startswith("_")}
            if b:
                r["kvtier"]["baseline"] = {"name": b[0], "result": b[1]}
                for d in ("read", "write"):
                    base_bw = ((b[1] or {}).get(d) or {}).get("bw_bytes")
                    if base_bw and r[d]["total_ios"]:
                        r["kvtier"][f"ratio_{d}"] = round(r[d]["bw_bytes"] / base_bw, 4)
            out["jobs"].append(r)
        print(json.dumps(out))
    else:
        for r, b in zip(results, bases):
            print(_text(r, b))
    return 0


def _apply_all(job: Job, options: dict[str, str]) -> Job:
    for k, v in options.items():
        job = apply_option(job, k, v)
    return job


if __name__ == "__main__":
    sys.exit(main())
