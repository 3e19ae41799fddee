"""The NVMe side of coherence: flush, copy-on-read and restart, as one object.

``NvmeStore`` owns every namespace's segment log and its LMDB records. It sees the engine only
through ``Coherence`` (the engine lock, the namespaces, and five narrow calls), and it never
does disk I/O under the engine lock. Each operation runs in three steps:

    1. decide, under the engine lock: pick rows, capture (key, version, checksum, location),
       pin the host slots to be written and the segments to be read;
    2. the I/O, unlocked: segment appends and reads, fdatasync, the LMDB transaction;
    3. apply, under the engine lock, with versions checked: a row whose key or version moved
       while its I/O was in flight is not installed (a rewritten block's old bytes are never
       made current; a deleted key's record is deleted again).

Writers (flushes, reclaims, record deletes) take ``writer`` first and one at a time, so that the
LMDB records of a key change in version order; the engine lock is only ever taken inside it.
The flush pipeline is coherence.flushes (``Flushes``: group commit, and each batch written under
``writer``, synced after it is released, beside the next batch's writes, and applied in the
order written, by ticket). Reclaims, checkpoints and record deletes first settle() every flush
in flight.

Flush order, per batch (the crash-safety argument rests on it):

    1. pick DIRTY rows, oldest version first (log-structured)
    2. append their current bytes behind a batch header that names each record's key ->
       (size, version, checksum, parent), and fdatasync the segments (the writer released;
       a later batch's sync also covers every batch written before it)
    3. queue the LMDB records (coherence.journal: committed at the next checkpoint, and
       replayed from the batch headers after a crash)
    4. only then mark the rows CLEAN and the old NVMe records dead

A crash before 2's fdatasync leaves unreferenced bytes at the log's tail (dead space, reclaimed
later; a header that reached the disk without its records names checksums they fail, so
replay skips them); a crash after it loses nothing that was acknowledged as flushed. Room for
a batch comes from coherence.space (whole-segment reclaim, headroom, the disk's real size).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from kvtier.checksums import block_checksums
from kvtier.coherence.flushes import FlushHandle, Flushes
from kvtier.coherence.journal import Journal, entry_dtype, replay
from kvtier.coherence.namespace import EngineCounters
from kvtier.coherence.records import same_key
from kvtier.coherence.space import SMALL_SEGMENTS, Space
from kvtier.coherence.states import BlockState
from kvtier.config import Settings
from kvtier.errors import StorageError
from kvtier.pagetable.store import FLAG_PARENT, Catalog, NamespaceRecord
from kvtier.tiers.host import SlotPool
from kvtier.tiers.nvme import Backend, Segment, SegmentLog, data_start, round_up
from kvtier.types import Tier

try:
    from kvtier.coherence._gets import plan_columns as _plan_columns
except ImportError:             # not built: plan_read's numpy gathers
    _plan_columns = None

if TYPE_CHECKING:
    from kvtier.coherence.namespace import Namespace

log = logging.getLogger("kvtier.persist")


class Coherence(Protocol):
    """What the NVMe store needs of the engine."""

    lock: threading.RLock
    namespaces: dict[str, "Namespace"]
    clock: int                   # the page table's access clock (last_access is on it)

    def drop_copies(self, ns: "Namespace", rows: np.ndarray, tier: Tier) -> None: ...
    def forget_empty(self, ns: "Namespace", rows: np.ndarray) -> None: ...
    def pin_slots(self, ns: "Namespace", tier: Tier, slots: np.ndarray) -> None: ...
    def unpin_slots(self, ns: "Namespace", tier: Tier, slots: np.ndarray) -> None: ...


@dataclass(slots=True)
class ReadPlan:
    """NVMe records to copy into pinned slots, decided under the lock, read without it."""

    ns: "Namespace"
    rows: np.ndarray
    keys: np.ndarray
    versions: np.ndarray
    sums: np.ndarray
    segs: np.ndarray
    offs: np.ndarray
    dst: np.ndarray
    pins: list[Segment]
    ok: np.ndarray | None = None
    drop_keys: list[bytes] = field(default_factory=list)


class NvmeStore:
    """Segment logs and LMDB records of every namespace of one engine."""

    def __init__(self, owner: Coherence, catalog: Catalog, settings: Settings,
                 counters: EngineCounters, backend: Backend) -> None:
        self.owner = owner
        self.catalog = catalog
        self.settings = settings
        self.counters = counters
        self.backend = backend
        self.capacity = settings.nvme_capacity
        self.writer = threading.Lock()
        self._wanted: dict[str, list[np.ndarray]] = {}
        self.space = Space(self)
        self.journal = Journal(catalog, settings.checkpoint_interval)
        self.flushes = Flushes(self)

    # ------------------------------------------------------------------ logs

    def segment_bytes(self, block_bytes: int) -> int:
        """A namespace's segment size: segment_bytes, or a ninth of a small capacity, so that
        the headroom (one segment) stays a small part of the tier."""
        rec = round_up(block_bytes)
        # At least a batch header and three records: a reclaim that copies half a segment's
        # records forward then still frees a record's room.
        small = max(self.capacity // SMALL_SEGMENTS // 4096 * 4096, data_start(rec) + 4 * rec)
        return min(self.settings.segment_bytes, small)

    def open_log(self, rec: NamespaceRecord) -> SegmentLog | None:
        if self.capacity <= 0:
            return None
        s = self.settings
        return SegmentLog(Path(s.data_dir) / "nvme" / f"ns-{rec.ns_id}", rec.ns_id,
                          rec.block_bytes, self.segment_bytes(rec.block_bytes), s.io_threads,
                          self.backend, index_bytes=entry_dtype(rec.key_width).itemsize)

    def logs(self) -> list[SegmentLog]:
        return [ns.log for ns in self.owner.namespaces.values() if ns.log is not None]

    def used_bytes(self) -> int:
        """Bytes of segment files on disk, all namespaces."""
        return sum(lg.total_bytes() for lg in self.logs())

    def headroom(self) -> int:
        return max((lg.segment_bytes for lg in self.logs()), default=0)

    # ------------------------------------------------------------------ flush

    def write_down(self, ns: "Namespace", rows: np.ndarray) -> None:
        """Eviction asks for rows to be written to NVMe; the caller holds the engine lock, so
        the write waits for drain(), which the engine runs once the lock is released."""
        if ns.log is not None and rows.size:
            self._wanted.setdefault(ns.name, []).append(np.asarray(rows, dtype=np.int64))

    def wanted(self) -> bool:
        return bool(self._wanted)

    def busy(self) -> bool:
        """A flush or reclaim is in flight (its host slots may be pinned)."""
        return self.writer.locked() or self.in_flight() > 0

    def in_flight(self) -> int:
        """Batches written whose sync or apply is not done yet."""
        return self.flushes.in_flight()

    def wait(self) -> None:
        """Until the writes in flight are done. Unlocked."""
        with self.writer:
            self.settle()

    def settle(self) -> None:
        """(writer held) Until every batch written so far is synced and applied. Reclaims,
        checkpoints and record deletes call it first: a checkpoint's marks are the segments'
        sizes (a mark past a batch not yet in the journal would hide it from the replay), a
        reclaim moves the records that rows point at, and a delete must come after the puts
        of its key. No new batch can start meanwhile: that takes the writer."""
        self.flushes.settle()

    def drain(self) -> int:
        """Run the write-downs eviction asked for, unlocked: every dirty block of those
        namespaces goes (one batch, as a background flush would write them, so that the next
        reservations of other clients find clean blocks to evict too)."""
        done = 0
        while self._wanted:
            name, _rows = self._wanted.popitem()
            ns = self.owner.namespaces.get(name)
            if ns is not None:
                done += self.flush(ns, None)
        return done

    def flush(self, ns: "Namespace", rows: np.ndarray | None = None,
              strict: bool = False) -> int:
        """Write the DIRTY rows among ``rows`` (all of ns's when None) and return how many of
        them reached NVMe, once they are durable (coherence.flushes: group commit, the sync
        beside the next batch's writes). Unlocked. strict=False (background flushes,
        write-downs): NVMe full or failing leaves the rows dirty and counts ``nvme_full``;
        strict=True (a write_through put, an explicit flush): StorageError unless every row
        of this call that was picked was written."""
        return self.flushes.flush(ns, rows, strict)

    def begin(self, ns: "Namespace", rows: np.ndarray | None = None, strict: bool = False,
              on_done: Callable[[], None] | None = None) -> FlushHandle:
        """flush() on the store's flush thread: returns a handle at once, complete when that
        flush returns (durable and applied, or its error), after on_done has run. Unlocked;
        never wait for the handle holding the engine lock or the writer."""
        return self.flushes.begin(ns, rows, strict, on_done)

    def set_nvme(self, ns: "Namespace", rows: np.ndarray, segs: np.ndarray,
                  offs: np.ndarray, versions: np.ndarray, sums: np.ndarray) -> None:
        """Under the lock: rows' NVMe copies are now (segs, offs) at versions, with sums."""
        cols = ns.table.cols
        old = rows[cols["copy_ver"][rows, Tier.NVME] > 0]
        old_segs = cols["slot"][old, Tier.NVME]
        cols["slot"][rows, Tier.NVME] = segs
        cols["nvme_off"][rows] = offs
        cols["copy_ver"][rows, Tier.NVME] = versions
        cols["nvme_checksum"][rows] = sums
        self.nvme_moved(ns, old_segs, rows, segs)

    def nvme_moved(self, ns: "Namespace", old_segs: np.ndarray, rows: np.ndarray,
                   segs: np.ndarray) -> None:
        """Under the lock, after rows' NVMe columns were set (set_nvme, or the flush's C
        apply): the records they held before (in old_segs) are dead, the new ones (in segs)
        live, and each segment's Members know their rows."""
        ns.log.add_live(old_segs, -1)
        ns.log.add_live(segs, +1)
        self.space.members_of(ns).add(np.asarray(rows, dtype=np.int64),
                                      np.asarray(segs, dtype=np.int64), self.owner.clock)

    def forget(self, ns: "Namespace", rows: np.ndarray) -> list[bytes]:
        """Under the lock: forget rows' NVMe copies (dead bytes in their segments). Returns
        their keys, whose LMDB records the caller deletes with delete_records() once the
        lock is released."""
        if ns.log is None:
            return []
        cols = ns.table.cols
        rows = rows[cols["copy_ver"][rows, Tier.NVME] > 0]
        if rows.size == 0:
            return []
        ns.log.add_live(cols["slot"][rows, Tier.NVME], -1)
        cols["copy_ver"][rows, Tier.NVME] = 0
        cols["slot"][rows, Tier.NVME] = -1
        cols["nvme_checksum"][rows] = 0
        return [bytes(k) for k in cols["key"][rows]]

    def delete_records(self, ns: "Namespace", keys: list[bytes]) -> None:
        """Delete the LMDB records of keys that no row holds an NVMe copy of, durably (a
        checkpoint: a replay never brings a deleted key back). Unlocked."""
        if keys and ns.log is not None:
            with self.writer:
                self.settle()
                self.delete_now(ns, keys)
                self.checkpoint(strict=True)

    def delete_now(self, ns: "Namespace", keys: list[bytes]) -> None:
        """delete_records with the writer held, queued for the next checkpoint: no record
        can be written in between."""
        if not keys:
            return
        with self.owner.lock:
            karr = ns.table.keys_array(b"".join(keys))
            rows = ns.table.lookup(karr)
            gone = rows < 0
            gone[~gone] = ns.table.cols["copy_ver"][rows[~gone], Tier.NVME] == 0
        self.journal.delete(ns.ns_id, [k for k, g in zip(keys, gone.tolist()) if g])

    def checkpoint(self, strict: bool = True) -> None:
        """Commit the journal's waiting LMDB operations and every log's marks (writer held).
        strict=False: a failure is logged and they stay waiting (the batch headers hold them;
        the next checkpoint tries again)."""
        try:
            self.journal.checkpoint({ns.ns_id: ns.log for ns in
                                     list(self.owner.namespaces.values())
                                     if ns.log is not None})
        except StorageError as exc:
            if strict:
                raise
            log.warning("LMDB checkpoint failed (%s); %d record operations wait for the next "
                        "(the segments' batch headers hold them)", exc, self.journal.waiting)

    def tick(self) -> None:
        """A checkpoint when one is due and no writer is busy (the service's housekeeping, so
        that LMDB catches up when flushes stop). Unlocked."""
        if self.journal.due() and self.writer.acquire(blocking=False):
            try:
                self.settle()
                self.checkpoint(strict=False)
            finally:
                self.writer.release()

    def drop_bad(self, ns: "Namespace", rows: np.ndarray, keys: np.ndarray,
                  versions: np.ndarray) -> list[bytes]:
        """Under the lock: records that could not be read or failed their checksum are
        dropped from NVMe (their rows fall back or go) and counted. Returns their keys, for
        delete_records()."""
        if rows.size == 0:
            return []
        cols = ns.table.cols
        same = same_key(ns, rows, keys)
        same[same] = cols["copy_ver"][rows[same], Tier.NVME] == versions[same]
        bad = rows[same]
        if bad.size == 0:
            return []
        self.counters.checksum_failures += int(bad.size)
        log.error("%d NVMe records of %s failed their checksum or could not be read; dropped",
                  bad.size, ns.name)
        out = self.forget(ns, bad)
        self.owner.forget_empty(ns, bad)
        return out

    # ------------------------------------------------------------------ reads

    def plan_read(self, ns: "Namespace", rows: np.ndarray, dst: np.ndarray) -> ReadPlan:
        """Under the lock: copy-on-read of rows' NVMe copies into the (pinned) slots dst,
        their segments pinned until run_read() is done."""
        cols = ns.table.cols
        if _plan_columns is not None and rows.dtype == np.int64:
            # The six gathers and the distinct segments to pin in one C call
            # (coherence/_gets.c; issue 17, stall5: ~40 us of a ~170 us decide, dev VM).
            n = rows.size
            segs, keys = np.empty(n, dtype=np.int32), np.empty(n, dtype=cols["key"].dtype)
            vers, sums = np.empty(n, dtype=np.uint64), np.empty(n, dtype=np.uint64)
            offs, ids = np.empty(n, dtype=np.uint32), np.empty(n, dtype=np.int64)
            k = _plan_columns(cols["slot"], cols["key"], cols["copy_ver"], cols["nvme_checksum"],
                              cols["nvme_off"], np.ascontiguousarray(rows), int(Tier.NVME),
                              segs, keys, vers, sums, offs, ids)
            return ReadPlan(ns, rows.copy(), keys, vers, sums, segs, offs, dst.copy(),
                            ns.log.pin(ids[:k], distinct=True))
        segs = cols["slot"][rows, Tier.NVME].copy()
        return ReadPlan(ns, rows.copy(), cols["key"][rows].copy(),
                        cols["copy_ver"][rows, Tier.NVME].copy(),
                        cols["nvme_checksum"][rows].copy(), segs, cols["nvme_off"][rows].copy(),
                        dst.copy(), ns.log.pin(segs))

    def run_read(self, plan: ReadPlan, pool: SlotPool) -> None:
        """The read, unlocked: records into their slots, checksums verified (plan.ok)."""
        try:
            # Straight into the slots with the GIL released (read_rows); the general read()
            # where that path does not apply (padded records, no AIO).
            ok = plan.ns.log.read_rows(plan.segs, plan.offs, pool.array, plan.dst)
            if ok is None:
                outs = [pool.slot_view(int(s)) for s in plan.dst.tolist()]
                ok = plan.ns.log.read(plan.segs, plan.offs, outs)
            sums = np.zeros(plan.rows.size, dtype=np.uint64)
            sums[ok] = block_checksums(pool.array, plan.dst[ok], release_gil=True)
            plan.ok = ok & (sums == plan.sums)
        finally:
            plan.ns.log.unpin(plan.pins)
            plan.pins = []

    def finish_read(self, plan: ReadPlan) -> np.ndarray:
        """Under the lock: which of plan's copies may be installed: read and verified, and
        their row still at the version that was read (a block rewritten or deleted while its
        read was in flight is not installed). Bad records are dropped (plan.drop_keys)."""
        if plan.ok is None:                 # the read itself raised: nothing learnt, nothing kept
            return np.zeros(plan.rows.size, dtype=bool)
        ok = plan.ok
        plan.drop_keys = self.drop_bad(plan.ns, plan.rows[~ok], plan.keys[~ok],
                                        plan.versions[~ok])
        valid = ok & same_key(plan.ns, plan.rows, plan.keys)
        cols = plan.ns.table.cols
        valid[valid] = cols["version"][plan.rows[valid]] == plan.versions[valid]
        return valid

    def after_read(self, plan: ReadPlan) -> None:
        """Unlocked, after finish_read: delete the records of blocks that failed."""
        self.delete_records(plan.ns, plan.drop_keys)

    # ------------------------------------------------------------------ restart

    def load(self, ns: "Namespace") -> int:
        """Restart: rebuild ns's rows from LMDB, then replay the batch headers past LMDB's
        marks (coherence.journal) and commit what they add. Returns the rows loaded.

        Records pointing outside their segment (a truncated or missing file) are dropped from
        LMDB and counted. LMDB's records are verified on first read; replayed ones are read
        and verified now (only what the last checkpoint had not committed: about a second of
        flushes).
        """
        if ns.log is None:
            return 0
        keys, recs, malformed = self.catalog.load(ns.ns_id, ns.key_width)
        self.counters.records_dropped += malformed
        valid = (ns.log.in_bounds(recs["seg"], recs["off"])
                 & (recs["size"] == ns.block_bytes) & (recs["version"] > 0))
        if not valid.all():
            self.counters.records_dropped += int((~valid).sum())
            self.journal.delete(ns.ns_id, [bytes(k) for k in keys[~valid]])
            keys, recs = keys[valid], recs[valid]
        self._install(ns, keys, recs)
        rkeys, rrecs, seen = replay(ns.ns_id, ns.key_width, ns.block_bytes, ns.log,
                                    self.catalog.marks(ns.ns_id))
        added = 0
        if rkeys.size:
            rows = ns.table.lookup(rkeys)
            newer = rows < 0
            added = int(newer.sum())
            newer[~newer] = rrecs["version"][~newer] > ns.table.cols["version"][rows[~newer]]
            rkeys, rrecs = rkeys[newer], rrecs[newer]
            self._install(ns, rkeys, rrecs)
            self.journal.put(ns.ns_id, rkeys, rrecs)
        if seen["torn"]:
            self.counters.records_dropped += seen["torn"]
            log.warning("%s: %d records past LMDB's last checkpoint fail the checksum their "
                        "batch header names (a torn tail: never acknowledged); skipped",
                        ns.name, seen["torn"])
        if seen["batches"]:
            log.info("%s: replayed %d batches (%d records) past LMDB's last checkpoint, %d "
                     "newer than LMDB", ns.name, seen["batches"], seen["records"], rkeys.size)
        # Strict: the marks must name this start's segments only (a mark left from a deleted
        # segment would hide the batches of a new one given its id).
        self.checkpoint(strict=True)
        return int(keys.size) + added

    def _install(self, ns: "Namespace", keys: np.ndarray, recs: np.ndarray) -> None:
        """Restart: rows for records (new keys inserted, known ones taken over), CLEAN, their
        NVMe copies where the records say, parents linked."""
        if keys.size == 0:
            return
        table = ns.table
        rows, _ = table.insert(keys)
        cols = table.cols
        cols["version"][rows] = recs["version"]
        cols["size"][rows] = recs["size"]
        cols["checksum"][rows] = recs["checksum"]
        cols["state"][rows] = BlockState.CLEAN
        self.set_nvme(ns, rows, recs["seg"].astype(np.int32), recs["off"], recs["version"],
                       recs["checksum"])
        has = (recs["flags"] & FLAG_PARENT) != 0
        if has.any():
            prow = np.full(rows.size, -1, dtype=np.int64)
            prow[has] = table.lookup(recs["parent"][has])
            table.link(rows[has], prow[has])

    def close(self) -> None:
        """Run the begun flushes (Engine.close has them run before it takes the engine lock,
        which their flush thread needs), then settle, checkpoint and close the logs."""
        self.flushes.close()
        with self.writer:
            self.settle()
            self.checkpoint(strict=False)
            for lg in self.logs():
                lg.close()
