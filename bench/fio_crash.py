"""Crash harness for begun puts (issue 17): SIGKILL a process whose puts are acknowledged by
their flush handles (Puts.commit_begin), restart on the same data directory, check every key.

    PYTHONPATH=. python bench/fio_crash.py --iterations 50 --json [--keys 64]

bench/crash.py kills the service, whose puts commit() and flush before they answer; this one
kills the path kvtier bench's lane uses: a write_through put's flush runs on the store's flush
thread while the writer goes on with gets, one put in flight, and a put is *acknowledged*
only when its handle completes. The child process prints each attempt (key, seed) before it
commits and each acknowledgement (key, version, seed) after its handle completed, flushed
line by line to a pipe the parent reads. After the kill the parent opens the data directory
itself and reads every key:

- acked_lost: a key whose last acknowledged put is not served, or is served at a lower
  version (or at that version with other bytes);
- wrong_served: a get, in the child during the load or in the parent after the restart, that
  returned bytes which were not some attempted put of that key (torn, stale, garbage).

Both must be zero. A small NVMe capacity (--nvme-capacity) keeps reclaims and checkpoints
running under the load. After each check the model restarts from what was served.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header  # noqa: E402

BB = 4096
PER_PUT = 8


def block_of(k: int, seed: int) -> np.ndarray:
    """A block that names its key and seed in its first 16 bytes; the rest follows from them."""
    b = np.random.default_rng([k, seed]).integers(0, 256, BB, dtype=np.uint8)
    b[:16] = np.frombuffer(k.to_bytes(8, "little") + seed.to_bytes(8, "little"), np.uint8)
    return b


def decode(k: int, data: np.ndarray) -> int | None:
    """The seed whose block these bytes are (for key k), or None when they are no such block."""
    kk = int.from_bytes(data[:8].tobytes(), "little")
    seed = int.from_bytes(data[8:16].tobytes(), "little")
    if kk != k or not np.array_equal(data, block_of(k, seed)):
        return None
    return seed


def key(i: int) -> bytes:
    return (i + 1).to_bytes(16, "big")


def settings(data_dir: str, nvme: str):
    from kvtier.config import make_settings
    return make_settings({"data_dir": data_dir, "host_capacity": f"{6 * PER_PUT * BB}",
                          "nvme_capacity": nvme, "segment_bytes": "1MiB",
                          "write_policy": "write_through", "checkpoint_interval": 0.2})


def child(data_dir: str, nvme: str, keyspace: int, base_seed: int) -> None:
    """The load: puts begun (one in flight) and gets; prints A, K and W lines. A get must
    serve the last committed put of each key (from memory while its flush runs)."""
    from kvtier.coherence.engine import Engine
    from kvtier.errors import KvtierError
    from kvtier.types import Tier
    eng = Engine(settings(data_dir, nvme))
    if "c" not in eng.namespaces:
        eng.create_namespace("c", BB)
    pool = eng.namespace("c").slots[Tier.HOST].pool
    rng = random.Random(base_seed)
    committed: dict[int, int] = {}               # key -> seed of its last committed put
    seed = base_seed
    pending = None
    out = sys.stdout

    def settle() -> None:
        nonlocal pending
        if pending is None:
            return
        (handle, ks, seeds, versions), pending = pending, None
        try:
            handle.wait()
        except KvtierError:
            return                               # refused: no promise made
        out.write("".join(f"K {k} {int(v)} {s}\n" for k, v, s in zip(ks, versions, seeds)))
        out.flush()

    while True:
        ks = rng.sample(range(keyspace), PER_PUT)
        if rng.random() < 0.5:
            settle()
            seeds = []
            for k in ks:
                seed += 1
                seeds.append(seed)
            out.write("".join(f"A {k} {s}\n" for k, s in zip(ks, seeds)))
            out.flush()
            try:
                res = eng.reserve("c", b"".join(key(k) for k in ks))
                pool.write(res.slots, np.stack([block_of(k, s) for k, s in zip(ks, seeds)]))
                versions, handle = eng.puts.commit_begin(res.rid)
            except KvtierError:
                continue
            committed.update(zip(ks, seeds))     # readers see it from here on
            pending = (handle, ks, seeds, versions)
        else:
            found, data = eng.read("c", b"".join(key(k) for k in ks))
            for i, k in enumerate(ks):
                if found[i]:
                    s = decode(k, data[i])
                    if s is None or (k in committed and s != committed[k]):
                        out.write(f"W {k}\n")
                        out.flush()
            if pending is not None and pending[0].done():
                settle()


def check(data_dir: str, nvme: str, acked: dict[int, tuple[int, int]],
          attempts: dict[int, set[int]]) -> tuple[int, int, dict[int, tuple[int, int]]]:
    """Reads every key back: (acked_lost, wrong_served, what was served by key)."""
    from kvtier.coherence.engine import Engine
    eng = Engine(settings(data_dir, nvme))
    lost = wrong = 0
    served: dict[int, tuple[int, int]] = {}
    try:
        if "c" not in eng.namespaces:
            return len(acked), 0, {}
        for k in sorted(set(acked) | set(attempts)):
            found, data = eng.read("c", key(k))
            entry = eng.entry("c", key(k)) if found[0] else None
            if not found[0] or entry is None:
                lost += k in acked
                continue
            s = decode(k, data[0])
            if s is None or s not in attempts.get(k, ()):
                wrong += 1
                continue
            v = int(entry["version"])
            if k in acked and (v < acked[k][0] or (v == acked[k][0] and s != acked[k][1])):
                lost += 1
            served[k] = (v, s)
    finally:
        eng.close(flush=False)
    return lost, wrong, served


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--keys", type=int, default=64)
    ap.add_argument("--nvme-capacity", default="3MiB")
    ap.add_argument("--min-run", type=float, default=0.3)
    ap.add_argument("--max-run", type=float, default=1.5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", nargs=2, metavar=("DIR", "SEED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.nvme_capacity, args.keys, int(args.child[1]))
        return 0
    m = header("fio_crash")
    rng = random.Random(int(time.time()))
    data_dir = tempfile.mkdtemp(prefix="kvtier-crash-fio-")
    acked: dict[int, tuple[int, int]] = {}        # key -> (version, seed) last acknowledged
    attempts: dict[int, set[int]] = {}
    totals = {"acked_lost": 0, "wrong_served": 0, "acks": 0, "attempts": 0, "restarts": 0,
              "child_errors": 0}
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for it in range(args.iterations):
        base = (it + 1) * 10**9
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", data_dir,
                                 str(base), "--keys", str(args.keys), "--nvme-capacity",
                                 args.nvme_capacity], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        time.sleep(rng.uniform(args.min_run, args.max_run) + 0.5)   # ~0.5 s to start up
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        reader.join(5)
        err = proc.stderr.read()
        if "Traceback" in err:
            totals["child_errors"] += 1
            print(err[-2000:], file=sys.stderr)
        for ln in lines:
            if not ln.endswith("\n"):
                continue                          # cut by the kill mid-line: never acted on
            f = ln.split()
            if f[0] == "A":
                attempts.setdefault(int(f[1]), set()).add(int(f[2]))
                totals["attempts"] += 1
            elif f[0] == "K":
                k, v, s = int(f[1]), int(f[2]), int(f[3])
                if k not in acked or acked[k][0] <= v:
                    acked[k] = (v, s)
                totals["acks"] += 1
            elif f[0] == "W":
                totals["wrong_served"] += 1
        lost, wrong, served = check(data_dir, args.nvme_capacity, acked, attempts)
        totals["acked_lost"] += lost
        totals["wrong_served"] += wrong
        totals["restarts"] += 1
        # The next round starts from what is on disk now.
        acked = dict(served)
        attempts = {k: {s} for k, (_, s) in served.items()}
    result = {"bench": "fio_crash", "machine": m, "iterations": args.iterations,
              "keys": args.keys, "nvme_capacity": args.nvme_capacity,
              "write_policy": "write_through", **totals}
    emit(result, args.json)
    return 0 if totals["acked_lost"] == 0 and totals["wrong_served"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
