"""Holds: the part of the engine that ends leases and reservations (each public method takes
the engine lock itself; the others run under it).

A lease ends by release (whole, or the part holding some slots), by release_many (the leases a
client piggybacks on a request, in one pass per namespace and tier), when its owner's
connection closes (release_owner), or when it outlives lease_timeout (reap, which expires
stalled reservations too). Ending a lease unpins its slots, frees the ones a rewrite retired
once their last reader is gone, and drops the row's reader count if the row still holds the
version that was leased.

Interface. Owns: the tables of live holds, ``leases`` (id -> Lease) and ``reservations``
(id -> Reservation); the engine and the fast path add to them, only this part ends them.
Public: release, release_many, release_owner, reap (the engine's methods of those names are
these, bound), end_lease, end_reservation. Calls: the engine's slots through ``SlotOps``
(unpin, free, return freed slots to their pool and the host budget), the counters of
expiries, and the C helper's unlease_rows where it is built.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

import numpy as np

from kvtier.coherence.namespace import EngineCounters, Lease, Namespace, Reservation
from kvtier.coherence.states import HoldState
from kvtier.errors import LeaseError
from kvtier.types import Tier

try:        # the C helper (setup.py builds it where a compiler is present); numpy otherwise
    from kvtier.coherence import _fast
except ImportError:
    _fast = None


def count_readers(counts: np.ndarray, rows: np.ndarray, delta: int = 1) -> None:
    """counts[rows] += delta (1 or -1) per occurrence, held within 0 and the type's top: the
    numpy twin of the C helpers' reader counts (lease_current, lease_rows, unlease_rows:
    exact, saturating at 65,535, never below 0). add_one on the uint16 column wrapped at
    65,536, and a release of a row given twice at a count of 1 wrapped it to 65,535 (rev8)."""
    if rows.size == 0:
        return
    u, n = np.unique(rows, return_counts=True)
    c = counts[u].astype(np.int64) + (n if delta > 0 else -n)
    counts[u] = np.clip(c, 0, np.iinfo(counts.dtype).max)


class SlotOps(Protocol):
    """What ending a hold needs of the engine's slot tiers (the caller holds the lock)."""

    def unpin_slots(self, ns: Namespace, tier: Tier, slots: np.ndarray) -> None:
        """Drop one pin per slot; retired slots whose last pin goes are freed."""

    def free_slots(self, ns: Namespace, tier: Tier, slots: np.ndarray) -> None:
        """Return slots to their pool, or retire the leased ones until their last release."""

    def slots_freed(self, ns: Namespace, tier: Tier, slots: np.ndarray) -> None:
        """Give unpinned, retired slots back to their pool (and the host budget)."""


