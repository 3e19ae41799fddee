"""LMDB brought up to date lazily, and replayed from the segments' batch headers at restart.

Every append writes a batch header before its records (tiers.batchlog) holding, per record,
the key and the LMDB record (version, checksum, parent, size), so one fdatasync makes a
flush durable: bytes and index. A write_through put is acknowledged then. The LMDB side of
each flush, reclaim and delete (records put, records deleted) waits here, in order, and is
committed as one ordinary synced transaction at a checkpoint:

    - when ``checkpoint_interval`` seconds have passed since the last one (checked after every
      flush and by the service's housekeeping), or CHECKPOINT_RECORDS records wait;
    - before a reclaim deletes a segment file, and when a client deletes keys (their
      deletion is durable when delete returns, as before);
    - at close, and at the end of a restart's replay.

The same transaction writes, per segment, how far LMDB is known complete (``durable:<id>`` in
the meta database: the segment's size at the checkpoint; every append before it was synced).
At restart ``replay`` walks the batch headers past that mark in every format 3 segment, reads
their records and checks each against the checksum its header names (a header that reached
the disk before its records, a torn tail, never makes a record current), and the newest
version of each key that LMDB lacks or holds older is installed and committed. A key deleted
before the last checkpoint stays deleted: its batches lie before the marks. What a crash can
undo is only what waited here: an eviction's record deletion (the block comes back, with its
own bytes and version) or a reclaim's move (the old segment still exists: it is deleted only
after a checkpoint). LMDB itself keeps its own syncs, so a power loss leaves it at its last
checkpoint, never torn.

Every method is called with the NVMe store's writer held (coherence.persist), so no append
runs during a checkpoint and each segment's size is exactly what its synced batches cover.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from kvtier.checksums import block_checksums
from kvtier.pagetable.store import Catalog, record_dtype
from kvtier.tiers.batchlog import scan
from kvtier.tiers.nvme import ALIGN, SegmentLog, _aligned

log = logging.getLogger("kvtier.persist")
CHECKPOINT_RECORDS = 1 << 16   # LMDB at most this many records behind the log
_READ_BYTES = 64 << 20         # replay verifies records in reads of about this much


def entry_dtype(key_width: int) -> np.dtype:
    """One batch-header entry: the key and its LMDB record (segment and offset left zero:
    they follow from the entry's place in the batch)."""
    return np.dtype([("key", f"V{key_width}"), ("rec", record_dtype(key_width))])


def entries_of(keys: np.ndarray, records: np.ndarray) -> np.ndarray:
    out = np.zeros(len(keys), dtype=entry_dtype(keys.dtype.itemsize))
    out["key"], out["rec"] = keys, records
    out["rec"]["seg"], out["rec"]["off"] = 0, 0
    return out


class Journal:
    """The LMDB operations not yet committed, in order, and the checkpoint that commits them."""

    def __init__(self, catalog: Catalog, interval: float) -> None:
        self.catalog = catalog
        self.interval = interval          # seconds (settings.checkpoint_interval)
        self.ops: list[tuple[int, Any, np.ndarray | None]] = []
        self.waiting = 0                  # records in ops
        self.since = time.monotonic()
        self.checkpoints = 0

    def put(self, ns_id: int, keys: np.ndarray, records: np.ndarray) -> None:
        if len(keys):
            self.ops.append((ns_id, keys.copy(), records.copy()))
            self.waiting += len(keys)

    def delete(self, ns_id: int, keys: list[bytes]) -> None:
        if keys:
            self.ops.append((ns_id, list(keys), None))
            self.waiting += len(keys)

    def due(self) -> bool:
        return bool(self.ops) and (self.waiting >= CHECKPOINT_RECORDS
                                   or time.monotonic() - self.since >= self.interval)

    def checkpoint(self, logs: dict[int, SegmentLog]) -> None:
        """Commit every waiting operation and the marks of logs (by namespace id) in one
        synced LMDB transaction. Raises StorageError; the operations then stay waiting."""
        marks = {ns_id: lg.marks() for ns_id, lg in logs.items()}
        self.catalog.commit(self.ops, marks)
        self.ops, self.waiting = [], 0
        self.since = time.monotonic()
        self.checkpoints += 1


def replay(ns_id: int, key_width: int, block_bytes: int, lg: SegmentLog,
           marks: dict[int, int] | None) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """The records that batch headers past the marks name, verified against their bytes:
    (keys, records, counts), the newest version of each key (of equal versions, the later in
    the log). Segments whose walk stopped at a torn or damaged header take no more appends.
    counts: batches, records, torn (records whose bytes fail their header's checksum),
    bad_headers (walks stopped at a header with non-zero bytes that does not validate)."""
    dt = entry_dtype(key_width)
    rec = lg.record_bytes
    keys, recs, where = [], [], []
    counts = {"batches": 0, "records": 0, "torn": 0, "bad_headers": 0}
    buf = memoryview(_aligned(rec))
    for sid in sorted(lg.segments):
        seg = lg.segments[sid]
        if not seg.batched:
            continue                        # format 1 and 2: LMDB was committed per flush
        start = max(seg.start, (marks or {}).get(sid, seg.start))
        if start >= seg.size and not seg.recycled:
            continue
        found = scan(seg.fd, ns_id, sid, seg.nonce, start, seg.size, rec, buf)
        if seg.recycled:
            # Where its batch headers end is its size; the file's older life lies past it.
            seg.size = min(found.end, seg.size)
        elif found.problem is not None:
            seg.full = True                 # later appends go to a new segment, not past it
            if found.garbage:
                counts["bad_headers"] += 1
                log.warning("segment %s: %s; its %d bytes from there on are skipped (not a "
                            "kvtier batch: damage; `kvtier check` lists what it held)",
                            seg.path, found.problem, seg.size - found.end)
        for b in found.batches:
            counts["batches"] += 1
            if b.entry_bytes != dt.itemsize:
                if b.entry_bytes:
                    log.warning("segment %s: batch at %d has entries of %d bytes, not %d; "
                                "skipped", seg.path, b.offset, b.entry_bytes, dt.itemsize)
                continue
            e = b.entries.reshape(-1).view(dt)
            r = e["rec"].copy()
            r["seg"] = sid
            r["off"] = (b.data + np.arange(b.count, dtype=np.int64) * rec) // ALIGN
            keys.append(e["key"].copy())
            recs.append(r)
            where.append(np.full(b.count, sid, dtype=np.int64) * (1 << 40) + r["off"])
    if not keys:
        return np.empty(0, dtype=f"V{key_width}"), np.empty(0, dtype=record_dtype(key_width)), \
            counts
    k, r, w = np.concatenate(keys), np.concatenate(recs), np.concatenate(where)
    counts["records"] = int(k.size)
    ok = (r["size"] == block_bytes) & (r["version"] > 0) & _verified(lg, r, block_bytes)
    counts["torn"] = int((~ok).sum())
    k, r, w = k[ok], r[ok], w[ok]
    order = np.lexsort((w, r["version"]))          # by version, then place in the log
    k, r = k[order], r[order]
    _, last = np.unique(k[::-1], return_index=True)
    pick = np.sort(k.size - 1 - last)
    return k[pick], r[pick], counts


def _verified(lg: SegmentLog, r: np.ndarray, block_bytes: int) -> np.ndarray:
    """Per record: read back and hashed to the checksum its header names."""
    ok = np.zeros(r.size, dtype=bool)
    per = max(1, _READ_BYTES // block_bytes)
    buf = _aligned(min(per, max(r.size, 1)) * block_bytes)
    arr = np.frombuffer(buf, dtype=np.uint8, count=min(per, max(r.size, 1)) * block_bytes)
    for lo in range(0, r.size, per):
        part = r[lo: lo + per]
        n = part.size
        outs = [memoryview(buf)[i * block_bytes:(i + 1) * block_bytes] for i in range(n)]
        got = lg.read(part["seg"].astype(np.int32), part["off"], outs)
        sums = block_checksums(arr[: n * block_bytes].reshape(n, block_bytes))
        ok[lo: lo + n] = got & (sums == part["checksum"])
    return ok
