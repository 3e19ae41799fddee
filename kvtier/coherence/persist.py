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
Flush calls that arrive while it is held are written together by the next holder (group commit:
one append and one LMDB transaction for all of them, see flush()). A flush holds ``writer`` for
its writes only: its fdatasync runs after it is released, beside the next flush's writes, and
flushes are then applied (step 3 below) in the order they were written, by ticket. Reclaims,
checkpoints and record deletes first settle() every flush in flight.

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
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvtier.checksums import block_checksums
from kvtier.coherence.namespace import EngineCounters, to_numpy
from kvtier.coherence.states import BlockState, Event, next_states
from kvtier.config import Settings
from kvtier.errors import StorageError
from kvtier.coherence.journal import Journal, entries_of, entry_dtype, replay
from kvtier.coherence.records import records_of, same_key
from kvtier.coherence.space import DISK_MARGIN, SMALL_SEGMENTS, Space
from kvtier.pagetable.store import FLAG_PARENT, Catalog, NamespaceRecord
from kvtier.tiers.host import SlotPool
from kvtier.tiers.nvme import Backend, Segment, SegmentLog, data_start, round_up
from kvtier.types import Tier

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


@dataclass(slots=True)
class _Batch:
    """Rows to append, with what was current when they were picked."""

    rows: np.ndarray
    keys: np.ndarray
    versions: np.ndarray
    sums: np.ndarray
    records: np.ndarray
    views: list[memoryview]
    host_slots: np.ndarray      # per row, the host slot pinned for the write (-1: staged)
    cut: int = 0                # rows left out for want of room
    cut_rows: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))


@dataclass(slots=True)
class _FlushCall:
    """One flush() call waiting for its group (coherence.persist's group commit)."""

    rows: np.ndarray | None     # None: every dirty row of the namespace
    strict: bool
    claimed: bool = False       # taken into a group by the call that writes it
    done: bool = False
    written: int = 0
    error: BaseException | None = None