class Holds:
    def __init__(self, lock: threading.RLock, counters: EngineCounters,
                 slots: SlotOps) -> None:
        self.lock = lock
        self.counters = counters
        self.leases: dict[int, Lease] = {}
        self.reservations: dict[int, Reservation] = {}
        # Bound once: the single-slot release is on the latency path (bench/single_split.py).
        self._unpin = slots.unpin_slots
        self._free = slots.free_slots
        self._freed = slots.slots_freed

    def release(self, lease_id: int, owner: int = 0, slots: np.ndarray | None = None) -> None:
        """End a lease, or with ``slots`` only the part of it holding those slots."""
        with self.lock:
            lease = self.leases.get(lease_id)
            if lease is None or lease.owner != owner:
                raise LeaseError(f"lease {lease_id} is unknown, already released, expired or not "
                                 "yours")
            if slots is None or len(slots) == 0:
                del self.leases[lease_id]
                if lease.slots.size == 1:      # end_lease's own test, without its frame
                    self._end_one(lease, HoldState.RELEASED)
                else:
                    self.end_lease(lease, HoldState.RELEASED)
                return
            slots = lease.ns.slots[lease.tier].pool.check_slots(np.asarray(slots))
            keep = np.ones(lease.slots.size, dtype=bool)
            for s in slots.tolist():
                hit = np.flatnonzero((lease.slots == s) & keep)
                if hit.size == 0:
                    raise LeaseError(f"slot {s} is not held by lease {lease_id}; nothing released")
                keep[hit[0]] = False
            part = Lease(lease.lid, lease.ns, lease.tier, lease.slots[~keep], lease.rows[~keep],
                         lease.versions[~keep], owner, lease.deadline)
            lease.slots, lease.rows, lease.versions = (lease.slots[keep], lease.rows[keep],
                                                       lease.versions[keep])
            self.end_lease(part, HoldState.RELEASED)
            if lease.slots.size == 0:
                del self.leases[lease_id]

    def release_many(self, lease_ids: list[int], owner: int = 0) -> int:
        """End several whole leases at once: the releases a client piggybacks on a request.
        Leases of one namespace and tier end in one pass (four leases of 1,024 slots cost ~50
        us each one by one on the H200 host, in front of the request that carried them).
        Returns how many ids were unknown, already ended or not owner's; those change
        nothing."""
        with self.lock:
            groups: dict[tuple[int, Tier], list[Lease]] = {}
            bad = 0
            for lid in lease_ids:
                lease = self.leases.get(lid)
                if lease is None or lease.owner != owner:
                    bad += 1
                    continue
                del self.leases[lid]
                groups.setdefault((id(lease.ns), lease.tier), []).append(lease)
            for group in groups.values():
                if len(group) == 1:
                    self.end_lease(group[0], HoldState.RELEASED)
                    continue
                for lease in group:
                    lease.state = HoldState.RELEASED
                first = group[0]
                merged = Lease(0, first.ns, first.tier,
                               np.concatenate([g.slots for g in group]),
                               np.concatenate([g.rows for g in group]),
                               np.concatenate([g.versions for g in group]), owner, 0.0)
                self.end_lease(merged, HoldState.RELEASED)
            return bad

    def end_lease(self, lease: Lease, state: HoldState) -> None:
        """Unpin a lease's slots and drop its rows' reader counts (the caller holds the lock
        and has taken the lease out of ``leases``)."""
        if lease.slots.size == 1:
            self._end_one(lease, state)
            return
        lease.state = state
        if _fast is not None:
            self._end_native(lease)
            return
        ns = lease.ns
        self._unpin(ns, lease.tier, lease.slots)
        cols = ns.table.cols
        live = (lease.rows < ns.table.n_rows)
        rows = lease.rows[live]
        same = cols["version"][rows] == lease.versions[live]
        count_readers(cols["leases"], rows[same], -1)

    def _end_native(self, lease: Lease) -> None:
        """end_lease's unpinning and reader counts in one C call."""
        ns = lease.ns
        st = ns.slots[lease.tier]
        gone = np.empty(lease.slots.size, dtype=np.int64)
        k = _fast.unlease_rows(st.leases, st.retired, ns.table.cols["version"],
                               ns.table.cols["leases"], ns.table.n_rows,
                               np.ascontiguousarray(lease.slots, dtype=np.int64),
                               np.ascontiguousarray(lease.rows, dtype=np.int64),
                               np.ascontiguousarray(lease.versions, dtype=np.uint64), gone)
        if k:
            self._freed(ns, lease.tier, gone[:k])

    def _end_one(self, lease: Lease, state: HoldState) -> None:
        """end_lease for a lease of one slot: _fast.unlease_one on Python ints where the
        module is built (eight numpy scalar operations were ~12k instructions, a replayed
        request's commonest release), else on numpy scalars."""
        lease.state = state
        ns = lease.ns
        st = ns.slots[lease.tier]
        if _fast is not None:
            table = ns.table
            if _fast.unlease_one(st.leases, st.retired, table.cols["version"],
                                 table.cols["leases"], table.n_rows, lease.slots.item(),
                                 lease.rows.item(), lease.versions.item()):
                self._freed(ns, lease.tier, lease.slots)
            return
        slot = int(lease.slots[0])
        st.leases[slot] -= 1
        if st.leases[slot] == 0 and st.retired[slot]:
            st.retired[slot] = False
            self._freed(ns, lease.tier, lease.slots)
        row = int(lease.rows[0])
        cols = ns.table.cols
        if row < ns.table.n_rows and cols["version"][row] == lease.versions[0] \
                and cols["leases"][row] > 0:
            cols["leases"][row] -= 1

    def end_reservation(self, res: Reservation, state: HoldState) -> None:
        """Unpin and free a reservation's slots (taken out of ``reservations`` already)."""
        res.state = state
        ns = res.ns
        self._unpin(ns, res.tier, res.slots)
        self._free(ns, res.tier, res.slots)

    def release_owner(self, owner: int) -> int:
        """End every lease and reservation of a disconnected client. Returns how many."""
        with self.lock:
            n = 0
            for lid in [k for k, v in self.leases.items() if v.owner == owner]:
                self.end_lease(self.leases.pop(lid), HoldState.RELEASED)
                n += 1
            for rid in [k for k, v in self.reservations.items() if v.owner == owner]:
                self.end_reservation(self.reservations.pop(rid), HoldState.RELEASED)
                n += 1
            return n

    def reap(self, now: float | None = None) -> int:
        """Expire reservations and leases past their deadline. Returns how many."""
        if not self.reservations and not self.leases:
            return 0                      # nothing held (reads of two dicts' sizes)
        now = time.monotonic() if now is None else now
        with self.lock:
            n = 0
            for rid in [k for k, v in self.reservations.items() if v.deadline < now]:
                self.end_reservation(self.reservations.pop(rid), HoldState.EXPIRED)
                self.counters.expired_reservations += 1
                n += 1
            for lid in [k for k, v in self.leases.items() if v.deadline < now]:
                self.end_lease(self.leases.pop(lid), HoldState.EXPIRED)
                self.counters.expired_leases += 1
                n += 1
            return n
