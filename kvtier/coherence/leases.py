"""Ending leases and reservations, as a part of the Engine (a mixin; each public method takes
the engine lock).

A lease ends by release (whole, or the part holding some slots), by release_many (the leases a
client piggybacks on a request, in one pass per namespace and tier), when its owner's
connection closes (release_owner), or when it outlives lease_timeout (reap, which expires
stalled reservations too). Ending a lease unpins its slots, frees the ones a rewrite retired
once their last reader is gone, and drops the row's reader count if the row still holds the
version that was leased.
"""

from __future__ import annotations

import time
import numpy as np

from kvtier.coherence.namespace import Lease
from kvtier.coherence.states import HoldState
from kvtier.errors import LeaseError
from kvtier.types import Tier


class Holds:
    def release(self, lease_id: int, owner: int = 0, slots: np.ndarray | None = None) -> None:
        """End a lease, or with ``slots`` only the part of it holding those slots."""
        with self.lock:
            lease = self.leases.get(lease_id)
            if lease is None or lease.owner != owner:
                raise LeaseError(f"lease {lease_id} is unknown, already released, expired or not "
                                 "yours")
            if slots is None or len(slots) == 0:
                del self.leases[lease_id]
                self._end_lease(lease, HoldState.RELEASED)
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
            self._end_lease(part, HoldState.RELEASED)
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
                    self._end_lease(group[0], HoldState.RELEASED)
                    continue
                for lease in group:
                    lease.state = HoldState.RELEASED
                first = group[0]
                merged = Lease(0, first.ns, first.tier,
                               np.concatenate([g.slots for g in group]),
                               np.concatenate([g.rows for g in group]),
                               np.concatenate([g.versions for g in group]), owner, 0.0)
                self._end_lease(merged, HoldState.RELEASED)
            return bad

    def _end_lease(self, lease: Lease, state: HoldState) -> None:
        if lease.slots.size == 1:
            self._end_lease_one(lease, state)
            return
        lease.state = state
        if self._end_native(lease):
            return
        ns = lease.ns
        self._unpin(ns, lease.tier, lease.slots)
        cols = ns.table.cols
        live = (lease.rows < ns.table.n_rows)
        rows = lease.rows[live]
        same = cols["version"][rows] == lease.versions[live]
        r = rows[same]
        np.subtract.at(cols["leases"], r, np.minimum(cols["leases"][r], 1))

    def release_owner(self, owner: int) -> int:
        """End every lease and reservation of a disconnected client. Returns how many."""
        with self.lock:
            n = 0
            for lid in [k for k, v in self.leases.items() if v.owner == owner]:
                self._end_lease(self.leases.pop(lid), HoldState.RELEASED)
                n += 1
            for rid in [k for k, v in self.reservations.items() if v.owner == owner]:
                self._end_reservation(self.reservations.pop(rid), HoldState.RELEASED)
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
                self._end_reservation(self.reservations.pop(rid), HoldState.EXPIRED)
                self.counters.expired_reservations += 1
                n += 1
            for lid in [k for k, v in self.leases.items() if v.deadline < now]:
                self._end_lease(self.leases.pop(lid), HoldState.EXPIRED)
                self.counters.expired_leases += 1
                n += 1
            return n

    # ------------------------------------------------------------------ other ops
