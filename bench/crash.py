"""Crash harness: SIGKILL a real `kvtier serve` under load, restart it, check every key.

    python bench/crash.py --iterations 200 --json [--clients 4] [--write-policy write_through]
    python bench/crash.py --recovery-entries 1000000 --json      # restart time at 1M entries
    python bench/crash.py --disk-full --iterations 50 --json     # data directory on a full disk

Each iteration: clients (threads, each its own kvtier.Client) run puts of new bytes to a small
key space (so most puts are rewrites), gets, and flushes. Every put's bytes are derived from a
fresh seed that is recorded before the put is sent (an *attempt*); its acknowledgement records
the version (an *ack*); a flush's acknowledgement makes every put acknowledged before the flush
was sent *durable* (under write_through, every ack is durable). At a random moment the service
is SIGKILLed, restarted on the same data directory, and every key is read back:

- acked_lost: a key whose last durable put is not served, or is served older than that put;
- wrong_served: any get, during the load or after the restart, that returned bytes which were
  not some attempted put of that key (torn, stale from another key, garbage) — also counted
  when the served version contradicts the bytes.

With --disk-full the data directory is a small tmpfs (--tmpfs-size, 8 MiB; mounting needs
root) under an nvme_capacity far above it, so appends meet ENOSPC: a put or flush may then be
refused (StorageError, counted as refused_puts / refused_flushes, never as acks), and what was
acknowledged must still be there after the kill.

With --deletes N each client also owns N keys of its own (no other client touches them, so
their order is the client's): some of its puts go there, and deletes of 1-4 of them, each
durable when it returns. A deleted key must stay missing until it is put again; served after
the restart with a version the delete had removed (no newer put acked), it counts as
resurrected, which must be 0 too (a reclaimed segment whose mark a checkpoint dropped once
brought deleted keys back with their oldest bytes: tests/test_journal.py).

recovery_s is from the restart's exec to the first answered get. Both must-be-zero figures are
checked by the harness itself (a mutation that acknowledges without flushing makes it report
losses: see RELIABILITY.md).

    python bench/crash.py --iterations 100 --damage --json

--damage: between the kill and the restart, damage the data directory for real, one of DAMAGE
per iteration (bit flips in segment records, a truncated or header-zeroed segment, a foreign
file named like a segment, a flipped key bit, garbage pages or a truncation in meta/data.mdb).
A restart the service refuses must exit 2 with a message and no traceback; `kvtier check
--repair` must then exit 0 and the next start must succeed. Damage loses blocks, so acked_lost
becomes lost_to_damage (reported, and those keys leave the model); what must stay zero is
wrong_served, crashes (an exit by signal, or a traceback) and unrepaired (no start even after
the repair).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
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


def block_of(key_id: int, seed: int) -> np.ndarray:
    return np.random.default_rng([key_id, seed]).integers(0, 256, BB, dtype=np.uint8)


def key(i: int) -> bytes:
    return (i + 1).to_bytes(16, "big")


class Model:
    """What was attempted, acknowledged and made durable, per key."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.attempts: dict[int, set[int]] = {}          # key -> seeds ever sent
        self.acked: dict[int, list[tuple[int, int, int]]] = {}   # key -> [(seq, version, seed)]
        self.durable: dict[int, tuple[int, int]] = {}    # key -> (version, seed)
        self.seq = 0
        self.wrong = 0
        self.by_bytes: dict[int, dict[bytes, int]] = {}  # key -> {block digest: seed}
        self.refusals = {"puts": 0, "flushes": 0}         # StorageError answers (disk full)
        self.missing = self.older = 0                     # acked_lost: not served / older
        self.floor: dict[int, int] = {}     # a deleted key: versions up to this were deleted
        self.resurrected = 0                # served at or below its floor after a restart
        self.deletes = 0

    def refused(self, what: str) -> None:
        with self.lock:
            self.refusals[what] += 1

    def attempt(self, k: int, seed: int, data: np.ndarray) -> None:
        import xxhash
        with self.lock:
            self.attempts.setdefault(k, set()).add(seed)
            self.by_bytes.setdefault(k, {})[xxhash.xxh3_128_digest(data)] = seed

    def ack(self, k: int, version: int, seed: int, durable: bool) -> None:
        with self.lock:
            self.seq += 1
            self.acked.setdefault(k, []).append((self.seq, version, seed))
            if durable and (k not in self.durable or self.durable[k][0] <= version):
                self.durable[k] = (version, seed)

    def deleting(self, ks: list[int]) -> dict[int, int]:
        """A delete is sent: until its acknowledgement the keys may be missing after a kill.
        Returns each key's highest version acknowledged so far (what the delete removes)."""
        with self.lock:
            top = {k: max([v for _q, v, _s in self.acked.pop(k, [])] +
                          [self.durable.pop(k, (0, 0))[0], self.floor.get(k, 0)]) for k in ks}
        return top

    def deleted(self, top: dict[int, int]) -> None:
        """An acknowledged delete of keys only this caller writes (so every put of them was
        acknowledged before it; top: deleting()'s): their versions so far are gone, durably."""
        with self.lock:
            self.deletes += 1
            for k, v in top.items():
                self.floor[k] = v

    def flush_sent(self) -> int:
        with self.lock:
            return self.seq

    def flush_acked(self, upto: int) -> None:
        with self.lock:
            for k, acks in self.acked.items():
                done = [a for a in acks if a[0] <= upto]
                if done:
                    _, v, s = max(done, key=lambda a: a[1])
                    if k not in self.durable or self.durable[k][0] <= v:
                        self.durable[k] = (v, s)

    def served(self, k: int, data: np.ndarray) -> int | None:
        """The seed whose bytes these are, or None (and a wrong_served) if none is."""
        import xxhash
        with self.lock:
            seed = self.by_bytes.get(k, {}).get(xxhash.xxh3_128_digest(data))
            if seed is None:
                self.wrong += 1
            return seed