@dataclass(slots=True)
class _Staged:
    """A batch written (not yet durable) and its place in the order of application."""

    batch: _Batch
    segs: np.ndarray
    offs: np.ndarray
    touched: list[Segment]
    ticket: int


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
        # Batches written under ``writer`` whose fdatasync runs after it is released, applied
        # in the order they were written (tickets): see _flush_group.
        self._turns = threading.Condition()
        self._next_ticket = 0
        self._next_apply = 0
        self._queue_lock = threading.Lock()
        self._queue: dict[str, list[_FlushCall]] = {}     # flush calls waiting, by namespace
        self._wanted: dict[str, list[np.ndarray]] = {}
        self.space = Space(self)
        self.journal = Journal(catalog, settings.checkpoint_interval)

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

    def _logs(self) -> list[SegmentLog]:
        return [ns.log for ns in self.owner.namespaces.values() if ns.log is not None]

    def used_bytes(self) -> int:
        """Bytes of segment files on disk, all namespaces."""
        return sum(lg.total_bytes() for lg in self._logs())

    def headroom(self) -> int:
        return max((lg.segment_bytes for lg in self._logs()), default=0)

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
        with self._turns:
            return self._next_ticket - self._next_apply

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
        with self._turns:
            while self._next_apply < self._next_ticket:
                self._turns.wait()

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
        """Write the DIRTY rows among ``rows`` (all of ns's when None). Returns how many of
        them reached NVMe. Called without the engine lock.

        Group commit: a call that finds another flush in flight queues its rows and waits;
        the next one to take ``writer`` writes the rows of every call queued for the namespace
        as one batch (one append, one fdatasync per segment), and each call returns when its
        own rows are durable. Concurrent write_through puts so share the fdatasync that
        dominates a small put (about 4 ms on the dev VM); LMDB's two syncs are paid once per
        checkpoint (coherence.journal), not per flush.

        NVMe full or failing: with strict=False (background flushes, write-downs) the rows stay
        dirty in the upper tiers and ``nvme_full`` counts it; with strict=True (a write_through
        put, an explicit flush) StorageError is raised unless every row of this call that was
        picked was written.
        """
        if ns.log is None:
            return 0
        req = _FlushCall(None if rows is None else np.asarray(rows, dtype=np.int64), strict)
        with self._queue_lock:
            self._queue.setdefault(ns.name, []).append(req)
        staged: _Staged | None = None
        group: list[_FlushCall] = []
        with self.writer:
            if not req.claimed:
                with self._queue_lock:
                    group = self._queue.pop(ns.name, [])
                for r in group:
                    r.claimed = True
                try:
                    staged = self._write_group(ns, group)
                except BaseException as exc:
                    self._fail(group, exc)
                    raise
        if staged is not None:
            try:
                self._finish_group(ns, group, staged)
            except BaseException as exc:
                self._fail(group, exc)
                raise
        if not req.done:                    # written by another call's group: until durable
            with self._turns:
                while not req.done:
                    self._turns.wait()
        if req.error is not None:
            raise req.error
        return req.written

    def _fail(self, group: list["_FlushCall"], exc: BaseException) -> None:
        with self._turns:
            for r in group:
                if not r.done:
                    r.done, r.error = True, exc
            self._turns.notify_all()

    def _write_group(self, ns: "Namespace", group: list["_FlushCall"]) -> "_Staged | None":
        """One batch for the queued calls of ns, written but not synced (writer held). Returns
        it with its ticket, or None when the group's outcome is already set (nothing dirty,
        or the write failed)."""
        wanted = [r.rows for r in group]
        rows = None if any(w is None for w in wanted) else np.concatenate(wanted)
        with self.owner.lock:
            batch = self._pick(ns, rows)
        if batch is None:
            for r in group:
                r.done = True
            return None
        for attempt in range(2):
            room = self.space.make_room(ns, batch.rows.size)
            if room < batch.rows.size and sum(lg.drop_spares() for lg in self._logs()):
                room = self.space.make_room(ns, batch.rows.size)   # a spare's room is wanted
            if room < batch.rows.size:
                self.counters.nvme_full += 1
                self._cut(ns, batch, room)
            try:
                if room == 0:
                    raise StorageError(
                        f"the NVMe tier is full ({self.space.capacity_now()} bytes, "
                        f"{self.used_bytes()} used) and nothing can be reclaimed; raise "
                        "nvme_capacity")
                segs, offs, touched = ns.log.write(batch.views,
                                                   entries_of(batch.keys, batch.records))
                batch.records["seg"], batch.records["off"] = segs, offs
                break
            except StorageError as exc:
                if attempt == 0 and room and self._disk_full(ns, room):
                    continue            # the capacity is now what the disk holds: reclaim
                self._failed(ns, group, batch, exc)
                return None
        with self._turns:
            ticket = self._next_ticket
            self._next_ticket += 1
        return _Staged(batch, segs, offs, touched, ticket)

    def _failed(self, ns: "Namespace", group: list["_FlushCall"], batch: _Batch,
                exc: StorageError) -> None:
        """A batch that did not reach the disk: its rows stay dirty."""
        with self.owner.lock:
            self._unpin(ns, batch)
        self.counters.nvme_full += 1
        log.warning("flush of %d blocks of %s failed (%s); they stay dirty",
                    batch.rows.size, ns.name, exc)
        for r in group:
            r.done = True
            if r.strict:
                r.error = StorageError(str(exc))

    def _finish_group(self, ns: "Namespace", group: list["_FlushCall"], st: "_Staged") -> None:
        """Sync a written batch (writer released: the next group's writes run beside this
        fdatasync), then, in ticket order, queue its LMDB records and install it; sets each
        call's outcome. In ticket order, so that a key's records reach the journal and its
        row in version order (a later batch may hold a newer version of the same key), and
        a batch is applied only after every batch written before it."""
        batch = st.batch
        err: StorageError | None = None
        try:                # the ticket is given back whatever happens: settle() waits for it
            try:
                ns.log.sync(st.touched)
            except StorageError as exc:
                err = exc
            finally:
                with self._turns:
                    while self._next_apply != st.ticket:
                        self._turns.wait()
            if err is not None:
                self._failed(ns, group, batch, err)
            else:
                self.journal.put(ns.ns_id, batch.keys, batch.records)
                with self.owner.lock:
                    self._unpin(ns, batch)
                    orphans = self._apply_flush(ns, batch, st.segs, st.offs)
                self.delete_now(ns, orphans)
                self.counters.flushes += 1
                self.counters.flushed_blocks += int(batch.rows.size)
                self.counters.tiers[Tier.NVME].bytes_written += (int(batch.rows.size)
                                                                 * ns.block_bytes)
                self._outcomes(ns, group, batch)
        finally:
            with self._turns:
                self._next_apply += 1
                for r in group:
                    r.done = r.done or r.error is not None
                self._turns.notify_all()
        if self.space.compaction_due() or self.journal.due():
            with self.writer:
                self.settle()
                self.space.compact(ns)
                if self.journal.due():
                    self.checkpoint(strict=False)

    def _outcomes(self, ns: "Namespace", group: list["_FlushCall"], batch: _Batch) -> None:
        for r in group:
            if r.rows is None:
                r.written, cut = int(batch.rows.size), batch.cut
            else:
                r.written = int(np.isin(r.rows, batch.rows).sum())
                cut = int(np.isin(r.rows, batch.cut_rows).sum())
            if r.strict and cut:
                r.error = StorageError(
                    f"{cut} blocks of {ns.name!r} stay dirty: the NVMe tier is full "
                    f"({self.space.capacity_now()} bytes); raise nvme_capacity or free disk "
                    "space")
            r.done = True

    def _disk_full(self, ns: "Namespace", n: int) -> bool:
        """After a failed append: True when the file system has no room for n more records
        (the next attempt then sees a capacity lowered to what the disk holds, and reclaims)."""
        try:
            return shutil.disk_usage(ns.log.dir).free < ns.log.bytes_for(n) + DISK_MARGIN
        except OSError:
            return False

    def _pick(self, ns: "Namespace", rows: np.ndarray | None) -> _Batch | None:
        """Under the lock: the DIRTY rows to write, oldest version first, their host slots
        pinned (an HBM-only copy is staged: that is a memory copy, not disk I/O)."""
        cols = ns.table.cols
        n = ns.table.n_rows
        if rows is None:
            rows = np.flatnonzero(cols["state"][:n] == BlockState.DIRTY)
        else:
            rows = np.unique(np.asarray(rows, dtype=np.int64))
            rows = rows[(rows < n)]
            rows = rows[cols["state"][rows] == BlockState.DIRTY]
        if rows.size == 0:
            return None
        rows = rows[np.argsort(cols["version"][rows], kind="stable")]
        versions = cols["version"][rows].copy()
        on_host = cols["copy_ver"][rows, Tier.HOST] == versions
        on_hbm = ~on_host & (cols["copy_ver"][rows, Tier.HBM] == versions)
        keep = on_host | on_hbm            # a DIRTY row always has one; never trust it blindly
        rows, versions, on_host, on_hbm = rows[keep], versions[keep], on_host[keep], on_hbm[keep]
        if rows.size == 0:
            return None
        pool = ns.slots[Tier.HOST].pool
        host_slots = np.where(on_host, cols["slot"][rows, Tier.HOST], -1).astype(np.int64)
        self.owner.pin_slots(ns, Tier.HOST, host_slots[on_host])
        staging = None
        if on_hbm.any():
            hbm = ns.slots[Tier.HBM].pool
            staging = to_numpy(hbm.read(cols["slot"][rows[on_hbm], Tier.HBM]))
        views: list[memoryview] = []
        k = 0
        for i, r in enumerate(rows.tolist()):
            if on_host[i]:
                views.append(pool.slot_view(int(cols["slot"][r, Tier.HOST])))
            else:
                views.append(memoryview(staging[k]))
                k += 1
        sums = cols["checksum"][rows].copy()
        return _Batch(rows, cols["key"][rows].copy(), versions, sums,
                      records_of(ns, rows, versions, sums), views, host_slots)

    def _cut(self, ns: "Namespace", batch: _Batch, room: int) -> None:
        """Keep the first ``room`` rows of a batch (the oldest versions)."""
        gone = batch.host_slots[room:]
        with self.owner.lock:
            self.owner.unpin_slots(ns, Tier.HOST, gone[gone >= 0])
        batch.cut = int(batch.rows.size - room)
        batch.cut_rows = batch.rows[room:]
        batch.host_slots = batch.host_slots[:room]
        batch.rows, batch.keys = batch.rows[:room], batch.keys[:room]
        batch.versions, batch.sums = batch.versions[:room], batch.sums[:room]
        batch.records, batch.views = batch.records[:room], batch.views[:room]

    def _unpin(self, ns: "Namespace", batch: _Batch) -> None:
        held = batch.host_slots
        self.owner.unpin_slots(ns, Tier.HOST, held[held >= 0])

    def _apply_flush(self, ns: "Namespace", batch: _Batch, segs: np.ndarray,
                     offs: np.ndarray) -> list[bytes]:
        """Under the lock, after the records are durable: install them where the row still
        holds that key at that version or a newer one (then the record is the stale fallback
        it would be after a restart). Returns the keys whose records no row wants."""
        cols = ns.table.cols
        rows = batch.rows
        same = same_key(ns, rows, batch.keys)
        same[same] = cols["version"][rows[same]] >= batch.versions[same]
        m = np.flatnonzero(same)
        r = rows[m]
        self.set_nvme(ns, r, segs[m], offs[m], batch.versions[m], batch.sums[m])
        cur = r[cols["version"][r] == batch.versions[m]]
        cols["state"][cur] = next_states(cols["state"][cur], Event.FLUSHED)
        return [bytes(k) for k in batch.keys[~same]]

    def set_nvme(self, ns: "Namespace", rows: np.ndarray, segs: np.ndarray,
                  offs: np.ndarray, versions: np.ndarray, sums: np.ndarray) -> None:
        cols = ns.table.cols
        old = rows[cols["copy_ver"][rows, Tier.NVME] > 0]
        ns.log.add_live(cols["slot"][old, Tier.NVME], -1)
        cols["slot"][rows, Tier.NVME] = segs
        cols["nvme_off"][rows] = offs
        cols["copy_ver"][rows, Tier.NVME] = versions
        cols["nvme_checksum"][rows] = sums
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
        with self.writer:
            self.settle()
            self.checkpoint(strict=False)
            for lg in self._logs():
                lg.close()
