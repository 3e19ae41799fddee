"""The flush pipeline of the NVMe store: write, sync, apply in ticket order.

``Flushes`` turns flush calls into durable batches. It owns the group-commit queue and the
tickets that order the batches' application, and reaches the rest of the store only through
``FlushStore`` (the writer, the engine, space, the journal and three record calls).

A call's life, one batch per group of calls queued for a namespace:

    1. queue: the call's rows go into its namespace's queue. The first call to take the store's
       ``writer`` claims every call queued for the namespace (group commit), the others wait;
    2. write (writer held): pick the DIRTY rows, oldest version first, their host slots pinned;
       make room (coherence.space); append them behind a batch header that names each
       record's key -> (size, version, checksum, parent) (SegmentLog.write); take a ticket.
       Then the writer is released: the next group writes while this one syncs;
    3. sync (writer released): fdatasync the segments written to. Appends are one at a time,
       so a batch's sync also covers every batch written before it (a crash keeps a prefix);
    4. apply, in ticket order: queue the LMDB records (coherence.journal), unpin, install the
       rows whose key and version still match (CLEAN, the old NVMe records dead), delete the
       records no row wants; set every call's outcome. In ticket order, so that a key's records
       reach the journal and its row in version order (a later batch may hold a newer version
       of the same key), and a call returns only once its batch and every batch before it are
       synced and applied. That is the acknowledgement a write_through put waits for.

Whatever moves or names records (a reclaim, a checkpoint, record deletes, close) takes the
writer, so no batch starts, and then settle()s the batches in flight.

A flush that the caller does not wait for (``begin``, issue 17): the call is handed to the
store's flush thread, which runs it as any flush() call (steps 1-4 above, group commit and
ticket order included), and the returned ``FlushHandle`` completes when that flush() returns:
its rows are then synced and applied, or the handle holds the error. Nothing waits for a
handle with the writer or the engine lock held (the flush thread needs both), so a handle
never deadlocks with settle() or with the apply's ticket order; until it completes its rows
stay DIRTY (a reader is served the committed version from memory; Puts.commit_begin keeps
their slots pinned, so an eviction passes them over). A write_through put acknowledged at its
handle's completion keeps DESIGN.md's contract: acknowledged only once synced and applied.

Thread-safety: flush() is called from any thread without the engine lock; the lock is taken
inside the writer, never the other way round. The queue has its own lock and the tickets
their condition, both held for a few statements only.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from kvtier.coherence.journal import entries_of
from kvtier.coherence.namespace import EngineCounters, to_numpy
from kvtier.coherence.records import records_of, same_key
from kvtier.coherence.space import DISK_MARGIN
from kvtier.coherence.states import (BlockState, Event, IllegalTransition, next_states,
                                     transition_array)
from kvtier.errors import StorageError
from kvtier.pagetable.store import FLAG_PARENT, record_dtype
from kvtier.types import Tier

try:
    from kvtier.coherence import _flush
except ImportError:             # not built: _pick_numpy and _apply_numpy (the reference)
    _flush = None

if TYPE_CHECKING:
    from kvtier.coherence.journal import Journal
    from kvtier.coherence.namespace import Namespace
    from kvtier.coherence.persist import Coherence
    from kvtier.coherence.space import Space
    from kvtier.tiers.nvme import Segment, SegmentLog

log = logging.getLogger("kvtier.persist")


class FlushStore(Protocol):
    """What the flush pipeline needs of the NVMe store (coherence.persist.NvmeStore)."""

    owner: "Coherence"
    counters: EngineCounters
    space: "Space"
    journal: "Journal"
    writer: threading.Lock         # every writer of records, one at a time

    def logs(self) -> list["SegmentLog"]: ...
    def used_bytes(self) -> int: ...
    def set_nvme(self, ns: "Namespace", rows: np.ndarray, segs: np.ndarray, offs: np.ndarray,
                 versions: np.ndarray, sums: np.ndarray) -> None: ...
    def nvme_moved(self, ns: "Namespace", old_segs: np.ndarray, rows: np.ndarray,
                   segs: np.ndarray) -> None: ...
    def delete_now(self, ns: "Namespace", keys: list[bytes]) -> None: ...
    def checkpoint(self, strict: bool = True) -> None: ...


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
    distinct: bool = True       # the rows asked for named each row once (or were all dirty)


@dataclass(slots=True)
class _FlushCall:
    """One flush() call waiting for its group (group commit)."""

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
    touched: list["Segment"]
    ticket: int


class FlushHandle:
    """A flush running on the store's flush thread (Flushes.begin). Complete once its flush()
    returned: its rows synced and applied (``written`` of them reached NVMe), or ``error``
    set. ``done_at``: time.perf_counter() at completion, so that a caller that looks later
    still times the flush itself."""

    __slots__ = ("_event", "written", "error", "done_at")

    def __init__(self) -> None:
        self._event = threading.Event()
        self.written = 0
        self.error: BaseException | None = None
        self.done_at = 0.0

    @classmethod
    def completed(cls, written: int = 0) -> "FlushHandle":
        """A handle with nothing to wait for (a write_back commit, no NVMe tier)."""
        h = cls()
        h._complete(written, None)
        return h

    def _complete(self, written: int, error: BaseException | None) -> None:
        self.written, self.error, self.done_at = written, error, time.perf_counter()
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> int:
        """Until complete; returns how many rows reached NVMe, or raises the flush's error
        (StorageError: the NVMe tier is full or failing). Never call it holding the engine
        lock or the store's writer: the flush thread takes both. TimeoutError after
        ``timeout`` seconds (None: no limit)."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"the flush did not complete in {timeout} s")
        if self.error is not None:
            raise self.error
        return self.written


