"""Eviction: the part of the engine that drops copies from a tier to make room (the caller holds
the engine lock, except for evict, which takes it itself).

A tier drops a copy only when the copy is clean or a lower tier holds the same version; a dirty
sole copy is written one tier down first (a demotion: HBM -> host, host -> NVMe). In a slot tier
(HBM, host) the victims come from the tier's policy object (coherence.policies.queues), which the
engine keeps informed through three calls: _placed (a copy was set in a slot), on_remove (a slot
is freed) and victims/give_back here, so that choosing n victims costs O(n) whatever the number of
resident blocks. Writing down can evict, in the tier below, the copy that covered another one
here, so eviction takes victims in rounds until it has enough or the policy has none left.

Interface. Owns: each slot tier's policy object (made on first use, kept in SlotState.policy).
Public: evict (admin eviction; the engine's method of that name is this, bound), evict_copies,
evict_other_namespaces, tier_policy, placed, forget_empty (the engine binds them under its own
names). Calls: the engine's slot ops through ``SlotOwner`` (alloc, set_copy, drop_copies,
slots_freed, slots_pushed, and the host budget it reads), the NVMe store's write_down and
whole-segment evict, the settings (the policy per tier), the counters and the namespaces.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvtier.coherence.policies import POLICIES, TierPolicy, make_tier_policy
from kvtier.coherence.states import BlockState, Event, next_states, transition_array
from kvtier.coherence.namespace import to_numpy as _to_numpy
from kvtier.tiers.slots import SlotStack
from kvtier.types import Tier, lower_tiers

try:        # the C helper (setup.py builds it where a compiler is present); numpy otherwise
    from kvtier.coherence import _fast
except ImportError:
    _fast = None
try:        # the covered check of the victims in one call (_gets.c victims_covered)
    from kvtier.coherence._gets import victims_covered as _victims_covered
except ImportError:
    _victims_covered = None

if TYPE_CHECKING:
    from kvtier.coherence.namespace import EngineCounters, Namespace, SlotState
    from kvtier.config import Settings

_LOST_NEXT = transition_array(Event.LOST)    # looked up once: an Enum hashes in Python
_NVME, _CLEAN = int(Tier.NVME), int(BlockState.CLEAN)
# Looked up once: lower_tiers searches SERVE_ORDER, and Tier.NVME read on the class goes
# through EnumType's __getattr__ (~0.2 us in Python 3.11); evict_copies asks on every put.
_LOWER = {t: lower_tiers(t) for t in Tier}
_NVME_TIER = Tier.NVME


# numpy names the hot paths read as globals (why: kvtier.pagetable.table, at _empty).
_I64, _contiguous, _empty = np.int64, np.ascontiguousarray, np.empty


class SlotOwner(Protocol):
    """What eviction needs of the engine's slot tiers (the caller holds the lock)."""

    host_used: int               # bytes of host slots in use, all namespaces

    def alloc(self, ns: Namespace, tier: Tier, n: int, partial: bool = False) -> np.ndarray: ...
    def set_copy(self, ns: Namespace, rows: np.ndarray, tier: Tier, slots: np.ndarray,
                 versions: np.ndarray) -> None: ...
    def drop_copies(self, ns: Namespace, rows: np.ndarray, tier: Tier,
                    slots: np.ndarray | None = None) -> None: ...
    def slots_freed(self, ns: Namespace, tier: Tier, slots: np.ndarray) -> None: ...
    def slots_pushed(self, ns: Namespace, tier: Tier, k: int, low: int) -> None: ...


