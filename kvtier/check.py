"""`kvtier check --data-dir D [--repair] [--json]`: offline consistency of LMDB and the segments.

For every namespace in LMDB, every NVMe record is checked: its segment exists and has a valid
header, the record lies inside the segment's written length, its bytes hash (xxh3-64) to the
checksum LMDB holds, and the record still binds to its namespace and key (store.bindings: a
flipped key bit is caught). Damage is listed record by record. With --repair the damaged
records are moved to LMDB's quarantine database (their blocks are lost to the service; a
restart would drop them on first read anyway) and segment files that no record points to are
removed. A sound record is never touched. Records that only the segments' batch headers name
(a crash came before LMDB's checkpoint: coherence.journal) are counted as ``unreplayed`` and
their segments are in use: the service replays them at its next start.

Run it with the service stopped: it opens LMDB for writing only with --repair.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from kvtier.coherence.journal import replay
from kvtier.errors import DataDirError, KvtierError
from kvtier.pagetable.store import Catalog, CatalogDamaged, lock_data_dir
from kvtier.tiers.nvme import ALIGN, SegmentLog, _aligned

BATCH = 256


@dataclass(slots=True)
class Report:
    namespaces: int = 0
    records: int = 0
    sound: int = 0
    damage: list[dict[str, Any]] = field(default_factory=list)
    orphan_segments: list[str] = field(default_factory=list)
    foreign_files: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)     # moved under quarantine/
    repaired: int = 0
    removed_segments: int = 0
    unreplayed: int = 0      # records only batch headers name yet (replayed at the next start)

    def as_dict(self) -> dict[str, Any]:
        kinds = Counter(d["problem"] for d in self.damage)
        return {"namespaces": self.namespaces, "records": self.records, "sound": self.sound,
                "damaged": len(self.damage), "by_problem": dict(kinds), "damage": self.damage,
                "orphan_segments": self.orphan_segments, "foreign_files": self.foreign_files,
                "quarantined": self.quarantined,
                "repaired": self.repaired,
                "removed_segments": self.removed_segments, "unreplayed": self.unreplayed}


def check(data_dir: str | Path, repair: bool = False) -> Report:
    data_dir = Path(data_dir)
    if not (data_dir / "meta").is_dir():
        raise DataDirError(f"{data_dir} has no meta/ directory: not a kvtier data directory")
    # a repair beside a live service would quarantine segments it is writing
    lock = lock_data_dir(data_dir, "kvtier check --repair") if repair else None
    try:
        return _check(data_dir, repair)
    except CatalogDamaged as exc:
        if not repair:
            raise
        # The index is lost: nothing in the segments says which key a record holds. Move the
        # LMDB files and every segment aside, so that the service starts empty and nothing is
        # deleted (an operator may still restore meta/ from a backup and move them back).
        rep = Report()
        rep.damage.append({"namespace": None, "key": None, "problem": "lmdb",
                           "detail": str(exc)})
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for name in ("data.mdb", "lock.mdb"):
            if (data_dir / "meta" / name).exists():
                rep.quarantined.append(str(_quarantine(data_dir, data_dir / "meta" / name,
                                                       stamp)))
        for nsdir in sorted((data_dir / "nvme").glob("ns-*")):
            rep.quarantined.append(str(_quarantine(data_dir, nsdir, stamp)))
        rep.repaired += 1
        return rep
    finally:
        if lock is not None:
            os.close(lock)


def _quarantine(data_dir: Path, path: Path, stamp: str) -> Path:
    """Move path to <data_dir>/quarantine/<stamp>/<its relative path>; never delete it."""
    dest = data_dir / "quarantine" / stamp / path.relative_to(data_dir)
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.rename(path, dest)
    return dest


def _check(data_dir: Path, repair: bool) -> Report:
    cat = Catalog(data_dir / "meta")
    rep = Report()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        namespaces = cat.namespaces()
        for raw_name, why in cat.damaged.items():
            rep.damage.append({"namespace": raw_name.decode("utf-8", "backslashreplace"),
                               "key": None, "problem": "namespace_record", "detail": why})
            if repair:
                cat.quarantine_namespace(raw_name)     # moved aside in LMDB, not deleted
                rep.repaired += 1
        for ns in namespaces:
            rep.namespaces += 1
            nsdir = data_dir / "nvme" / f"ns-{ns.ns_id}"
            keys, recs, skipped = cat.load_checked(ns.ns_id, ns.key_width)
            rep.records += len(keys) + len(skipped)
            bad_keys: list[bytes] = [k for k, _problem in skipped]
            for k, problem in skipped:
                # "binding": the record no longer names the key it was written for (a flipped
                # key bit would serve another key's block under it)
                rep.damage.append({"namespace": ns.name, "key": k.hex(), "problem": problem})
            # readonly: a file that is not one of our segments is listed, never deleted, and
            # the records that point into it count as missing_segment.
            log = SegmentLog(nsdir, ns.ns_id, ns.block_bytes, 1 << 40, io_threads=4,
                             readonly=True)
            for path in log.foreign:
                rep.foreign_files.append(str(path))
                if repair:
                    # the service refuses to start beside it; records pointing into it are
                    # missing_segment below and quarantined with the rest
                    rep.quarantined.append(str(_quarantine(data_dir, path, stamp)))
            used = _check_records(ns.name, ns.block_bytes, log, keys, recs, rep, bad_keys)
            # Records that batch headers past LMDB's last checkpoint name (a crash came before
            # it) are the service's to replay at its next start: their segments are in use.
            _rk, pending, _ = replay(ns.ns_id, ns.key_width, ns.block_bytes, log,
                                     cat.marks(ns.ns_id))
            rep.unreplayed += int(pending.size)
            used.update(int(x) for x in np.unique(pending["seg"]).tolist())
            for sid, seg in sorted(log.segments.items()):
                if sid not in used:
                    rep.orphan_segments.append(str(seg.path))
            if repair:
                for sid in [s for s in log.segments if s not in used]:
                    log.remove(sid)
                    rep.removed_segments += 1
            log.close()
            if repair and bad_keys:
                cat.quarantine_records(ns.ns_id, bad_keys)
                rep.repaired += len(bad_keys)
    finally:
        cat.close()
    return rep


def _check_records(name: str, block_bytes: int, log: SegmentLog, keys: np.ndarray,
                   recs: np.ndarray, rep: Report, bad_keys: list[bytes]) -> set[int]:
    used: set[int] = set()
    buf = _aligned(BATCH * block_bytes)
    # (the buffer is rounded up to 4 KiB: take only the blocks, whatever their size)
    arr = np.frombuffer(buf, dtype=np.uint8, count=BATCH * block_bytes).reshape(BATCH,
                                                                                block_bytes)
    views = [memoryview(buf)[i * block_bytes:(i + 1) * block_bytes] for i in range(BATCH)]
    for lo in range(0, len(keys), BATCH):
        k, r = keys[lo: lo + BATCH], recs[lo: lo + BATCH]
        n = len(k)
        segs = r["seg"].astype(np.int32)
        offs = r["off"]
        ok = np.ones(n, dtype=bool)
        problems = [""] * n
        for i in range(n):
            sid, start = int(segs[i]), int(offs[i]) * ALIGN
            seg = log.segments.get(sid)
            if r["size"][i] != block_bytes or r["version"][i] == 0:
                ok[i], problems[i] = False, "bad_record"
            elif seg is None:
                ok[i], problems[i] = False, "missing_segment"
            elif not seg.holds(start, log.record_bytes):
                ok[i], problems[i] = False, "truncated"
        idx = np.flatnonzero(ok)
        if idx.size:
            got = log.read(segs[idx], offs[idx], [views[j] for j in range(idx.size)])
            for j, i in enumerate(idx.tolist()):
                if not got[j]:
                    ok[i], problems[i] = False, "unreadable"
                elif xxhash.xxh3_64_intdigest(arr[j]) != int(r["checksum"][i]):
                    ok[i], problems[i] = False, "checksum"
        for i in range(n):
            if ok[i]:
                rep.sound += 1
                used.add(int(segs[i]))
            else:
                rep.damage.append({"namespace": name, "key": bytes(k[i]).hex(),
                                   "problem": problems[i], "segment": int(segs[i]),
                                   "offset": int(offs[i]) * ALIGN,
                                   "version": int(r["version"][i])})
                bad_keys.append(bytes(k[i]))
    return used


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvtier check", description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--repair", action="store_true",
                    help="delete damaged records and unreferenced segments")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        rep = check(args.data_dir, args.repair)
    except KvtierError as exc:
        print(f"kvtier check: error: {exc}", file=sys.stderr)
        return 2
    d = rep.as_dict()
    if args.json:
        print(json.dumps(d))
    else:
        print(f"{d['namespaces']} namespaces, {d['records']} records: {d['sound']} sound, "
              f"{d['damaged']} damaged {d['by_problem'] or ''}")
        for item in d["damage"][:50]:
            print(f"  {item['namespace']} {item['key']}: {item['problem']}")
        if len(d["damage"]) > 50:
            print(f"  ... {len(d['damage']) - 50} more (--json lists all)")
        for path in d["foreign_files"]:
            print(f"  not a segment of this namespace: {path}"
                  + (" (moved to quarantine/)" if args.repair else " (--repair moves it aside)"))
        for path in d["quarantined"]:
            print(f"  moved aside: {path}")
        if d["orphan_segments"]:
            print(f"{len(d['orphan_segments'])} segment files hold no live record"
                  + (" (removed)" if args.repair else " (--repair removes them)"))
        if args.repair:
            print(f"repaired: {d['repaired']} records dropped")
    return 1 if d["damaged"] and not args.repair else 0


if __name__ == "__main__":
    sys.exit(main())
