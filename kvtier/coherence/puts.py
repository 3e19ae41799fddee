"""Puts: the part of the engine that writes blocks (two-phase: reserve, the writer's copy,
commit; and Engine.put, in process). Each public method takes the engine lock itself.

A reservation holds fresh slots, pinned like a lease, until its commit or abort. The commit
checks the writer's checksums (or hashes the slots), installs the new versions through the
engine's ``install`` (the page table's columns, the copy, the policy's touch, parents), frees
the old copies, and under write_through flushes the batch to NVMe (and pushes it to the remote
tier) before it returns. A host put under write_back whose keys are distinct runs as one step
under the lock (``_put_inline``: no reservation, no pin and unpin; the same rows, versions and
counters).

Interface. Owns nothing but the reservations it adds to the holds' table. Public: reserve,
abort, commit, put, put_in_memory (the engine's methods of those names are these, bound);
reserve_inline and commit_inline, the service loop's forms (Server.op_reserve, op_commit).
Calls: the holds (ending reservations), the eviction's evict_copies (host room for a GPU
write's copy), the NVMe store (drains, waits, write_through flushes), the transfers (the
remote tier's push), and through ``PutOwner`` the engine's slot allocation and release, lease
ids and install; the namespaces, counters and settings.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

import numpy as np

from kvtier.checksums import block_checksums
from kvtier.coherence.flushes import FlushHandle
from kvtier.coherence.gets import _refuse_zero_key
from kvtier.coherence.namespace import Namespace, Reservation, to_numpy
from kvtier.coherence.states import HoldState
from kvtier.errors import BadRequest, CapacityError, LeaseError
from kvtier.types import Tier

if TYPE_CHECKING:
    from kvtier.coherence.leases import Holds
    from kvtier.coherence.namespace import EngineCounters
    from kvtier.coherence.persist import NvmeStore
    from kvtier.coherence.transfers import Transfers
    from kvtier.config import Settings
    from kvtier.pagetable.table import PageTable
    from kvtier.tiers.host import SlotPool

try:        # the C helper (setup.py builds it where a compiler is present); numpy otherwise
    from kvtier.coherence import _fast
except ImportError:
    _fast = None

# Tier.HOST read on the class goes through EnumType's __getattr__ (~0.2 us against a global's
# ~0.02 in Python 3.11): the put path reads it as a module name.
_HOST = Tier.HOST


# numpy names the hot paths read as globals (why: kvtier.pagetable.table, at _empty).
_U8, _contiguous, _ndarray = np.uint8, np.ascontiguousarray, np.ndarray


class PutOwner(Protocol):
    """What a put needs of the engine (the caller holds the lock)."""

    host_used: int               # bytes of host slots in use, all namespaces

    def alloc(self, ns: Namespace, tier: Tier, n: int, partial: bool = False) -> np.ndarray: ...
    def free_slots(self, ns: Namespace, tier: Tier, slots: np.ndarray) -> None: ...
    def slots_freed(self, ns: Namespace, tier: Tier, slots: np.ndarray) -> None: ...
    def unpin_slots(self, ns: Namespace, tier: Tier, slots: np.ndarray) -> None: ...
    def new_id(self) -> int: ...
    def install(self, ns: Namespace, karr: np.ndarray, tier: Tier, slots: np.ndarray,
                sums: np.ndarray, parents: np.ndarray | None,
                host_slots: np.ndarray | None) -> np.ndarray: ...
    def install_new(self, ns: Namespace, karr: np.ndarray, parents: np.ndarray,
                    slots: np.ndarray, data: np.ndarray) -> np.ndarray | None: ...


class Puts:
    def __init__(self, lock: threading.RLock, settings: Settings, counters: EngineCounters,
                 namespaces: dict[str, Namespace], namespace: Callable[[str], Namespace],
                 holds: Holds, evict_copies: Callable[[Namespace, Tier, int], Any],
                 nvme: NvmeStore, transfers: Transfers, remote: Any, owner: PutOwner) -> None:
        self.lock, self.settings, self.counters = lock, settings, counters
        self.namespaces, self.namespace = namespaces, namespace     # the engine's lookup
        self.holds, self.reservations = holds, holds.reservations
        self.evict_copies, self.nvme, self.transfers = evict_copies, nvme, transfers
        self.remote, self.owner = remote, owner      # remote: the remote tier, or None

    def _put_keys(self, ns: Namespace, keys: Any) -> tuple[np.ndarray, bool]:
        """A put's keys, checked (not empty, no all-zero key), and whether some key may be
        repeated in the batch (exact without the C helper; with it, a hash collision also
        says so, and the commit's exact path then finds no repeat)."""
        karr = ns.table.keys_array(keys)
        if karr.size == 0:
            raise BadRequest("empty key batch; send at least one key")
        zero, repeats = ns.table.key_flags(karr)
        if zero:
            _refuse_zero_key(karr)
        return karr, repeats

    def _put_parents(self, ns: Namespace, parents: Any, n: int) -> np.ndarray | None:
        """A put's parents, packed and checked against its n keys (None: no parents)."""
        if parents is None:
            return None
        parr = ns.table.keys_array(parents)
        if parr.size != n:
            raise BadRequest(f"{parr.size} parents for {n} keys; send one parent per key "
                             "(all-zero for none)")
        return parr

    def reserve(self, namespace: str, keys: Any, parents: Any = None, tier: Tier = Tier.HOST,
                owner: int = 0) -> Reservation:
        """Phase one of a put: fresh slots for each key, pinned until commit or abort.

        ``parents`` is a packed buffer aligned with keys; an all-zero parent means none. When
        room needs dirty blocks written down first, they are written with the lock released
        and the reservation is tried again.
        """
        return self._with_room(lambda: self._reserve(namespace, keys, parents, tier, owner))

    def reserve_credit(self, namespace: str, n: int, owner: int = 0) -> Reservation:
        """A credit: n fresh host slots reserved before their keys are known, for the writer's
        next put, whose first copies then start without waiting for a reserve's reply (issue
        16: a GPU put's first reply came ~0.5 ms after its sends on the H200, 8% of a 64 MiB
        put). Its commit names the keys of its first slots (``_bind``); the rest go back
        then. Held, quota'd, expired and ended as any reservation."""
        return self._with_room(lambda: self._reserve_credit(namespace, n, owner))

    def _with_room(self, reserve: Callable[[], Reservation]) -> Reservation:
        attempt = 0
        while True:
            try:
                with self.lock:
                    res = reserve()
                if self.nvme.wanted():
                    self.nvme.drain()
                return res
            except CapacityError:
                # Room may come from dirty blocks written down, or from slots that a flush in
                # flight has pinned: both with the lock released, then try again.
                attempt += 1
                if attempt > 8 or not (self.nvme.wanted() or self.nvme.busy()):
                    raise
            self.nvme.drain() if self.nvme.wanted() else self.nvme.wait()

    def reserve_inline(self, namespace: str, keys: bytes, parents: bytes | None,
                       owner: int) -> Reservation | None:
        """The service loop's host reserve (Server.op_reserve; the caller holds the lock):
        reserve() where put_in_memory would say it touches no disk now, else None with
        nothing taken (the caller sends reserve() to a thread, which raises what it raises).
        One frame for put_in_memory's test, reserve and _reserve, the namespace looked up
        once: a GPU put pays a reserve per chunk, one after the other on the loop (issue 16,
        off7: ~21 us of a reserve's fixed cost in process on the dev VM)."""
        ns = self.namespaces.get(namespace)
        if ns is None or not self._room_now(ns, len(keys) // ns.key_width):
            return None
        res = self._reserve_in(ns, keys, parents, _HOST, owner)
        if self.nvme.wanted():       # as reserve(): nothing evicted with the room free, but
            self.nvme.drain()        # never leave a write-down wanted behind
        return res

    def _reserve(self, namespace: str, keys: Any, parents: Any, tier: Tier,
                 owner: int) -> Reservation:
        return self._reserve_in(self.namespace(namespace), keys, parents, tier, owner)

    def _reserve_in(self, ns: Namespace, keys: Any, parents: Any, tier: Tier,
                    owner: int) -> Reservation:
        karr, repeats = self._put_keys(ns, keys)
        parr = self._put_parents(ns, parents, karr.size)
        return self._hold(ns, tier, karr.size, owner, karr.copy(),
                          None if parr is None else parr.copy(), repeats)

    def _reserve_credit(self, namespace: str, n: int, owner: int) -> Reservation:
        ns = self.namespace(namespace)
        if type(n) is not int or not 0 < n <= ns.slots[_HOST].pool.n_slots:
            raise BadRequest(f"a credit of {n!r} slots; reserve between 1 and "
                             f"{ns.slots[_HOST].pool.n_slots} (the namespace's host slots)")
        return self._hold(ns, _HOST, n, owner, ns.table.keys_array(b""), None, False,
                          credit=True)

    def reserve_credit_inline(self, namespace: str, n: int, owner: int) -> Reservation | None:
        """reserve_credit on the service loop (the caller holds the lock), where the room is
        free without eviction or write-down; else None with nothing taken."""
        ns = self.namespaces.get(namespace)
        if ns is None or type(n) is not int or not self._room_now(ns, n):
            return None
        return self._reserve_credit(namespace, n, owner)

    def _hold(self, ns: Namespace, tier: Tier, n: int, owner: int, karr: np.ndarray,
              parr: np.ndarray | None, repeats: bool, credit: bool = False) -> Reservation:
        """n fresh slots of tier, pinned, as a reservation of owner's for karr (empty for a
        credit)."""
        # int64 from here on (the pools hand it out): numpy indexes by int32 slots ~4x slower
        # (a cast per fancy index), and the commit's C helpers take int64 as they are.
        slots = self.owner.alloc(ns, tier, n).astype(np.int64, copy=False)
        st = ns.slots[tier]
        if _fast is not None:          # a reservation pins its slots like a lease
            _fast.pin_slots(st.leases, slots)
        else:
            st.leases[slots] += 1      # fresh slots: distinct
        if tier is not _HOST:
            # commit writes a GPU batch through to host: make that room now, while dirty
            # blocks can still be written down before the commit.
            short = n - ns.slots[Tier.HOST].pool.free_count
            if short > 0:
                self.evict_copies(ns, Tier.HOST, short)
        rid = self.owner.new_id()
        res = Reservation(rid, ns, tier, karr, parr, slots, owner,
                          time.monotonic() + self.settings.reserve_timeout, repeats=repeats,
                          credit=credit)
        self.reservations[rid] = res
        return res

    def put_in_memory(self, namespace: str, n: int = 0, rid: int | None = None) -> bool:
        """Whether a host-tier reserve of n keys into namespace (rid None) or the commit of
        reservation rid would touch no disk now: no write-down pending, the reserve's room
        free without eviction, the commit not written through to NVMe or Redis. The caller
        holds the lock; the answer holds while it does (the server then runs the call inline
        on its loop). False where unsure: the call then runs on a thread as before."""
        if rid is not None:
            return self._commit_now(self.reservations.get(rid))
        ns = self.namespaces.get(namespace)
        return ns is not None and self._room_now(ns, n)

    def _room_now(self, ns: Namespace, n: int) -> bool:
        """put_in_memory's test for a host reserve of n keys into ns (the caller holds the
        lock): no write-down pending, the room free without eviction."""
        st = ns.slots.get(_HOST)
        return (st is not None and 0 < n <= st.pool.free_count and not self.nvme.wanted()
                and self.owner.host_used + n * ns.block_bytes <= self.settings.host_capacity)

    def _commit_now(self, res: Reservation | None) -> bool:
        """put_in_memory's test for the commit of res (the caller holds the lock): a host
        reservation, no write-down pending, not written through to NVMe or Redis."""
        return (res is not None and res.tier is _HOST and not self.nvme.wanted()
                and not (self.settings.write_policy == "write_through"
                         and (self.remote is not None or res.ns.log is not None)))

    def _take_reservation(self, rid: int, owner: int) -> Reservation:
        res = self.reservations.get(rid)
        if res is None or res.owner != owner:
            raise LeaseError(f"reservation {rid} is unknown, expired or not yours; reserve again")
        del self.reservations[rid]
        return res

    def abort(self, rid: int, owner: int = 0) -> None:
        with self.lock:
            res = self._take_reservation(rid, owner)
            self.holds.end_reservation(res, HoldState.RELEASED)

    def commit_inline(self, rid: int, owner: int, checksums: np.ndarray,
                      keys: Any = None, parents: Any = None) -> np.ndarray | None:
        """The service loop's trusted commit (Server.op_commit; the caller holds the lock):
        commit(rid, owner, checksums, trusted=True) where put_in_memory would say it touches
        no disk now (a host reservation, not written through to NVMe or Redis), else None
        with nothing done (the caller sends commit() to a thread)."""
        if not self._commit_now(self.reservations.get(rid)):
            return None
        versions = self._commit(rid, owner, checksums, True, keys=keys, parents=parents)[0]
        if self.nvme.wanted():
            self.nvme.drain()
        return versions

    def commit(self, rid: int, owner: int = 0,
               checksums: np.ndarray | None = None, trusted: bool = False,
               keys: Any = None, parents: Any = None) -> np.ndarray:
        """Phase two of a put. Returns the new version of each key (uint64). keys (and
        parents): a credit's, the keys of its first slots (``_bind``).

        Under write_through it returns once the batch is durable on NVMe and applied (a full
        or failing disk raises StorageError instead). See _commit for the checks.
        """
        versions, ns, rows, through, _ = self._commit(rid, owner, checksums, trusted,
                                                      keys=keys, parents=parents)
        if through:
            # Durable before the put is acknowledged, written with the lock released: a full
            # or failing disk fails the put (StorageError) instead of acknowledging it.
            self.nvme.flush(ns, rows, strict=True)
        elif self.nvme.wanted():
            self.nvme.drain()
        return versions

    def commit_begin(self, rid: int, owner: int = 0, checksums: np.ndarray | None = None,
                     trusted: bool = False, keys: Any = None, parents: Any = None
                     ) -> tuple[np.ndarray, FlushHandle]:
        """commit() whose write_through flush runs on the NVMe store's flush thread: returns
        the new versions at once, with a handle that completes when the batch is durable and
        applied (its wait() raises StorageError where commit() would have). The put is
        acknowledged only then: until it completes, its rows stay DIRTY and readers are served
        the committed version from memory (issue 17: a caller overlaps its next call with
        the put's writes and fdatasync). Under write_back, or without NVMe, the handle is
        complete already. Never wait for the handle holding the engine lock.

        The reservation's slots stay pinned until the handle completes: an eviction meanwhile
        (a get's room, say) passes them over instead of writing them down a second time in
        its own flush (measured: 78 of 321 gets of a 5 s rw50 job did so, 14 ms each)."""
        versions, ns, rows, through, pinned = self._commit(rid, owner, checksums, trusted,
                                                           keep_pinned=True, keys=keys,
                                                           parents=parents)

        def unpin() -> None:
            if pinned is not None:
                with self.lock:
                    self.owner.unpin_slots(ns, pinned[0], pinned[1])

        if not through:
            unpin()
            if self.nvme.wanted():
                self.nvme.drain()
            return versions, FlushHandle.completed(0)
        try:
            return versions, self.nvme.begin(ns, rows, strict=True, on_done=unpin)
        except BaseException:
            unpin()
            raise

    def _commit(self, rid: int, owner: int, checksums: np.ndarray | None, trusted: bool,
                keep_pinned: bool = False, keys: Any = None, parents: Any = None
                ) -> tuple[np.ndarray, Namespace, np.ndarray, bool,
                           tuple[Tier, np.ndarray] | None]:
        """The commit under the lock. Returns the versions by position, the namespace, the
        rows installed, whether they are to be written through to NVMe now, and the tier and
        slots left pinned (keep_pinned: the slots installed, a repeated key's earlier slots
        unpinned and freed; the caller unpins them; otherwise None).

        When checksums are given (xxh3-64 per block, as the writer computed them), a block whose
        slot does not hash to its checksum is a torn write: the whole batch is aborted and
        ChecksumError is raised, so no reader ever sees it. trusted=True records the given
        checksums without hashing the slots: a GPU worker's, hashed on the GPU from the bytes
        it copied and sent only once its copies completed (kvtier.gpu.xxh3); every later read
        from NVMe or Redis is still checked against them.
        """
        with self.lock:
            res = self._take_reservation(rid, owner)
            if res.credit or keys is not None:
                self._bind(res, keys, parents)
            ns, tier, slots, karr = res.ns, res.tier, res.slots, res.keys
            # Within one batch, the last write of a key wins; earlier duplicates are dropped.
            keep = _last_occurrences(ns.table, karr) if res.repeats else None
            if keep is not None and keep.size == karr.size:
                keep = None                   # a hash collision, no repeat
            # Every position kept (the common case) is a slice: views, not a gather per array.
            sel = slice(None) if keep is None else keep
            n_keep = karr.size if keep is None else keep.size
            host_slots = None
            try:
                given_sums = _trusted(checksums, karr.size)[sel] if trusted else None
                if tier is _HOST:
                    sums = (given_sums if trusted
                            else checksums_of(ns.slots[_HOST].pool,
                                              slots if keep is None else slots[sel]))
                else:
                    # A GPU write: written through to host; the checksum is the host copy's.
                    host_slots = self.owner.alloc(ns, Tier.HOST, n_keep)
                    ns.slots[Tier.HOST].pool.write(
                        host_slots, to_numpy(ns.slots[tier].pool.read(slots[sel])))
                    sums = (given_sums if trusted
                            else checksums_of(ns.slots[Tier.HOST].pool, host_slots))
                if checksums is not None and not trusted:
                    # (trusted: sums are the given checksums themselves, nothing to compare)
                    given = np.asarray(checksums, dtype=np.uint64).reshape(-1)
                    if given.size != karr.size or not np.array_equal(given[sel], sums):
                        from kvtier.errors import ChecksumError
                        raise ChecksumError(
                            "a reserved slot does not match its checksum (torn or overlapping "
                            "write); the batch was not committed")
            except BaseException:
                if host_slots is not None:
                    self.owner.free_slots(ns, Tier.HOST, host_slots)
                self.holds.end_reservation(res, HoldState.RELEASED)
                raise
            # (setdiff1d sorts twice: ~1 ms for 4,096 keys on the dev VM, for nothing in the
            # common case of a batch without repeats)
            dup = None if keep is None else np.setdiff1d(np.arange(karr.size), keep)
            pinned = None
            if not keep_pinned:
                self.owner.unpin_slots(ns, tier, slots)
            elif keep is None:
                pinned = (tier, slots)
            else:                             # the kept slots stay pinned, the repeats go
                pinned = (tier, slots[keep])
                self.owner.unpin_slots(ns, tier, slots[dup])
            res.state = HoldState.COMMITTED
            if dup is not None and dup.size:
                self.owner.free_slots(ns, tier, slots[dup])
            try:
                if keep is None:              # no view of each array for the whole batch
                    rows = self.owner.install(ns, karr, tier, slots, sums, res.parents,
                                              host_slots)
                else:
                    rows = self.owner.install(ns, karr[keep], tier, slots[keep], sums,
                                              None if res.parents is None else res.parents[keep],
                                              host_slots)
            except BaseException:
                # No handle will unpin what keep_pinned kept: unpin it here, as commit() had
                # before its install (rev5's review).
                if pinned is not None:
                    self.owner.unpin_slots(ns, pinned[0], pinned[1])
                # The kept slots (and a GPU write's host copies) that no row names at its
                # version go back to their pool; before rev8 they were neither installed nor
                # free until a restart. One the install placed before it raised stays.
                kk = karr if keep is None else karr[keep]
                self._unnamed_back(ns, kk, tier, slots if keep is None else slots[keep])
                if host_slots is not None:
                    self._unnamed_back(ns, kk, Tier.HOST, host_slots)
                raise
            if keep is None:
                versions_by_pos = ns.table.cols["version"][rows]
            else:
                versions_by_pos = np.zeros(karr.size, dtype=np.uint64)
                versions_by_pos[keep] = ns.table.cols["version"][rows]
                # A duplicate's version is the one its key ended with.
                versions_by_pos[dup] = ns.table.cols["version"][ns.table.lookup(karr[dup])]
            self.counters.puts += int(karr.size)
            self.counters.tiers[tier].bytes_written += int(karr.size) * ns.block_bytes
            write_through = self.settings.write_policy == "write_through"
            if write_through and self.remote is not None:
                self.transfers.push_remote(ns, rows)
        return versions_by_pos, ns, rows, write_through and ns.log is not None, pinned

    def _bind(self, res: Reservation, keys: Any, parents: Any) -> None:
        """A credit's commit: its first slots take keys (and parents), the rest go back to
        the pool. A credit committed without keys, keys sent for a reservation that has its
        own, or more keys than the credit's slots: BadRequest, and the reservation ends, as a
        torn write's commit ends it (nothing of it was ever visible)."""
        try:
            if not res.credit:
                raise BadRequest(f"reservation {res.rid} was made for its keys; its commit "
                                 "names no keys")
            if keys is None:
                raise BadRequest(f"reservation {res.rid} is a credit (reserved by count): its "
                                 "commit names the keys of its first slots")
            karr, repeats = self._put_keys(res.ns, keys)
            if karr.size > res.slots.size:
                raise BadRequest(f"{karr.size} keys for a credit of {res.slots.size} slots; "
                                 "commit at most as many keys as it holds slots")
            parr = self._put_parents(res.ns, parents, karr.size)
        except BaseException:
            self.holds.end_reservation(res, HoldState.RELEASED)
            raise
        rest = res.slots[karr.size:]
        if rest.size:
            self.owner.unpin_slots(res.ns, res.tier, rest)
            self.owner.free_slots(res.ns, res.tier, rest)
        res.keys, res.repeats, res.credit = karr.copy(), repeats, False
        res.parents = None if parr is None else parr.copy()
        res.slots = res.slots[:karr.size]

    def _unnamed_back(self, ns: Namespace, karr: np.ndarray, tier: Tier,
                      slots: np.ndarray) -> None:
        """Free those of slots (karr's, by position) that karr's row does not hold as its
        current copy in tier: a failed install's reserved slots."""
        cols = ns.table.cols
        rows = ns.table.lookup(karr)
        r = np.maximum(rows, 0)
        named = ((rows >= 0) & (cols["version"][r] > 0) & (cols["slot"][r, tier] == slots)
                 & (cols["copy_ver"][r, tier] == cols["version"][r]))
        self.owner.free_slots(ns, tier, slots[~named].astype(np.int64))

    def put(self, namespace: str, keys: Any, blocks: Any, parents: Any = None,
            tier: Tier = Tier.HOST, owner: int = 0) -> np.ndarray:
        """reserve + copy + commit, for in-process writers. blocks: n x block_bytes.

        A host put under write_back whose keys are distinct runs as one step under the lock
        (_put_inline: no reservation, no pin and unpin, the same rows, versions and counters);
        anything else, and a put that finds no room at once, goes through reserve and commit."""
        if tier is _HOST and self.settings.write_policy != "write_through":
            with self.lock:
                versions = self._put_inline(namespace, keys, blocks, parents)
            if versions is not None:
                if self.nvme.wanted():
                    self.nvme.drain()
                return versions
        res = self.reserve(namespace, keys, parents, tier, owner)
        try:
            data = _blocks_array(blocks, res.slots.size, res.ns.block_bytes)
            res.ns.slots[tier].pool.write(res.slots, data)    # reserved slots: no one else's
        except BaseException:
            self.abort(res.rid, owner)
            raise
        return self.commit(res.rid, owner)

    def _put_inline(self, namespace: str, keys: Any, blocks: Any,
                    parents: Any) -> np.ndarray | None:
        """A host put as one step (the caller holds the lock and checked the tier and the
        write policy): reserve's checks and room, the copy, commit's checksums and install.
        Nothing else sees the fresh slots before they are installed, so they are not pinned.
        None, with nothing taken, when the general path must run: a key that may repeat in
        the batch, or no room without writing dirty blocks down first."""
        ns = self.namespace(namespace)
        karr, repeats = self._put_keys(ns, keys)
        if repeats:
            return None
        parr = self._put_parents(ns, parents, karr.size)
        n = karr.size
        data = _blocks_array(blocks, n, ns.block_bytes)
        try:
            slots = self.owner.alloc(ns, _HOST, n)     # int64, as the pools hand them out
        except CapacityError:
            return None
        if parr is not None:
            # Keys none of which has a row (the replay's puts of its misses): the write,
            # checksums and install below in one C call (round 5 of the replay's CPU).
            versions = self.owner.install_new(ns, karr, parr, slots, data)
            if versions is not None:
                self.counters.puts += n
                self.counters.tiers[_HOST].bytes_written += n * ns.block_bytes
                return versions
        pool = ns.slots[_HOST].pool
        try:
            pool.write(slots, data)
            sums = checksums_of(pool, slots)
        except BaseException:
            self.owner.slots_freed(ns, _HOST, slots)
            raise
        rows = self.owner.install(ns, karr, _HOST, slots, sums, parr, None)
        self.counters.puts += n
        self.counters.tiers[_HOST].bytes_written += n * ns.block_bytes
        return ns.table.cols["version"][rows]


def _trusted(checksums: np.ndarray | None, n: int) -> np.ndarray:
    """A trusted commit's checksums, one per key."""
    given = None if checksums is None else np.asarray(checksums, dtype=np.uint64).reshape(-1)
    if given is None or given.size != n:
        raise BadRequest(f"a trusted commit carries one checksum per key ({n}); send them, or "
                         "drop trusted to have the service hash the blocks")
    return given


def checksums_of(pool: SlotPool, slots: np.ndarray) -> np.ndarray:
    """xxh3-64 of each slot's bytes, read in place (no copy)."""
    return block_checksums(pool.array, slots)


def _last_occurrences(table: PageTable, karr: np.ndarray) -> np.ndarray:
    """Positions of the last occurrence of each distinct key, ascending. The common case (no
    repeats) is settled on the 64-bit hashes alone, which is several times cheaper than sorting
    the keys."""
    h = np.sort(table._hash(karr))
    if not (h[1:] == h[:-1]).any():          # 82 us for 4,096 keys, np.unique's 305 (dev VM)
        return np.arange(karr.size)
    _, last_rev = np.unique(karr[::-1], return_index=True)
    return np.sort(karr.size - 1 - last_rev)


def _blocks_array(blocks: Any, n: int, block_bytes: int) -> np.ndarray:
    if (type(blocks) is _ndarray and blocks.dtype == _U8
            and blocks.shape == (n, block_bytes)):
        return blocks                 # already what the pool's write takes (the replay's)
    if isinstance(blocks, (list, tuple)):
        if len(blocks) != n:
            raise BadRequest(f"{len(blocks)} blocks for {n} keys")
        for b in blocks:
            if len(memoryview(b).cast("B")) != block_bytes:
                raise BadRequest(f"a block is {len(memoryview(b).cast('B'))} bytes; this "
                                 f"namespace's blocks are {block_bytes} bytes")
        return np.frombuffer(b"".join(bytes(b) for b in blocks), dtype=_U8).reshape(
            n, block_bytes)
    arr = np.asarray(blocks)
    if arr.dtype != _U8:
        arr = _contiguous(arr).view(_U8)
    if arr.size != n * block_bytes:
        raise BadRequest(f"blocks hold {arr.size} bytes; expected {n} x {block_bytes}")
    return arr.reshape(n, block_bytes)