class Eviction:
    def __init__(self, lock: threading.RLock, settings: Settings, counters: EngineCounters,
                 namespaces: dict[str, Namespace], namespace: Any, nvme: Any,
                 slots: SlotOwner) -> None:
        self.lock, self.settings, self.counters = lock, settings, counters
        # namespace: by name, raising NamespaceError (the engine's); nvme: its write_down, and
        # space.evict for the NVMe tier.
        self.namespaces, self.namespace, self.nvme = namespaces, namespace, nvme
        self.slots = slots
        self._scratch = np.empty(0, dtype=np.int64)    # _evict_lowest's rows and drops

    def tier_policy(self, ns: Namespace, tier: Tier) -> TierPolicy:
        """The policy state of one slot tier of ns, made on first use (from the copies already
        there, in slot order, should any exist)."""
        st = ns.slots[tier]
        if st.policy is None:
            label = tier.label
            name = self.settings.policy_for(label)
            instead = POLICIES[name].under_hbm
            if (tier is Tier.HOST and Tier.HBM in ns.slots and instead
                    and not self.settings.eviction_host):
                name = instead
            st.policy = make_tier_policy(name, st, ns.table, self.settings.policy_params(label))
            held = np.flatnonzero(st.slot_row >= 0)
            if held.size:
                st.policy.on_insert(st.slot_row[held], held)
        return st.policy

    def placed(self, ns: Namespace, tier: Tier, rows: np.ndarray, slots: np.ndarray) -> None:
        """Copies of rows now live in slots of a slot tier (the engine's set_copy)."""
        self.tier_policy(ns, tier).on_insert(rows, slots)

    def evict_copies(self, ns: Namespace, tier: Tier, n: int) -> int:
        """Drop up to n copies from a slot tier of ns, in the order of its policy.

        Eligible: unleased copies that are clean, or whose version a lower tier also holds, or
        that live in the lowest configured tier (a cache may forget what it cannot write back).
        The policy's victims that are the sole copy of their version are written one tier down
        first (a demotion); those that cannot be are set aside, and handed back to the policy
        when the eviction ends.
        """
        if n <= 0:
            return 0
        st = ns.slots[tier]
        policy = st.policy or self.tier_policy(ns, tier)    # (tier_policy's frame when made)
        cols = ns.table.cols
        lowers = []                     # (a list comprehension is a frame of its own in 3.11)
        mask = 0                        # lowers as a bit mask of tier indices, for the C check
        for t in _LOWER[tier]:
            if t in ns.slots or (t is _NVME_TIER and ns.log):
                lowers.append(t)
                mask |= 1 << t
        done = 0
        if not lowers and _fast is not None:
            # The lowest tier (a replay's host tier without NVMe): every victim goes as it is,
            # nothing is written down or set aside, so the policy forgets them as it hands
            # them out (drop: no on_remove after).
            victims = policy.victims
            while done < n:
                slots = victims(n - done, True)
                if slots.size == 0:
                    break
                done += self._evict_lowest(ns, tier, st, slots, None)
            return done
        held: list[np.ndarray] = []      # victims that could not be written down: kept aside
        # The usual case (clean copies, a lower tier holding their version: an NVMe get's room
        # step on the H200 host, ~100 us, of which this eviction was ~3/4) told by one C call
        # and dropped by the lowest tier's one-call drop: no row gather, selections, casts or
        # scratch arrays between the calls, each a fixed cost in caches the last read's 4 MiB
        # went through (stall8).
        whole = (mask and _victims_covered is not None and _fast is not None
                 and isinstance(st.pool, SlotStack))
        try:
            while done < n:
                slots = policy.victims(n - done)
                if slots.size == 0:
                    break
                if whole and _victims_covered(cols["copy_ver"], st.slot_row, slots, int(tier),
                                              mask):
                    done += self._evict_lowest(ns, tier, st, slots, policy, lowers[0])
                    continue
                rows = st.slot_row[slots]
                if not lowers:             # the lowest tier: every victim can go as it is
                    done += self._drop_victims(ns, tier, rows, lowers, slots)
                    continue
                covered = self._covered(cols, rows, tier, lowers)
                if covered.all():          # (the usual case without the C check: no selections)
                    done += self._drop_victims(ns, tier, rows, lowers, slots)
                    continue
                done += self._drop_victims(ns, tier, rows[covered], lowers, slots[covered])
                slots, rows = slots[~covered], rows[~covered]
                # The sole copies of their version: write them one tier down first.
                try:
                    self._write_down(ns, tier, lowers[0], rows)
                except BaseException:
                    held.append(slots)
                    raise
                # Making room below can have evicted some of them outright (NVMe eviction
                # drops every copy): a slot no longer holding its row is settled already.
                ours = st.slot_row[slots] == rows
                covered = ours & self._covered(cols, rows, tier, lowers)
                done += self._drop_victims(ns, tier, rows[covered], lowers, slots[covered])
                # The rest stay out of the queue until this eviction ends, so that the next
                # victims come from further down it (a full tier below holds only these back).
                held.append(slots[ours & ~covered])
        finally:
            if held:
                policy.give_back(np.concatenate(held))
        return done

    def _drop_victims(self, ns: Namespace, tier: Tier, victims: np.ndarray,
                      lowers: list[Tier], slots: np.ndarray) -> int:
        """Evict victims (rows) from tier; slots: their copies' slots there (in the same
        order, as the policy handed them out)."""
        if _fast is not None and slots.size:
            return self._drop_victims_native(ns, tier, victims, lowers, slots)
        self.slots.drop_copies(ns, victims, tier, slots)
        self.counters.tiers[tier].evictions += victims.size
        if lowers:
            self.counters.tiers[lowers[0]].demotions += victims.size
        self.forget_empty(ns, victims)
        return int(victims.size)

    def _drop_victims_native(self, ns: Namespace, tier: Tier, victims: np.ndarray,
                             lowers: list[Tier], slots: np.ndarray,
                             policy: TierPolicy | None = None) -> int:
        """_drop_victims with the C helper, in its order: the policy's on_remove, then
        _fast.drop_rows (drop_copies's release_copies and forget_empty's empty_rows in one
        call), the pool's free, the counters, the table's removal. policy: the tier's, when
        the caller has it."""
        cols, st = ns.table.cols, ns.slots[tier]
        rows = np.ascontiguousarray(victims, dtype=np.int64)
        (policy or self.tier_policy(ns, tier)).on_remove(slots)
        n = rows.size
        out = np.empty(2 * n, dtype=np.int64)
        k, d = _fast.drop_rows(cols["copy_ver"], cols["slot"], st.slot_row, st.leases,
                               st.retired, rows, int(tier), out[:n], cols["version"],
                               cols["state"], cols["checksum"], cols["nvme_checksum"],
                               _LOST_NEXT, _NVME, _CLEAN, out[n:])
        if k:
            self.slots.slots_freed(ns, tier, out[:k])
        self.counters.tiers[tier].evictions += n
        if lowers:
            self.counters.tiers[lowers[0]].demotions += n
        if d < 0:                      # a row without a LOST move: forget_empty raises
            self.forget_empty(ns, rows)
        elif d > 0:
            ns.table.remove(out[n:n + d])
        return int(n)

    def _evict_lowest(self, ns: Namespace, tier: Tier, st: SlotState, slots: np.ndarray,
                      policy: TierPolicy | None, lower: Tier | None = None) -> int:
        """_drop_victims_native with the C helper, for victims that can all go as they are
        (the lowest tier's, or copies that lower, the first lower tier, covers: a demotion
        counted there): the policy's on_remove (None: the victims were handed out with drop,
        forgotten already), then _fast.evict_slots (the victims' rows, drop_rows, the freed
        slots pushed onto the pool's stack, a SlotStack: no row gather, scratch arrays or
        slices between the calls), the budget, the counters, the removal."""
        table = ns.table
        cols = table.cols
        if policy is not None:
            policy.on_remove(slots)
        n = slots.size
        if self._scratch.size < 2 * n:
            self._scratch = _empty(2 * n + 64, dtype=_I64)
        scratch = self._scratch
        stack, low = st.pool.stack()
        low, k, d = _fast.evict_slots(
            cols["copy_ver"], cols["slot"], st.slot_row, st.leases, st.retired,
            _contiguous(slots, dtype=_I64), int(tier), cols["version"],
            cols["state"], cols["checksum"], cols["nvme_checksum"], _LOST_NEXT, _NVME, _CLEAN,
            stack, low, scratch)
        if k:
            self.slots.slots_pushed(ns, tier, k, low)
        self.counters.tiers[tier].evictions += n
        if lower is not None:
            self.counters.tiers[lower].demotions += n
        if d < 0:                      # a row without a LOST move: forget_empty raises
            self.forget_empty(ns, scratch[:n])
        elif d > 0:
            table.remove(scratch[n:n + d])
        return n

    @staticmethod
    def _covered(cols: dict[str, np.ndarray], rows: np.ndarray, tier: Tier,
                 lowers: list[Tier]) -> np.ndarray:
        """Which rows' copy in tier can go: a lower tier holds the same version, or there is no
        lower tier to write it to."""
        if not lowers:
            return np.ones(rows.size, dtype=bool)
        copy_ver = cols["copy_ver"]
        ver = copy_ver[rows, tier]
        covered = copy_ver[rows, lowers[0]] == ver
        for t in lowers[1:]:
            covered |= copy_ver[rows, t] == ver
        return covered

    def _write_down(self, ns: Namespace, tier: Tier, lower: Tier, rows: np.ndarray) -> None:
        if lower is Tier.NVME:
            self.nvme.write_down(ns, rows)     # disk I/O waits until the lock is released
            return
        cols = ns.table.cols
        src = ns.slots[tier]
        # Pin the sources: making room below must not evict them from under us.
        src_slots = cols["slot"][rows, tier].astype(np.int64)
        src.leases[src_slots] += 1
        try:
            dst = self.slots.alloc(ns, lower, rows.size, partial=True)
        finally:
            src.leases[src_slots] -= 1
        rows = rows[: dst.size]
        ns.slots[lower].pool.write(dst, _to_numpy(src.pool.read(src_slots[: dst.size])))
        self.slots.set_copy(ns, rows, lower, dst, cols["copy_ver"][rows, tier])
        self.counters.tiers[lower].bytes_written += int(dst.size) * ns.block_bytes

    def forget_empty(self, ns: Namespace, rows: np.ndarray) -> None:
        """Rows that no longer have any current copy lose their block (state LOST -> EMPTY)."""
        cols = ns.table.cols
        if _fast is not None:
            rows = np.ascontiguousarray(rows, dtype=np.int64)
            drop = np.empty(rows.size, dtype=np.int64)
            k = _fast.empty_rows(cols["version"], cols["copy_ver"], cols["state"],
                                 cols["checksum"], cols["nvme_checksum"], rows,
                                 _LOST_NEXT, int(Tier.NVME),
                                 int(BlockState.CLEAN), drop)
            if k < 0:
                cur = cols["copy_ver"][rows] == cols["version"][rows, None]
                next_states(cols["state"][rows[~cur.any(axis=1)]], Event.LOST)   # raises
            if k > 0:
                ns.table.remove(drop[:k])
            return
        cur = cols["copy_ver"][rows] == cols["version"][rows, None]
        gone = rows[~cur.any(axis=1) & (cols["version"][rows] > 0)]
        if gone.size == 0:
            return
        next_states(cols["state"][gone], Event.LOST)
        # A stale NVMe copy may remain (the last flushed version): that record stays, and the
        # row falls back to it, exactly as a restart would.
        nv = cols["copy_ver"][gone, Tier.NVME]
        keep = gone[nv > 0]
        if keep.size:
            cols["version"][keep] = nv[nv > 0]
            cols["checksum"][keep] = cols["nvme_checksum"][keep]
            cols["state"][keep] = BlockState.CLEAN
        drop = gone[nv == 0]
        if drop.size:
            ns.table.remove(drop)

    def evict_other_namespaces(self, ns: Namespace, n: int) -> None:
        for other in self.namespaces.values():
            over = self.slots.host_used + n * ns.block_bytes - self.settings.host_capacity
            if over <= 0:
                return
            if other is not ns:
                self.evict_copies(other, Tier.HOST, -(-over // other.block_bytes))

    def evict(self, tier: Tier, count: int, namespace: str | None = None) -> int:
        """Admin eviction of up to count copies from a tier (all namespaces, or one)."""
        targets = [self.namespace(namespace)] if namespace else list(self.namespaces.values())
        done = 0
        if tier is Tier.NVME:                  # LMDB deletes: not under the engine lock
            for ns in targets:
                done += self.nvme.space.evict(ns, count - done)
            return done
        with self.lock:
            for ns in targets:
                if tier in ns.slots:
                    done += self.evict_copies(ns, tier, count - done)
            return done