def load(sock: str, model: Model, stop: threading.Event, keyspace: int, cid: int,
         write_back: bool, own: int = 0) -> None:
    import kvtier
    from kvtier.errors import KvtierError, StorageError
    rng = random.Random(cid * 7919 + int(time.time() * 1e6))
    try:
        c = kvtier.Client(sock, timeout=10, name=f"crash-{cid}")
        ns = c.namespace("crash", block_bytes=BB)
    except KvtierError:
        return
    try:
        mine = range(keyspace + cid * own, keyspace + (cid + 1) * own)   # --deletes
        while not stop.is_set():
            op = rng.random()
            ks = None
            if own and rng.random() < 0.15:      # this client's own keys
                ks = rng.sample(mine, rng.randint(1, 4))
                if rng.random() < 0.3:
                    top = model.deleting(ks)
                    ns.delete(b"".join(key(k) for k in ks))
                    model.deleted(top)
                    continue
                op = 0.0                           # a put of them
            if op < 0.55:
                ks = ks or rng.sample(range(keyspace), rng.randint(1, 8))
                seeds = [rng.getrandbits(48) for _ in ks]
                data = np.stack([block_of(k, s) for k, s in zip(ks, seeds)])
                for k, s, d in zip(ks, seeds, data):
                    model.attempt(k, s, d)
                try:
                    versions = ns.put(b"".join(key(k) for k in ks), data)
                except StorageError:
                    model.refused("puts")      # refused, not acknowledged: no promise made
                    continue
                for k, s, v in zip(ks, seeds, versions.tolist()):
                    model.ack(k, v, s, durable=not write_back)
            elif op < 0.95:
                ks = rng.sample(range(keyspace), rng.randint(1, 8))
                found, out = ns.get(b"".join(key(k) for k in ks))
                for k, f, d in zip(ks, found.tolist(), out):
                    if f:
                        model.served(k, d)
            else:
                upto = model.flush_sent()
                try:
                    c.flush()
                except StorageError:
                    model.refused("flushes")
                    continue
                model.flush_acked(upto)
    except KvtierError:
        pass          # the service was killed under us: expected
    finally:
        c.close()


def verify(sock: str, model: Model, keyspace: int) -> list[int]:
    """Read every key back (versions included; keyspace counts the clients' own keys too).
    Returns the keys acked and lost."""
    import kvtier
    lost: list[int] = []
    with kvtier.Client(sock, timeout=30) as c:
        ns = c.namespace("crash", block_bytes=BB)
        ids = list(range(keyspace))
        for lo in range(0, keyspace, 256):
            part = ids[lo:lo + 256]
            with ns.get_leased(b"".join(key(k) for k in part)) as lease:
                for k, f, v, view in zip(part, lease.found.tolist(), lease.versions.tolist(),
                                         lease.views):
                    want = model.durable.get(k)
                    if not f:
                        if want is not None:
                            lost.append(k)
                            model.missing += 1
                        continue
                    seed = model.served(k, np.array(view))
                    if want is None and v <= model.floor.get(k, 0):
                        model.resurrected += 1          # a deleted version came back
                    if want is not None and (v < want[0] or (v == want[0] and seed != want[1])):
                        lost.append(k)
                        model.older += 1
    return lost