class Flushes:
    """Group commit and the write / sync / apply pipeline of one NVMe store."""

    def __init__(self, store: FlushStore) -> None:
        self.store = store
        # Batches written under the writer whose fdatasync runs after it is released, applied
        # in the order they were written (tickets): see _finish_group.
        self._turns = threading.Condition()
        self._next_ticket = 0
        self._next_apply = 0
        self._queue_lock = threading.Lock()
        self._queue: dict[str, list[_FlushCall]] = {}     # flush calls waiting, by namespace
        # begin()'s calls, run in order by one flush thread (started at the first begin()).
        self._begun: deque[tuple["Namespace", np.ndarray | None, bool,
                                 Callable[[], None] | None, FlushHandle]] = deque()
        self._begun_cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False

    def begin(self, ns: "Namespace", rows: np.ndarray | None = None, strict: bool = False,
              on_done: Callable[[], None] | None = None) -> FlushHandle:
        """flush(ns, rows, strict) run by the store's flush thread; returns at once with a
        handle that completes when that flush() returns (see the module docstring). on_done
        runs on that thread just before the handle completes, whatever the outcome (without
        the locks: it may take the engine lock). Called without the engine lock, as flush()
        is."""
        if ns.log is None:
            if on_done is not None:
                on_done()
            return FlushHandle.completed(0)
        h = FlushHandle()
        with self._begun_cv:
            if self._closing:
                raise StorageError("the NVMe store is closing; no flush can begin")
            if self._thread is None:
                thread = threading.Thread(target=self._run_begun, daemon=True,
                                          name="kvtier-flush")
                thread.start()              # kept once running: a failed start is retried
                self._thread = thread
            self._begun.append((ns, None if rows is None else np.asarray(rows, np.int64),
                                strict, on_done, h))
            self._begun_cv.notify()
        return h

    def _run_begun(self) -> None:
        while True:
            with self._begun_cv:
                while not self._begun and not self._closing:
                    self._begun_cv.wait()
                if not self._begun:
                    return                  # closing, and every begun flush has run
                ns, rows, strict, on_done, h = self._begun[0]
            try:
                written, error = self.flush(ns, rows, strict), None
            except BaseException as exc:    # the handle carries it to whoever waits
                written, error = 0, exc
            if on_done is not None:
                try:
                    on_done()
                except BaseException as exc:
                    log.exception("a begun flush's completion step failed")
                    error = error or exc
            with self._begun_cv:
                self._begun.popleft()
            h._complete(written, error)

    def close(self) -> None:
        """Run every begun flush to its end and stop the flush thread. Called without the
        engine lock and the writer (the flush thread takes both)."""
        with self._begun_cv:
            self._closing = True
            self._begun_cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def in_flight(self) -> int:
        """Batches written whose sync or apply is not done yet (their host slots are pinned)."""
        with self._turns:
            return self._next_ticket - self._next_apply

    def queued(self, name: str) -> int:
        """Flush calls of namespace ``name`` waiting for a writer to claim them."""
        with self._queue_lock:
            return len(self._queue.get(name, ()))

    def settle(self) -> None:
        """(writer held) Until every batch written so far is synced and applied. No new batch
        can start meanwhile: that takes the writer."""
        with self._turns:
            while self._next_apply < self._next_ticket:
                self._turns.wait()

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
        with self.store.writer:
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
        with self.store.owner.lock:
            batch = self._pick(ns, rows)
        if batch is None:
            for r in group:
                r.done = True
            return None
        for attempt in range(2):
            room = self.store.space.make_room(ns, batch.rows.size)
            if room < batch.rows.size and sum(lg.drop_spares() for lg in self.store.logs()):
                self.store.space.disk_changed()
                room = self.store.space.make_room(ns, batch.rows.size)   # a spare's room is wanted
            if room < batch.rows.size:
                self.store.counters.nvme_full += 1
                self._cut(ns, batch, room)
            try:
                if room == 0:
                    raise StorageError(
                        f"the NVMe tier is full ({self.store.space.capacity_now()} bytes, "
                        f"{self.store.used_bytes()} used) and nothing can be reclaimed; raise "
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
        with self.store.owner.lock:
            self._unpin(ns, batch)
        self.store.counters.nvme_full += 1
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
                self.store.journal.put(ns.ns_id, batch.keys, batch.records)
                with self.store.owner.lock:
                    self._unpin(ns, batch)
                    orphans = self._apply_flush(ns, batch, st.segs, st.offs)
                self.store.delete_now(ns, orphans)
                self.store.counters.flushes += 1
                self.store.counters.flushed_blocks += int(batch.rows.size)
                self.store.counters.tiers[Tier.NVME].bytes_written += (int(batch.rows.size)
                                                                 * ns.block_bytes)
                self._outcomes(ns, group, batch)
        finally:
            with self._turns:
                self._next_apply += 1
                for r in group:
                    r.done = r.done or r.error is not None
                self._turns.notify_all()
        if self.store.space.compaction_due() or self.store.journal.due():
            with self.store.writer:
                self.settle()
                self.store.space.compact(ns, int(batch.rows.size) * ns.block_bytes)
                if self.store.journal.due():
                    self.store.checkpoint(strict=False)

    def _outcomes(self, ns: "Namespace", group: list["_FlushCall"], batch: _Batch) -> None:
        # A group of one call whose rows are distinct (a put's): every row of the batch is one
        # of its rows, once, so no set test (np.isin twice: ~0.1 ms a put, issue 17).
        alone = len(group) == 1 and batch.distinct
        for r in group:
            if r.rows is None or alone:
                r.written, cut = int(batch.rows.size), batch.cut
            else:
                r.written = int(np.isin(r.rows, batch.rows).sum())
                cut = int(np.isin(r.rows, batch.cut_rows).sum())
            if r.strict and cut:
                r.error = StorageError(
                    f"{cut} blocks of {ns.name!r} stay dirty: the NVMe tier is full "
                    f"({self.store.space.capacity_now()} bytes); raise nvme_capacity or free disk "
                    "space")
            r.done = True

    def _disk_full(self, ns: "Namespace", n: int) -> bool:
        """After a failed append: True when the file system has no room for n more records
        (the next attempt then sees a capacity lowered to what the disk holds, and reclaims)."""
        self.store.space.disk_changed()     # the next capacity_now asks the disk again
        try:
            return shutil.disk_usage(ns.log.dir).free < ns.log.bytes_for(n) + DISK_MARGIN
        except OSError:
            return False

    def _pick(self, ns: "Namespace", rows: np.ndarray | None) -> _Batch | None:
        """Under the lock: the DIRTY rows to write, oldest version first, their host slots
        pinned (an HBM-only copy is staged: that is a memory copy, not disk I/O)."""
        cols = ns.table.cols
        if rows is None:
            rows = np.flatnonzero(cols["state"][:ns.table.n_rows] == BlockState.DIRTY)
        picked = (self._pick_c if _flush is not None else self._pick_numpy)(ns, rows)
        if picked is None:
            return None
        rows, versions, host_slots, sums, keys, records, distinct, staged = picked
        pool = ns.slots[Tier.HOST].pool
        views: list[memoryview]
        if not staged:                      # every copy in host memory (a put's, as a rule)
            self.store.owner.pin_slots(ns, Tier.HOST, host_slots)
            views = [pool.slot_view(s) for s in host_slots.tolist()]
        else:
            on_host = host_slots >= 0
            self.store.owner.pin_slots(ns, Tier.HOST, host_slots[on_host])
            hbm = ns.slots[Tier.HBM].pool
            staging = to_numpy(hbm.read(cols["slot"][rows[~on_host], Tier.HBM]))
            views, k = [], 0
            for s in host_slots.tolist():
                if s >= 0:
                    views.append(pool.slot_view(s))
                else:
                    views.append(memoryview(staging[k]))
                    k += 1
        return _Batch(rows, keys, versions, sums, records, views, host_slots,
                      distinct=distinct)

    def _pick_c(self, ns: "Namespace", rows: np.ndarray) -> tuple | None:
        """_pick_numpy in one C call (kvtier.coherence._flush.pick): ~35 numpy calls of a
        microsecond or more each for a put's 16 rows (issue 17, fio7)."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        m = rows.size
        if m == 0:
            return None
        cols, w = ns.table.cols, ns.key_width
        o_rows = np.empty(m, dtype=np.int64)
        o_ver = np.empty(m, dtype=np.uint64)
        o_slots = np.empty(m, dtype=np.int64)
        o_sums = np.empty(m, dtype=np.uint64)
        o_keys = np.empty(m, dtype=cols["key"].dtype)
        o_recs = np.zeros(m, dtype=record_dtype(w))
        k, distinct, staged = _flush.pick(
            rows, ns.table.n_rows, int(BlockState.DIRTY), int(Tier.HOST), int(Tier.HBM),
            FLAG_PARENT, ns.block_bytes, cols["state"], cols["version"], cols["copy_ver"],
            cols["slot"], cols["checksum"], cols["key"], cols["parent"], o_rows, o_ver,
            o_slots, o_sums, o_keys, o_recs, w)
        if k == 0:
            return None
        if k < m:
            o_rows, o_ver, o_slots, o_sums = o_rows[:k], o_ver[:k], o_slots[:k], o_sums[:k]
            o_keys, o_recs = o_keys[:k], o_recs[:k]
        return o_rows, o_ver, o_slots, o_sums, o_keys, o_recs, distinct, staged

    def _pick_numpy(self, ns: "Namespace", rows: np.ndarray) -> tuple | None:
        """The rows to write and what goes with them: (rows, versions, host slots (-1: an
        HBM copy, staged), checksums, keys, LMDB records, whether the rows asked for were
        distinct, how many are staged). The reference for kvtier.coherence._flush.pick."""
        cols = ns.table.cols
        n = ns.table.n_rows
        # One sort tells whether the rows repeat (a put's never do): np.unique only then.
        rows = np.sort(np.asarray(rows, dtype=np.int64))
        distinct = rows.size < 2 or bool((rows[1:] != rows[:-1]).all())
        if not distinct:
            rows = np.unique(rows)
        if rows.size and (rows[-1] >= n or rows[0] < 0):
            rows = rows[(rows >= 0) & (rows < n)]
        rows = rows[cols["state"][rows] == BlockState.DIRTY]
        if rows.size == 0:
            return None
        rows = rows[np.argsort(cols["version"][rows], kind="stable")]
        versions = cols["version"][rows].copy()
        on_host = cols["copy_ver"][rows, Tier.HOST] == versions
        on_hbm = ~on_host & (cols["copy_ver"][rows, Tier.HBM] == versions)
        keep = on_host | on_hbm            # a DIRTY row always has one; never trust it blindly
        if not keep.all():
            rows, versions, on_host = rows[keep], versions[keep], on_host[keep]
            if rows.size == 0:
                return None
        host_slots = np.where(on_host, cols["slot"][rows, Tier.HOST], -1).astype(np.int64)
        sums = cols["checksum"][rows].copy()
        return (rows, versions, host_slots, sums, cols["key"][rows].copy(),
                records_of(ns, rows, versions, sums), distinct, int((~on_host).sum()))

    def _cut(self, ns: "Namespace", batch: _Batch, room: int) -> None:
        """Keep the first ``room`` rows of a batch (the oldest versions)."""
        gone = batch.host_slots[room:]
        with self.store.owner.lock:
            self.store.owner.unpin_slots(ns, Tier.HOST, gone[gone >= 0])
        batch.cut = int(batch.rows.size - room)
        batch.cut_rows = batch.rows[room:]
        batch.host_slots = batch.host_slots[:room]
        batch.rows, batch.keys = batch.rows[:room], batch.keys[:room]
        batch.versions, batch.sums = batch.versions[:room], batch.sums[:room]
        batch.records, batch.views = batch.records[:room], batch.views[:room]

    def _unpin(self, ns: "Namespace", batch: _Batch) -> None:
        held = batch.host_slots
        self.store.owner.unpin_slots(ns, Tier.HOST, held[held >= 0])

    def _apply_flush(self, ns: "Namespace", batch: _Batch, segs: np.ndarray,
                     offs: np.ndarray) -> list[bytes]:
        """Under the lock, after the records are durable: install them where the row still
        holds that key at that version or a newer one (then the record is the stale fallback
        it would be after a restart). Returns the keys whose records no row wants."""
        if _flush is None:
            return self._apply_numpy(ns, batch, segs, offs)
        # _apply_numpy's same_key, set_nvme's columns and the FLUSHED transitions in one C
        # call (kvtier.coherence._flush.apply; ~25 numpy calls for a put's 16 rows, fio7).
        cols = ns.table.cols
        rows = batch.rows
        k = rows.size
        m = np.empty(k, dtype=np.int64)
        old = np.empty(k, dtype=np.int32)
        n_m, n_old, bad = _flush.apply(
            ns.table.n_rows, int(Tier.NVME), transition_array(Event.FLUSHED), rows,
            batch.keys, batch.versions, np.ascontiguousarray(segs, dtype=np.int32),
            np.ascontiguousarray(offs, dtype=np.uint32), batch.sums, cols["key"],
            cols["version"], cols["copy_ver"], cols["slot"], cols["nvme_off"],
            cols["nvme_checksum"], cols["state"], m, old, ns.key_width)
        m = m[:n_m]
        self.store.nvme_moved(ns, old[:n_old], rows[m], segs[m])
        if bad:
            raise IllegalTransition(f"no transition from {BlockState(bad - 1).name} on "
                                    f"{Event.FLUSHED.value}")
        if n_m == k:
            return []
        same = np.zeros(k, dtype=bool)
        same[m] = True
        return [bytes(x) for x in batch.keys[~same]]

    def _apply_numpy(self, ns: "Namespace", batch: _Batch, segs: np.ndarray,
                     offs: np.ndarray) -> list[bytes]:
        """_apply_flush in numpy: the reference for kvtier.coherence._flush.apply."""
        cols = ns.table.cols
        rows = batch.rows
        same = same_key(ns, rows, batch.keys)
        same[same] = cols["version"][rows[same]] >= batch.versions[same]
        m = np.flatnonzero(same)
        r = rows[m]
        self.store.set_nvme(ns, r, segs[m], offs[m], batch.versions[m], batch.sums[m])
        cur = r[cols["version"][r] == batch.versions[m]]
        cols["state"][cur] = next_states(cols["state"][cur], Event.FLUSHED)
        return [bytes(k) for k in batch.keys[~same]]
