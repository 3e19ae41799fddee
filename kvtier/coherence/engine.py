"""The engine: the one object that applies the coherence rules to the page table and the tiers.

Lifecycle of a put (two-phase, as in vLLM's prepare_store / complete_store):

    1. reserve(ns, keys)  -> fresh slots in the host (or HBM) pool, pinned by the reservation;
                             never a slot that a reader holds
    2. the writer fills the slots (zero-copy through the shared segment, or engine.put)
    3. commit(rid)        -> checksum each slot (xxh3-64), bump each key's version, make the new
                             copy current and DIRTY; an HBM write is written through to host; older
                             copies become stale and their slots are freed, or retired until their
                             last lease goes (MVCC); under write_through the batch is flushed to
                             NVMe before commit returns

Lifecycle of a get:

    1. look the batch up (vectorised), lease the copies already in the wanted tier first
    2. bring the rest up from the highest tier that holds the current version: HBM->host copy, or
       NVMe->host copy-on-read with the checksum verified (a mismatch drops the copy, counts it,
       and is a miss)
    3. return slots, versions and checksums; the slots stay pinned until release() or the
       owner's disconnect (release_owner)

Only the engine (this module and its parts: coherence.puts, coherence.gets, coherence.eviction,
coherence.transfers, coherence.fastpath for resident gets, coherence.leases for ending holds)
and the NVMe store it owns (coherence.persist, with coherence.space; an object that sees the
engine only through persist.Coherence) write to the page table. Every public method takes the
engine lock itself, so the server may call them from worker threads; disk I/O never runs on the
asyncio loop, and never under the engine lock: an NVMe read, a flush, a reclaim and an LMDB
commit are decided and pinned under it, run without it, and applied under it with versions
checked (docs/DESIGN-NOTES.md, "NVMe in steady state"). A write_through put returns once its
flush is durable, and raises StorageError when it cannot be.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvtier.checksums import XXH3_ADDRESS as _XXH3
from kvtier.coherence import admission, reserve
from kvtier.coherence.namespace import (EngineCounters, Lease, Namespace,
                                        Reservation, SlotState, add_one)
from kvtier.coherence.eviction import Eviction
from kvtier.coherence.fastpath import FastPath
from kvtier.coherence.gets import Gets, _refuse_zero_key
from kvtier.coherence.leases import Holds
from kvtier.coherence.policies import POLICIES
from kvtier.coherence.puts import Puts
from kvtier.coherence.persist import NvmeStore
from kvtier.coherence.transfers import Transfers, remote_from_settings
from kvtier.coherence.states import (BlockState, Event, next_states,
                                     transition_array)
from kvtier.config import Settings
from kvtier.errors import (BadRequest, CapacityError, NamespaceError,
                           StorageError)
from kvtier.pagetable.store import Catalog, NamespaceRecord, check_writable
from kvtier.pagetable.table import PageTable, tier_masks
from kvtier.tiers.host import SlotPool
from kvtier.tiers.nvme import Backend, make_backend
from kvtier.types import SERVE_ORDER, Tier

try:        # the C helper (setup.py builds it where a compiler is present); numpy otherwise
    from kvtier.coherence import _fast
except ImportError:
    _fast = None
try:        # set_copy's and touch's writes in one call each (_gets.c); numpy otherwise
    from kvtier.coherence._gets import set_copies as _set_copies
    from kvtier.coherence._gets import touch_rows as _touch_rows
except ImportError:
    _set_copies = _touch_rows = None

log = logging.getLogger("kvtier.engine")
PoolFactory = Callable[[str, int, int], SlotPool]
MAX_BLOCK_BYTES = 1 << 30
MAX_KEY_WIDTH = 64
EPOCH_BITS = 32             # versions of one run: below (epoch + 1) << EPOCH_BITS
_LOCAL_TIERS = tuple(t for t in SERVE_ORDER if t is not Tier.REMOTE)
_MEMORY_TIERS = (Tier.HBM, Tier.HOST)
_PREFIX_MASKS = tier_masks(_LOCAL_TIERS, _MEMORY_TIERS)     # lookup_prefix's, made once
_COMMIT_NEXT = transition_array(Event.COMMIT)    # looked up once: an Enum hashes in Python
# The put path's tiers as module names: Python 3.11's EnumType defines __getattr__, so every
# Tier.HOST read on the class goes through a slot hook (~0.2 us against a global's ~0.02).
_HOST, _HBM = Tier.HOST, Tier.HBM
_HOST_NUM = int(Tier.HOST)


# numpy names the hot paths read as globals (why: kvtier.pagetable.table, at _empty).
_U64, _I64, _contiguous = np.uint64, np.int64, np.ascontiguousarray


class Engine:
    """The coherence engine of one data directory. See the module docstring for the rules."""

    def __init__(self, settings: Settings, hbm_pool_factory: PoolFactory | None = None,
                 nvme_backend: Backend | None = None, remote: Any = None) -> None:
        self.settings = settings
        self.data_dir = Path(settings.data_dir)
        check_writable(self.data_dir)
        _refuse_links(self.data_dir)
        self.lock = threading.RLock()
        self.catalog = Catalog(self.data_dir / "meta")
        self.backend = nvme_backend or make_backend("auto")
        self.hbm_pool_factory = hbm_pool_factory if settings.hbm_capacity > 0 else None
        self.counters = EngineCounters()
        self.namespaces: dict[str, Namespace] = {}
        # The holds part owns the tables of leases and reservations and ends them; its public
        # methods are the engine's, bound once (no hop per release on the latency path).
        self.holds = Holds(self.lock, self.counters, self)
        self.reservations: dict[int, Reservation] = self.holds.reservations
        self.leases: dict[int, Lease] = self.holds.leases
        self.release = self.holds.release
        self.release_many = self.holds.release_many
        self.release_owner = self.holds.release_owner
        self.reap = self.holds.reap
        # The fast path leases resident gets (the latency figures): its two public methods
        # are the engine's, bound once.
        self.fast = FastPath(self.lock, self.namespace, self.leases, self.counters, settings,
                             self)
        self.lease_one = self.fast.lease_one
        self.try_get_resident = self.fast.try_get_resident
        self._next_id = 1
        self.clock = 0
        self.host_used = 0       # bytes of host slots in use, all namespaces
        self.started = time.time()
        self.policies = {t: POLICIES[settings.policy_for(t.label)]
                         for t in (Tier.HBM, Tier.HOST, Tier.NVME)}
        self.remote = remote if remote is not None else remote_from_settings(settings)
        self.nvme = NvmeStore(self, self.catalog, settings, self.counters, self.backend)
        # Eviction owns the tiers' policy objects; its methods are bound under the names the
        # engine's paths call them by (one attribute lookup, as when it was a mixin).
        self.eviction = Eviction(self.lock, settings, self.counters, self.namespaces,
                                 self.namespace, self.nvme, self)
        self.evict = self.eviction.evict
        self.forget_empty = self.eviction.forget_empty          # persist.Coherence
        self._evict = self.eviction.evict_copies
        self._evict_other_namespaces = self.eviction.evict_other_namespaces
        self._tier_policy = self.eviction.tier_policy
        self._placed = self.eviction.placed
        self.transfers = Transfers(self.lock, settings, self.counters, self.namespaces,
                                   self.namespace, self.nvme, self.remote, self)
        self.prefetch_after = self.transfers.prefetch_after
        self.wants_prefetch = self.transfers.wants_prefetch
        self.stage = self.transfers.stage
        self.gets = Gets(self.lock, settings, self.counters, self.namespaces, self.namespace,
                         self.leases, self.release, self.fast, self.transfers, self.nvme,
                         self.remote, self)
        self.get = self.gets.get
        self.drive = self.gets.drive
        self.get_steps = self.gets.get_steps
        self.try_get = self.gets.try_get
        self.looks_resident = self.gets.looks_resident
        self.read = self.gets.read
        # Puts: reserve, commit and abort (the two phases), put in process; bound once.
        self.puts = Puts(self.lock, settings, self.counters, self.namespaces, self.namespace,
                         self.holds, self._evict, self.nvme, self.transfers, self.remote, self)
        self.reserve = self.puts.reserve
        self.abort = self.puts.abort
        self.commit = self.puts.commit
        self.put = self.puts.put
        self.put_in_memory = self.puts.put_in_memory
        self._start_epoch()
        for rec in self.catalog.namespaces():
            ns = self._open_namespace(rec)
            self.nvme.load(ns)

    # ------------------------------------------------------------------ version epochs

    def _start_epoch(self) -> None:
        """Versions keep rising per key across deletes, evictions and restarts. Each start
        takes the next epoch (one LMDB write): every put of this run gives a version above
        epoch x 2^32, which is above every version given out in earlier runs (a run that
        reaches its ceiling takes another epoch first), including those a crash lost before
        they were flushed. Within a run a rewrite is +1, and a key put again after it was
        removed starts above the table's version_floor. So a version number a client or the
        remote tier still holds never matches a new block."""
        epoch = self.catalog.meta("version_epoch")
        self.epoch = epoch if isinstance(epoch, int) and epoch >= 0 else 0
        self.catalog.set_meta("version_epoch", self.epoch + 1)
        self.version_ceiling = (self.epoch + 1) << EPOCH_BITS

    def _next_epoch(self, top: int) -> None:
        """A version reached this run's ceiling (2^32 puts of one key): later runs must start
        above it. Written under the lock, once per 2^32 puts."""
        self.epoch = max(self.epoch + 1, top >> EPOCH_BITS)
        self.catalog.set_meta("version_epoch", self.epoch + 1)
        self.version_ceiling = (self.epoch + 1) << EPOCH_BITS

    # ------------------------------------------------------------------ namespaces

    def _open_namespace(self, rec: NamespaceRecord) -> Namespace:
        s = self.settings
        # Bounded for namespaces made before max_host_slots existed (admission.host_slots).
        host_slots = min(s.host_capacity // rec.block_bytes, s.max_host_slots)
        slots = {Tier.HOST: SlotState.for_pool(
            SlotPool(f"{rec.name}/host", rec.block_bytes, host_slots))}
        if self.hbm_pool_factory is not None and s.hbm_capacity >= rec.block_bytes:
            pool = self.hbm_pool_factory(f"{rec.name}/hbm", rec.block_bytes,
                                         self._hbm_slots(rec))
            slots[Tier.HBM] = SlotState.for_pool(pool)
        ns = Namespace(rec.name, rec.ns_id, rec.block_bytes, rec.key_width, rec.layout,
                       PageTable(rec.key_width), slots, self.nvme.open_log(rec))
        ns.table.version_floor = self.epoch << EPOCH_BITS
        self.namespaces[rec.name] = ns
        return ns

    def _hbm_slots(self, rec: NamespaceRecord) -> int:
        """The namespace's HBM pool size: hbm_capacity, or under hbm_reserve = history the
        alpha-weighted peaks of earlier runs (coherence.reserve)."""
        cap = self.settings.hbm_capacity // rec.block_bytes
        if self.settings.hbm_reserve != "history":
            return cap
        peaks = self.catalog.meta(f"hbm_peaks:{rec.ns_id}")
        peaks = [int(p) for p in peaks] if isinstance(peaks, list) else []
        return reserve.pool_slots(peaks, self.settings.hbm_reserve_alpha, cap)

    def _record_hbm_demand(self) -> None:
        """Add this run's peak HBM demand to each namespace's history. Metadata that only
        sizes the next run's pool: a failed write is logged and the close goes on."""
        for ns in self.namespaces.values():
            st = ns.slots.get(Tier.HBM)
            if st is None:
                continue
            key = f"hbm_peaks:{ns.ns_id}"
            old = self.catalog.meta(key)
            try:
                self.catalog.set_meta(key, reserve.record(
                    old if isinstance(old, list) else [], st.peak_demand))
            except StorageError as exc:
                log.warning("HBM demand of %s not recorded (%s); the next run sizes its pool "
                            "from the older history", ns.name, exc)

    def create_namespace(self, name: str, block_bytes: int, key_width: int = 16,
                         layout: dict[str, Any] | None = None) -> dict[str, Any]:
        """Create a namespace, or return the existing one when the layout matches."""
        if not isinstance(name, str) or not 0 < len(name) <= 200 or not name.isprintable():
            raise NamespaceError("a namespace name is 1 to 200 printable characters, "
                                 f"got {name!r}")
        if not isinstance(block_bytes, int) or not 0 < block_bytes <= MAX_BLOCK_BYTES:
            raise BadRequest(f"block_bytes must be 1..{MAX_BLOCK_BYTES}, got {block_bytes!r}")
        if not isinstance(key_width, int) or not 0 < key_width <= MAX_KEY_WIDTH:
            raise BadRequest(f"key_width must be 1..{MAX_KEY_WIDTH}, got {key_width!r}")
        if block_bytes > self.settings.host_capacity:
            raise CapacityError(f"block_bytes {block_bytes} exceeds host_capacity "
                                f"{self.settings.host_capacity}; raise host_capacity")
        # None: the caller states no layout (accepted); a given one must match (check_layout).
        claimed = None if layout is None else admission.layout(layout)
        with self.lock:
            ns = self.namespaces.get(name)
            if ns is not None:
                if ns.block_bytes != block_bytes or ns.key_width != key_width:
                    raise NamespaceError(
                        f"namespace {name!r} exists with block_bytes={ns.block_bytes}, "
                        f"key_width={ns.key_width}; use another name for another layout")
                ns.check_layout(claimed)
                return ns.info()
            admission.namespace_count(len(self.namespaces), self.settings.max_namespaces)
            admission.host_slots(block_bytes, self.settings.host_capacity,
                                 self.settings.max_host_slots,
                                 sum(n.slots[Tier.HOST].pool.n_slots
                                     for n in self.namespaces.values()),
                                 self.settings.max_slot_metadata)
            rec = self.catalog.add_namespace(name, block_bytes, key_width, claimed or {})
            return self._open_namespace(rec).info()

    def namespace(self, name: str) -> Namespace:
        ns = self.namespaces.get(name)
        if ns is None:
            raise NamespaceError(f"unknown namespace {name!r}; create it first")
        return ns

    # ------------------------------------------------------------------ slots

    def alloc(self, ns: Namespace, tier: Tier, n: int, partial: bool = False) -> np.ndarray:
        """n fresh slots in ns's pool of tier, evicting if needed. Raises CapacityError, or
        with partial=True returns as many as could be had (possibly none)."""
        st = ns.slots.get(tier)
        if st is None:
            raise BadRequest(f"namespace {ns.name!r} has no {tier.label} tier"
                             + ("; set hbm_capacity on a CUDA host" if tier is _HBM else ""))
        if n > st.pool.n_slots and not partial:
            raise CapacityError(f"a batch of {n} blocks does not fit the {tier.label} tier of "
                                f"{ns.name!r} ({st.pool.n_slots} slots); send smaller batches "
                                f"or raise {tier.label}_capacity")
        need_budget = tier is _HOST
        if tier is _HBM:
            st.peak_demand = max(st.peak_demand, st.pool.n_slots - st.pool.free_count + n)
        self.make_room(ns, tier, n)
        if partial:
            n = min(n, st.pool.free_count)
            if need_budget:
                n = min(n, (self.settings.host_capacity - self.host_used) // ns.block_bytes)
            n = max(n, 0)
        slots = st.pool.alloc(n)
        if slots is None or (need_budget and self.host_used + n * ns.block_bytes
                             > self.settings.host_capacity):
            if slots is not None:
                st.pool.free(slots)
            raise CapacityError(
                f"the {tier.label} tier of {ns.name!r} has no room for {n} blocks: every slot "
                "is leased, reserved or dirty; release leases, flush, or raise "
                f"{tier.label}_capacity")
        if need_budget:
            self.host_used += n * ns.block_bytes
        return slots

    def room_short(self, ns: Namespace, tier: Tier, n: int) -> int:
        """How many blocks make_room(ns, tier, n) would evict now (<= 0: none): the slots
        missing from the pool's free ones, or for the host tier the blocks over
        host_capacity, whichever is more. Either grows by one with each of n."""
        short = n - ns.slots[tier].pool.free_count
        if tier is _HOST:
            over = self.host_used + n * ns.block_bytes - self.settings.host_capacity
            over = -(-over // ns.block_bytes)
            if over > short:
                short = over
        return short

    def make_room(self, ns: Namespace, tier: Tier, n: int) -> None:
        """Evict until n slots of ns's pool of tier are free and, for the host tier, within
        host_capacity (as far as eviction can: alloc says what is missing)."""
        short = self.room_short(ns, tier, n)
        if short > 0:
            if self.leases or self.reservations:     # reap's own test, without its frame
                self.reap()
            self._evict(ns, tier, short)
            if tier is _HOST and len(self.namespaces) > 1:   # only others hold host bytes
                self._evict_other_namespaces(ns, n)

    def free_slots(self, ns: Namespace, tier: Tier, slots: np.ndarray) -> None:
        """Return slots to their pool, or retire the leased ones until their last release."""
        if slots.size == 0:
            return
        st = ns.slots[tier]
        self._tier_policy(ns, tier).on_remove(slots)
        st.slot_row[slots] = -1
        leased = st.leases[slots] > 0
        st.retired[slots[leased]] = True
        free = slots[~leased]
        self.slots_freed(ns, tier, free)

    def slots_freed(self, ns: Namespace, tier: Tier, slots: np.ndarray) -> None:
        """Slots nothing pins any more go back to their pool, and the host budget with them
        (with slots_pushed, the only places both change)."""
        ns.slots[tier].pool.free(slots)
        if tier is _HOST:
            self.host_used -= slots.size * ns.block_bytes

    def slots_pushed(self, ns: Namespace, tier: Tier, k: int, low: int) -> None:
        """slots_freed for k slots a C helper pushed onto the pool's stack itself
        (_fast.evict_slots), whose top is now low."""
        ns.slots[tier].pool.pushed(low)
        if tier is _HOST:
            self.host_used -= k * ns.block_bytes

    def _unpin(self, ns: Namespace, tier: Tier, slots: np.ndarray) -> None:
        st = ns.slots[tier]
        if _fast is not None:
            slots = np.ascontiguousarray(slots, dtype=np.int64)
            gone = np.empty(slots.size, dtype=np.int64)
            k = _fast.unpin_slots(st.leases, st.retired, slots, gone)
            if k:
                # sorted, as np.unique leaves them on the numpy path
                self.slots_freed(ns, tier, gone[:k] if k == 1 else np.sort(gone[:k]))
            return
        add_one(st.leases, slots, -1)
        gone = slots[(st.leases[slots] == 0) & st.retired[slots]]
        if gone.size:
            gone = np.unique(gone)
            st.retired[gone] = False
            self.slots_freed(ns, tier, gone)

    def drop_copies(self, ns: Namespace, rows: np.ndarray, tier: Tier,
                     slots: np.ndarray | None = None) -> None:
        """Forget rows' copies in a slot tier (freeing or retiring their slots). Rows are
        distinct. With the C helper: two calls around the policy's on_remove. ``slots``: the
        rows' slots in tier, when the caller knows each row holds its copy there (eviction's
        victims: the policy's own slots), so they need not be looked up."""
        cols = ns.table.cols
        if _fast is not None:
            rows = np.ascontiguousarray(rows, dtype=np.int64)
            if slots is None:
                held = np.empty(rows.size, dtype=np.int64)
                k = _fast.copy_slots(cols["copy_ver"], cols["slot"], rows, int(tier), held)
                if k == 0:
                    return
                slots = held[:k]
            elif slots.size == 0:
                return
            self._tier_policy(ns, tier).on_remove(slots)
            st = ns.slots[tier]
            free = np.empty(rows.size, dtype=np.int64)
            k = _fast.release_copies(cols["copy_ver"], cols["slot"], st.slot_row, st.leases,
                                     st.retired, rows, int(tier), free)
            if k:
                self.slots_freed(ns, tier, free[:k])
            return
        has = rows[cols["copy_ver"][rows, tier] > 0]
        if has.size:
            self.free_slots(ns, tier, cols["slot"][has, tier].astype(np.int64))
            cols["slot"][has, tier] = -1
            cols["copy_ver"][has, tier] = 0

    # ------------------------------------------------------------------ for the NVMe store
    # (coherence.persist.Coherence: all that NvmeStore may call; the caller holds the lock)

    def pin_slots(self, ns: Namespace, tier: Tier, slots: np.ndarray) -> None:
        add_one(ns.slots[tier].leases, slots)

    def unpin_slots(self, ns: Namespace, tier: Tier, slots: np.ndarray) -> None:
        if slots.size:
            self._unpin(ns, tier, slots)

    # ------------------------------------------------------------------ put

    def check_keys(self, ns: Namespace, keys: Any, zero_check: bool = True) -> np.ndarray:
        """A batch of keys of ns, packed: refuses an empty batch and (zero_check) the all-zero
        key."""
        karr = ns.table.keys_array(keys)
        if karr.size == 0:
            raise BadRequest("empty key batch; send at least one key")
        if zero_check:
            _refuse_zero_key(karr)
        return karr

    def install(self, ns: Namespace, karr: np.ndarray, tier: Tier, slots: np.ndarray,
                 sums: np.ndarray, parents: np.ndarray | None,
                 host_slots: np.ndarray | None) -> np.ndarray:
        table = ns.table
        cols = table.cols
        rows, created, made = table.insert_counted(karr)
        if made < karr.size:              # rows just made hold no copy anywhere (keys distinct)
            for t in list(ns.slots):
                self.drop_copies(ns, rows, t)
        if _fast is None and created.any():
            cols["version"][rows[created]] = table.version_floor
        # A row restart brought back (or the remote tier filled) holds a version of an earlier
        # run, which may have gone on past it unflushed: its next version is above them all.
        if _fast is not None:
            top = self._install_native(ns, rows, created, tier, slots, sums)
        else:
            cols["version"][rows] = np.maximum(cols["version"][rows],
                                               np.uint64(self.epoch << EPOCH_BITS)) + np.uint64(1)
            cols["leases"][rows] = 0      # readers of the old version hold old slots, not this
            cols["size"][rows] = ns.block_bytes
            cols["checksum"][rows] = sums
            cols["state"][rows] = next_states(cols["state"][rows], Event.COMMIT)
            self.touch(ns, rows)         # before the copies are placed: a policy counts from here
            top = int(cols["version"][rows].max())
            self.set_copy(ns, rows, tier, slots, cols["version"][rows])
        if top >= self.version_ceiling:
            self._next_epoch(top)
        if host_slots is not None:
            ver = cols["version"][rows]
            self.set_copy(ns, rows, Tier.HOST, host_slots, ver)
        if parents is not None:
            # The all-zero parent (none) is never a row: puts refuse the zero key.
            table.link_keys(rows, parents)
        return rows

    def _install_native(self, ns: Namespace, rows: np.ndarray, created: np.ndarray, tier: Tier,
                        slots: np.ndarray, sums: np.ndarray) -> int:
        """_install's columns in one C call: versions (above the floor for new rows, above
        this run's epoch), readers reset, size, checksum, the COMMIT transition, the touch
        (before the copies are placed: a policy counts from here) and the copy in tier; then
        the policy is told. Returns the highest new version."""
        c = ns.table.cols
        st = ns.slots[tier]
        n = rows.size
        top = _fast.install_rows(
            c["version"], c["leases"], c["size"], c["checksum"], c["state"], c["last_access"],
            c["prev_access"], c["freq"], c["slot"], c["copy_ver"], st.slot_row, rows,
            # rows, created and slots as the commit made them (int64, bool, int64: the
            # table's insert and the reservation), sums possibly a caller's trusted array
            created, slots, _contiguous(sums, dtype=_U64), _COMMIT_NEXT,
            int(tier), ns.table.version_floor, self.epoch << EPOCH_BITS, self.clock,
            ns.block_bytes)
        if top < 0:
            next_states(c["state"][rows], Event.COMMIT)      # raises IllegalTransition
        self.clock += n
        # _placed, without its two frames where the tier's policy exists already
        (st.policy or self._tier_policy(ns, tier)).on_insert(rows, slots)
        return top

    def install_new(self, ns: Namespace, karr: np.ndarray, parents: np.ndarray,
                    slots: np.ndarray, data: np.ndarray) -> np.ndarray | None:
        """A host put's write, checksums and install when none of its keys has a row, in one
        C call (PageTable.put_new): the same columns, pool bytes, clock, epoch and policy
        notice as the pool's write, checksums_of and install with these parents; the new
        versions. None, with nothing written, otherwise (or without libxxhash or the C
        helper): the caller takes that way."""
        if _XXH3 is None:
            return None
        st = ns.slots[_HOST]
        try:
            got = ns.table.put_new(karr, parents, st.slot_row, st.pool.array, data, slots,
                                   _XXH3, _COMMIT_NEXT, _HOST_NUM, self.epoch << EPOCH_BITS,
                                   self.clock, ns.block_bytes)
        except BaseException:
            self.slots_freed(ns, _HOST, slots)   # put_rows checks everything before it writes
            raise
        if got is None:
            return None
        rows, versions, top = got
        self.clock += rows.size
        (st.policy or self._tier_policy(ns, _HOST)).on_insert(rows, slots)
        if top >= self.version_ceiling:
            self._next_epoch(top)
        return versions

    def set_copy(self, ns: Namespace, rows: np.ndarray, tier: Tier, slots: np.ndarray,
                  versions: np.ndarray) -> None:
        """rows' copies in tier are now versions in slots (rows distinct, slots fresh or
        theirs), and the tier's policy is told. The writes in one C call where _gets is built
        (every NVMe get's install: three fancy assignments were ~18 us of a ~100 us step on
        the dev VM, issue 17's stall, stall9), numpy's otherwise: the same state
        (tests/test_transfers.py)."""
        cols = ns.table.cols
        st = ns.slots[tier]
        if _set_copies is not None:
            _set_copies(cols["slot"], cols["copy_ver"], st.slot_row, _contiguous(rows, _I64),
                        int(tier), _contiguous(slots, _I64), _contiguous(versions, _U64))
        else:
            cols["slot"][rows, tier] = slots
            cols["copy_ver"][rows, tier] = versions
            st.slot_row[slots] = rows
        # _placed, without its two frames where the tier's policy exists already
        (st.policy or self._tier_policy(ns, tier)).on_insert(rows, slots)

    def placed(self, ns: Namespace, tier: Tier, rows: np.ndarray, slots: np.ndarray) -> None:
        """The tier's policy told of rows' copies now in slots (their columns written by the
        caller: _gets.c install_shares), as set_copy tells it."""
        st = ns.slots[tier]
        (st.policy or self._tier_policy(ns, tier)).on_insert(rows, slots)

    def touch(self, ns: Namespace, rows: np.ndarray) -> None:
        """An access of rows, in batch order: the clock advances by one per row (a repeated
        row: its last position's stamp, its freq counted once). One C call where _gets is
        built (every get's lease: ~15 us of numpy calls, stall9), numpy's otherwise."""
        cols = ns.table.cols
        n = rows.size
        if _touch_rows is not None:
            _touch_rows(cols["last_access"], cols["prev_access"], cols["freq"],
                        _contiguous(rows, _I64), self.clock)
        else:
            cols["prev_access"][rows] = cols["last_access"][rows]
            cols["last_access"][rows] = np.arange(self.clock + 1, self.clock + n + 1,
                                                  dtype=np.uint64)
            cols["freq"][rows] += 1
        self.clock += n

    # ------------------------------------------------------------------ get

    def match_prefix(self, namespace: str, keys: Any) -> int:
        """How many leading keys have a current copy in some tier."""
        return self.lookup_prefix(namespace, keys)[0]

    def lookup_prefix(self, namespace: str, keys: Any) -> tuple[int, int]:
        """(n, below): n leading keys have a current copy in some tier (match_prefix), and
        ``below`` of those n have none in memory (HBM or host): a get of them reads NVMe or
        Redis. Memory only, except the remote tier's existence check."""
        with self.lock:
            ns = self.namespace(namespace)
            karr = ns.table.keys_array(keys)
            n, below = ns.table.current_prefix(karr, _LOCAL_TIERS, _MEMORY_TIERS,
                                               _PREFIX_MASKS)
            if self.remote is not None and n < karr.size:
                there = self.remote.exists_many(ns.name, [bytes(k) for k in karr[n:]])
                gap = np.flatnonzero(~there)
                more = int(gap[0]) if gap.size else int(there.size)
                n, below = n + more, below + more
            return n, below

    def delete(self, namespace: str, keys: Any) -> int:
        """Forget keys in every tier (LMDB included). Leased slots are freed on release."""
        with self.lock:
            ns = self.namespace(namespace)
            karr = self.check_keys(ns, keys)
            if self.remote is not None:
                self.remote.delete_many(ns.name, [bytes(k) for k in karr])
            rows = ns.table.lookup(karr)
            rows = np.unique(rows[rows >= 0])
            if rows.size == 0:
                return 0
            for t in list(ns.slots):
                self.drop_copies(ns, rows, t)
            gone = self.nvme.forget(ns, rows)
            next_states(ns.table.cols["state"][rows], Event.DELETE)
            ns.table.remove(rows)
        self.nvme.delete_records(ns, gone)          # LMDB, with the lock released
        return int(rows.size)

    def flush(self, namespace: str | None = None, strict: bool = True) -> int:
        """Write every dirty version to NVMe and LMDB. Returns the blocks flushed.

        strict (an explicit flush): StorageError unless every block that was dirty when the
        flush began is on NVMe, so that an acknowledged flush means what it says. The
        service's background flush passes strict=False and leaves the rest for next time."""
        with self.lock:
            targets = [self.namespace(namespace)] if namespace else list(self.namespaces.values())
            if self.remote is not None:
                for ns in targets:
                    c = ns.table.cols
                    n = ns.table.n_rows
                    self.transfers.push_remote(ns, np.flatnonzero(
                        (c["version"][:n] > 0) & (c["copy_ver"][:n, Tier.REMOTE]
                                                  < c["version"][:n])))
        return sum(self.nvme.flush(ns, None, strict) for ns in targets)

    def entry(self, namespace: str, key: bytes) -> dict[str, Any] | None:
        with self.lock:
            ns = self.namespace(namespace)
            if len(key) != ns.key_width:
                raise BadRequest(f"key is {len(key)} bytes; namespace {namespace!r} uses "
                                 f"{ns.key_width}-byte keys")
            row = int(ns.table.lookup(key)[0])
            if row < 0 or ns.table.cols["version"][row] == 0:
                return None
            e = ns.table.entry(row)
            return {"key": e.key.hex(), "version": e.version, "size": e.size,
                    "checksum": f"{e.checksum:016x}", "state": BlockState(e.state).name.lower(),
                    "dirty": e.state == BlockState.DIRTY, "copies": e.copies, "leases": e.leases,
                    "parent": e.parent.hex() if e.parent else None,
                    "children": [c.hex() for c in e.children],
                    "policy": {"last_access": e.last_access, "prev_access": e.prev_access,
                               "freq": e.freq}}

    def stats(self) -> dict[str, Any]:
        from kvtier.coherence.report import engine_stats
        with self.lock:
            return engine_stats(self)

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def close(self, flush: bool = True) -> None:
        """Flush dirty blocks (unless told not to), then close segments and LMDB."""
        if flush:
            self.flush(strict=False)
        self.nvme.flushes.close()       # begun flushes first: their thread takes the lock
        with self.lock:
            self._record_hbm_demand()
            self.nvme.close()
            for ns in self.namespaces.values():
                for st in ns.slots.values():
                    st.pool.close()
            self.namespaces.clear()
            self.catalog.close()
            if self.remote is not None:
                self.remote.close()


def _refuse_links(data_dir: Path) -> None:
    """The service's own paths must not lead out of the data directory: a symlink planted at
    meta/, nvme/, run/ or a namespace's segment directory would send writes elsewhere."""
    from kvtier.errors import DataDirError
    root = data_dir.resolve()
    candidates = [data_dir / "meta", data_dir / "nvme", data_dir / "run", data_dir / "admin.token"]
    nvme = data_dir / "nvme"
    if nvme.is_dir() and not nvme.is_symlink():
        candidates += list(nvme.iterdir())
    for p in candidates:
        if p.is_symlink() or (p.exists() and not p.resolve().is_relative_to(root)):
            raise DataDirError(f"{p} is a symbolic link; kvtier does not follow links out of "
                               "its data directory: replace it with a real directory")
