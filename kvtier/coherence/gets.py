"""Gets, as a part of the Engine (a mixin, as coherence.fastpath is; each public method takes
the engine lock itself).

A get is decided under the lock: the batch is looked up, the copies already in the wanted tier
are pinned, HBM or host copies are brought up, and NVMe copies are planned into pinned slots
(coherence.persist.ReadPlan). The NVMe read runs with the lock released, so that other
clients' gets of resident blocks never wait for the disk; _finish_get then installs, under the
lock, the copies whose row is still at the version that was read (a block rewritten meanwhile
is a miss, never its old bytes as the new version), and makes the lease. Versions and checksums
in the reply are the ones the copies were pinned at.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from kvtier.coherence.namespace import GetResult, Lease, Namespace, add_one
from kvtier.coherence.persist import ReadPlan
from kvtier.errors import BadRequest
from kvtier.types import Tier

class Gets:
    def get(self, namespace: str, keys: Any, owner: int = 0, tier: Tier = Tier.HOST) -> GetResult:
        """Lease the current version of each key in ``tier``, bringing it up if needed. NVMe
        reads run with the lock released (decide and pin, read, install with versions
        checked), so that other clients' gets of resident blocks do not wait for the disk."""
        for attempt in range(2):
            with self.lock:
                out = self._get(namespace, keys, owner, tier, io=True)
                if isinstance(out, GetResult):
                    return out
                p = cast(_PendingGet, out)
                if p.plan is None:
                    res = self._finish_get(p)
            raced = False
            if p.plan is not None:
                try:
                    self.nvme.run_read(p.plan, p.ns.slots[tier].pool)
                finally:
                    with self.lock:
                        res = self._finish_get(p)
                self.nvme.after_read(p.plan)
                # Read and verified, yet not installed: the block was rewritten meanwhile.
                # Its new version is in the host tier now (a put lands there), so one more try
                # serves it rather than a miss (issue 17: randrw jobs, rewrites beside reads).
                raced = p.plan.ok is not None and not res.found[p.plan_pos[p.plan.ok]].all()
            wanted = self.nvme.wanted()
            if wanted:
                self.nvme.drain()
            if attempt or not (raced or (p.short and wanted)):
                break
            # Room for the bring-up needed dirty blocks written down first (now they are), or
            # a block moved on under the read: again, once.
            self.release(res.lease_id, owner)
        return res

    def try_get(self, namespace: str, keys: Any, owner: int = 0) -> GetResult | None:
        """get() when every found block is already in the host tier; None when it would have
        to move bytes between tiers (the caller then runs get() off the event loop)."""
        with self.lock:
            out = self._get(namespace, keys, owner, Tier.HOST, io=False)
            return self._finish_get(out) if isinstance(out, _PendingGet) else out

    def _get(self, namespace: str, keys: Any, owner: int, tier: Tier,
             io: bool) -> "GetResult | _PendingGet | None":
        ns = self.namespace(namespace)
        if tier not in ns.slots:
            raise BadRequest(f"namespace {ns.name!r} has no {tier.label} tier to serve from")
        karr = self._check_keys(ns, keys, zero_check=False)
        if karr.size == 1:
            res = self._get_one(ns, karr, owner, tier)
            if res is not None:
                return res
        cols = ns.table.cols
        n = karr.size
        rows = ns.table.lookup(karr)
        res = self._lease_native(ns, rows, owner, tier)
        if res is not None:
            return res
        found = rows >= 0
        if found.all():
            ver = cols["version"][rows]
            if ver.all() and (cols["copy_ver"][rows, tier] == ver).all():
                return self._lease_resident(ns, rows, ver, owner, tier)
        else:
            _refuse_zero_key(karr[~found])      # never stored, so only a missing key can be it
        fr = rows[found]
        found[found] = cols["version"][fr] > 0
        st = ns.slots[tier]
        slots = np.full(n, -1, dtype=np.int64)
        idx = np.flatnonzero(found)
        r = rows[idx]
        ready = cols["copy_ver"][r, tier] == cols["version"][r]
        if not io and (not ready.all() or (self.remote is not None and not found.all())):
            return None
        ri = idx[ready]
        slots[ri] = cols["slot"][rows[ri], tier]
        # Pin what is already here before anything else can evict it.
        add_one(st.leases, slots[ri])
        self.counters.tiers[tier].hits += int(ri.size)
        safe = np.maximum(rows, 0)
        p = _PendingGet(ns, karr, rows, found, slots, tier, owner,
                        np.where(found, cols["version"][safe], 0).astype(np.uint64),
                        np.where(found, cols["checksum"][safe], 0).astype(np.uint64))
        todo = idx[~ready]
        if todo.size:
            # A key repeated in the batch is brought up once; its repeats share the slot.
            _, first, inv = np.unique(rows[todo], return_index=True, return_inverse=True)
            inv = inv.reshape(-1)
            p.plan, p.plan_pos, p.short = self._bring_up(ns, rows, todo[first], tier, slots,
                                                         found)
            rep = np.setdiff1d(np.arange(todo.size), first)
            if rep.size:
                p.repeats, p.repeat_src = todo[rep], todo[first][inv[rep]]
        return p

    def _finish_get(self, p: "_PendingGet") -> GetResult:
        """The rest of a get, under the lock: NVMe copies installed, repeats share their
        slot, misses filled from the remote tier, and the lease. Versions and checksums are
        the ones the copies were pinned at."""
        ns, tier, rows, found, slots = p.ns, p.tier, p.rows, p.found, p.slots
        cols = ns.table.cols
        st = ns.slots[tier]
        if p.plan is not None:
            self._install_read(p.plan, tier, p.plan_pos, rows, slots, found)
        if p.repeats.size:
            slots[p.repeats] = slots[p.repeat_src]
            found[p.repeats] = found[p.repeat_src]
            ok = p.repeats[found[p.repeats]]
            add_one(st.leases, slots[ok])
        if self.remote is not None and not found.all():
            before = found.copy()
            self._from_remote(ns, p.karr, rows, found, slots, tier)
            got = found & ~before
            p.versions[got] = cols["version"][rows[got]]
            p.sums[got] = cols["checksum"][rows[got]]
        served = np.flatnonzero(found)
        srows = rows[served]
        versions = p.versions[served]
        # Readers count on rows still at the version served (a rewrite resets the count).
        cur = srows[(cols["version"][srows] == versions)
                    & (cols["key"][srows] == p.karr[served])]
        add_one(cols["leases"], cur)
        self._touch(ns, cur)          # in batch order: the last key of a prefix is the newest
        self.counters.gets += p.karr.size
        self.counters.get_hits += int(served.size)
        self.counters.tiers[tier].bytes_read += int(served.size) * ns.block_bytes
        lid = self._new_id()
        self.leases[lid] = Lease(lid, ns, tier, slots[served].astype(np.int64), srows,
                                 versions.copy(), p.owner,
                                 time.monotonic() + self.settings.lease_timeout)
        return GetResult(found, slots.astype(np.int32), np.where(found, p.versions, 0)
                         .astype(np.uint64), np.where(found, p.sums, 0).astype(np.uint64),
                         lid, tier)

    def read(self, namespace: str, keys: Any) -> tuple[np.ndarray, np.ndarray]:
        """get + copy + release, for in-process readers: (found mask, n x block_bytes array)."""
        res = self.get(namespace, keys)
        try:
            ns = self.namespace(namespace)
            out = np.zeros((res.found.size, ns.block_bytes), dtype=np.uint8)
            idx = np.flatnonzero(res.found)
            out[idx] = ns.slots[Tier.HOST].pool.read(res.slots[idx])   # leased: stable
        finally:
            self.release(res.lease_id)
        return res.found, out


def _refuse_zero_key(karr: np.ndarray) -> None:
    if not karr.view(np.uint8).reshape(karr.size, -1).any(axis=1).all():
        raise BadRequest("the all-zero key is reserved (it means 'no parent'); hash your "
                         "keys so that none is all zeros")


@dataclass(slots=True)
class _PendingGet:
    """A get between its locked decision and its locked finish (an NVMe read in between)."""

    ns: Namespace
    karr: np.ndarray
    rows: np.ndarray
    found: np.ndarray
    slots: np.ndarray
    tier: Tier
    owner: int
    versions: np.ndarray        # per position, the version pinned (0 where not found)
    sums: np.ndarray
    plan: ReadPlan | None = None
    plan_pos: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    repeats: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    repeat_src: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    short: bool = False         # some bring-ups found no room