DAMAGE = ("segment_bitflip", "segment_truncate", "segment_header_zeroed", "foreign_segment",
          "lmdb_key_flip", "lmdb_garbage_page", "lmdb_truncate")


def damage(data_dir: str, kind: str, rng: random.Random, keyspace: int) -> str:
    """Damage the stopped service's files for real; returns what was done."""
    segs = sorted(p for p in _walk(os.path.join(data_dir, "nvme")) if p.endswith(".kvt"))
    mdb = os.path.join(data_dir, "meta", "data.mdb")
    if kind.startswith("segment") and not segs:
        kind = "foreign_segment"
    if kind == "segment_bitflip":
        path = rng.choice(segs)
        size = os.path.getsize(path)
        if size <= 4096:
            return f"{kind}: {path} holds no record"
        with open(path, "r+b") as fh:
            for _ in range(rng.randint(1, 8)):
                at = rng.randrange(4096, size)
                fh.seek(at)
                b = fh.read(1)
                fh.seek(at)
                fh.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
        return f"{kind}: {path}"
    if kind == "segment_truncate":
        path = rng.choice(segs)
        os.truncate(path, rng.randrange(4096, max(4097, os.path.getsize(path))))
        return f"{kind}: {path}"
    if kind == "segment_header_zeroed":
        path = rng.choice(segs)
        with open(path, "r+b") as fh:
            fh.write(bytes(4096))
        return f"{kind}: {path}"
    if kind == "foreign_segment":
        nsdirs = [d for d in _walk(os.path.join(data_dir, "nvme"), dirs=True)] or \
            [os.path.join(data_dir, "nvme", "ns-1")]
        os.makedirs(nsdirs[0], exist_ok=True)
        path = os.path.join(nsdirs[0], "seg-99999999.kvt")
        with open(path, "wb") as fh:
            fh.write(rng.randbytes(rng.choice([100, 4096, 65536])))
        return f"{kind}: {path}"
    raw = bytearray(open(mdb, "rb").read())
    if kind == "lmdb_key_flip":
        hits = [raw.find(key(k)) for k in rng.sample(range(keyspace), min(keyspace, 64))]
        hits = [h for h in hits if h >= 0]
        if hits:
            at = rng.choice(hits) + rng.randrange(16)
            raw[at] ^= 1 << rng.randrange(8)
    elif kind == "lmdb_garbage_page":
        pages = len(raw) // 4096
        for _ in range(rng.randint(1, 3)):
            page = rng.randrange(2, max(3, pages))
            raw[page * 4096:(page + 1) * 4096] = rng.randbytes(4096)
    elif kind == "lmdb_truncate":
        raw = raw[:rng.randrange(2, max(3, len(raw) // 4096)) * 4096]
    with open(mdb, "wb") as fh:
        fh.write(bytes(raw))
    return f"{kind}: {mdb}"


def _walk(top: str, dirs: bool = False) -> list[str]:
    out = []
    for root, ds, fs in os.walk(top):
        out += [os.path.join(root, d) for d in ds] if dirs else [os.path.join(root, f) for f in fs]
    return out


def restart_damaged(svc, stats: dict) -> None:
    """Start after damage: a refusal must be clean and repaired by `kvtier check --repair`."""
    import subprocess
    try:
        svc.start()
        return
    except RuntimeError as exc:
        text = str(exc)
    if "exited with 2" not in text or "Traceback" in text:
        stats["crashes"] += 1
        stats.setdefault("crash_samples", []).append(text[-600:])
    stats["refused_starts"] += 1
    fix = subprocess.run([sys.executable, "-m", "kvtier.cli", "check", "--repair",
                          "--data-dir", str(svc.data_dir)], capture_output=True, text=True,
                         timeout=300)
    if fix.returncode != 0 or "Traceback" in fix.stderr:
        stats["crashes"] += 1
        stats.setdefault("crash_samples", []).append(fix.stderr[-600:])
    try:
        svc.start()
        stats["repaired"] += 1
    except RuntimeError as exc:
        stats["unrepaired"] += 1
        stats.setdefault("crash_samples", []).append(str(exc)[-600:])
        raise SystemExit(f"the service did not start after kvtier check --repair:\n{exc}")


def iteration(svc, model: Model, args: argparse.Namespace, rng: random.Random,
              stats: dict) -> tuple[int, float]:
    stop = threading.Event()
    threads = [threading.Thread(target=load, args=(str(svc.socket), model, stop, args.keys, i,
                                                   args.write_policy == "write_back",
                                                   args.deletes))
               for i in range(args.clients)]
    for t in threads:
        t.start()
    time.sleep(rng.uniform(0.05, args.max_run))
    svc.kill()
    stop.set()
    for t in threads:
        t.join()
    if args.damage:
        kind = rng.choice(DAMAGE)
        stats["by_kind"][kind] = stats["by_kind"].get(kind, 0) + 1
        damage(str(svc.data_dir), kind, rng, args.keys)
    t0 = time.perf_counter()
    if args.damage:
        restart_damaged(svc, stats)
    else:
        svc.start()
    import kvtier
    with kvtier.Client(svc.socket, timeout=30) as c:
        c.namespace("crash", block_bytes=BB).get(key(0))
    recovery = time.perf_counter() - t0
    lost_keys = verify(str(svc.socket), model, args.keys + args.clients * args.deletes)
    lost = len(lost_keys)
    if args.damage:
        with model.lock:                    # gone with the damage: no longer expected
            for k in lost_keys:
                model.durable.pop(k, None)
        if "Traceback" in svc.output():
            stats["crashes"] += 1
    # After a restart, what was served is what the model now knows as durable.
    with model.lock:
        for k in list(model.acked):
            model.acked[k] = []
    return lost, recovery


def mount_tmpfs(base: str, size: str) -> str:
    """A tmpfs of `size` under base, for --disk-full (a real file system that fills up)."""
    mnt = os.path.join(base, "tmpfs")
    os.makedirs(mnt)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mnt],
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"--disk-full: cannot mount a tmpfs at {mnt} ({r.stderr.strip()}); run as "
                 "root")
    return mnt


class _Peak(threading.Event):
    max_used = 0


def watch_disk(path: str) -> _Peak:
    """Sample the file system's used bytes every 20 ms until the returned event is set."""
    peak = _Peak()

    def run() -> None:
        while not peak.wait(0.02):
            peak.max_used = max(peak.max_used, shutil.disk_usage(path).used)
    threading.Thread(target=run, daemon=True).start()
    return peak


def recovery_at(entries: int, base: str) -> dict:
    """Fill a service with `entries` NVMe blocks, SIGKILL it, time the restart."""
    import kvtier
    from tests.service import Service
    svc = Service(os.path.join(base, "big"), admin=False, host_capacity="64MiB",
                  nvme_capacity=f"{entries * 4096 * 2 + (1 << 30)}", write_policy="write_back",
                  flush_interval=3600, segment_bytes="1GiB").start()
    data = np.zeros((1024, 512), dtype=np.uint8)
    with kvtier.Client(svc.socket, timeout=120) as c:
        ns = c.namespace("big", block_bytes=512)
        t0 = time.perf_counter()
        for lo in range(0, entries, 1024):
            n = min(1024, entries - lo)
            ns.put(b"".join(key(i) for i in range(lo, lo + n)), data[:n], verify=False)
            if (lo // 1024) % 64 == 63:
                c.flush()
        c.flush()
        fill_s = time.perf_counter() - t0
        nvme_blocks = c.stats()["tiers"]["nvme"]["blocks"]
    svc.kill()
    t0 = time.perf_counter()
    svc.start(timeout=120)
    with kvtier.Client(svc.socket, timeout=120) as c:
        found, _ = c.namespace("big").get(key(entries - 1))
    recovery = time.perf_counter() - t0
    svc.stop()
    return {"recovery_entries": nvme_blocks, "recovery_s_at_entries": round(recovery, 3),
            "fill_s": round(fill_s, 1), "last_key_served": bool(found[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--keys", type=int, default=None,
                    help="key space (512: 2 MiB of blocks)")
    ap.add_argument("--max-run", type=float, default=1.0, help="longest load before the kill, s")
    ap.add_argument("--write-policy", default="write_through",
                    choices=("write_through", "write_back"))
    ap.add_argument("--recovery-entries", type=int, default=0,
                    help="also time a restart with this many NVMe entries")
    ap.add_argument("--mutant", action="store_true",
                    help="self-test: run the service write_back while the model believes every "
                         "ack is durable; the harness must then report losses")
    ap.add_argument("--damage", action="store_true",
                    help="damage segments and LMDB between the kill and the restart")
    ap.add_argument("--disk-full", action="store_true",
                    help="the data directory on a small tmpfs far below nvme_capacity (root)")
    ap.add_argument("--tmpfs-size", default="8m", help="with --disk-full: the tmpfs's size")
    ap.add_argument("--checkpoint-interval", type=float, default=1.0,
                    help="the service's checkpoint_interval: how far LMDB may lag the log's "
                         "batch headers (a kill within it makes the restart replay them)")
    ap.add_argument("--deletes", type=int, default=0, metavar="N",
                    help="each client also puts and deletes N keys of its own (0: no deletes)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.keys is None:
        args.keys = 512
    m = header("bench/crash.py")
    from tests.service import Service
    base = tempfile.mkdtemp(prefix="kvtier-crash-", dir=os.getcwd())
    rng = random.Random(args.seed)
    model = Model()
    out: dict = {"iterations": 0, "acked_lost": 0, "wrong_served": 0, "clients": args.clients,
                 "keys": args.keys, "write_policy": args.write_policy, "mutant": args.mutant}
    recoveries = []
    stats: dict = {"by_kind": {}, "refused_starts": 0, "repaired": 0, "unrepaired": 0,
                   "crashes": 0}
    try:
        if args.iterations:
            policy = "write_back" if args.mutant else args.write_policy
            data_dir, extra = os.path.join(base, "svc"), {"segment_bytes": "4MiB"}
            if args.disk_full:
                # The data directory is the tmpfs (the service's log stays beside it, off the
                # full disk); dead records pile up (no compaction threshold) until
                # the disk is full.
                data_dir = mount_tmpfs(base, args.tmpfs_size)
                extra = {"segment_bytes": "1MiB", "compact_threshold": 0.0}
                out.update(disk_full=True, tmpfs_size=args.tmpfs_size)
            peak = watch_disk(data_dir) if args.disk_full else None
            svc = Service(data_dir, admin=False, host_capacity="2MiB",
                          nvme_capacity="256MiB", write_policy=policy,
                          flush_interval=3600 if args.mutant else 0.2,
                          checkpoint_interval=args.checkpoint_interval, **extra).start()
            for _ in range(args.iterations):
                lost, rec = iteration(svc, model, args, rng, stats)
                out["iterations"] += 1
                out["lost_to_damage" if args.damage else "acked_lost"] = \
                    out.get("lost_to_damage" if args.damage else "acked_lost", 0) + lost
                recoveries.append(rec)
            if args.damage:
                out["damage"] = stats
                del out["acked_lost"]           # damage loses blocks: see lost_to_damage
            # Runs that found the disk smaller than nvme_capacity (each logs it once).
            out["disk_full_events"] = svc.output().count("the NVMe tier holds what the disk does")
            # Restarts that found acknowledged records only in batch headers, and replayed them.
            replays = [int(x) for x in re.findall(r"replayed \d+ batches \((\d+) records\)",
                                                  svc.output())]
            out["checkpoint_interval_s"] = args.checkpoint_interval
            out["restarts_replaying"], out["records_replayed"] = len(replays), sum(replays)
            if peak is not None:
                peak.set()
                out["max_disk_used_bytes"] = peak.max_used
            svc.stop(signal.SIGTERM)
            out["wrong_served"] = model.wrong
            out["refused_puts"] = model.refusals["puts"]
            out["refused_flushes"] = model.refusals["flushes"]
            out["acked_missing"], out["acked_older"] = model.missing, model.older
            out["max_recovery_s"] = round(max(recoveries), 3)
            out["median_recovery_s"] = round(float(np.median(recoveries)), 3)
            out["acked_puts_checked"] = len(model.durable)
            if args.deletes:
                out["deletes"], out["resurrected"] = model.deletes, model.resurrected
        if args.recovery_entries:
            out.update(recovery_at(args.recovery_entries, base))
    finally:
        if args.disk_full:
            subprocess.run(["umount", "-l", os.path.join(base, "tmpfs")], check=False)
        shutil.rmtree(base, ignore_errors=True)
    out["machine"] = m
    emit(out, args.json)
    if (out.get("acked_lost") or out["wrong_served"] or out.get("resurrected")
            or stats["crashes"] or stats["unrepaired"]) \
            and not args.mutant:
        sys.exit(1)


if __name__ == "__main__":
    main()
