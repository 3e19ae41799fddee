"""Eviction, as a part of the Engine (a mixin: the engine's state, its lock held by the caller).

A tier drops a copy only when the copy is clean or a lower tier holds the same version; a dirty
sole copy is written one tier down first (a demotion: HBM -> host, host -> NVMe). Victims are
ranked by the tier's policy (coherence.policies), leaves before parents when leaf_first is on.
Writing down can evict, in the tier below, the copy that covered another one here, so eviction
runs in a few rounds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvtier.coherence.states import BlockState, Event, next_states
from kvtier.coherence.transfers import _to_numpy
from kvtier.types import Tier, lower_tiers

if TYPE_CHECKING:
    from kvtier.coherence.namespace import Namespace


class Eviction:
    def _evict(self, ns: Namespace, tier: Tier, n: int) -> int:
        """Drop up to n copies from a slot tier of ns, by its policy, leaves first.

        Eligible: unleased copies that are clean, or whose version a lower tier also holds, or
        that live in the lowest configured tier (a cache may forget what it cannot write back).
        Under write_back, dirty sole copies are flushed first.
        """
        if n <= 0:
            return 0
        st = ns.slots[tier]
        cols = ns.table.cols
        lowers = [t for t in lower_tiers(tier) if t in ns.slots or (t is Tier.NVME and ns.log)]
        done = 0
        # Writing copies down can itself evict, in the tier below, the copy that covered another
        # one here; a few rounds settle it.
        for _round in range(4):
            rows = st.slot_row[(st.slot_row >= 0) & (st.leases == 0)]
            if rows.size == 0:
                break
            ver = cols["copy_ver"][rows, tier]
            covered = np.ones(rows.size, dtype=bool) if not lowers else np.zeros(rows.size, bool)
            for t in lowers:
                covered |= cols["copy_ver"][rows, t] == ver
            if covered.any():
                victims = self._choose(ns, tier, rows[covered], n - done)
                self._drop_copies(ns, victims, tier)
                self.counters.tiers[tier].evictions += victims.size
                if lowers:
                    self.counters.tiers[lowers[0]].demotions += victims.size
                self._forget_empty(ns, victims)
                done += int(victims.size)
            if done >= n or covered.all():
                break
            # Write the policy's next victims back one tier down first (a demotion).
            self._write_down(ns, tier, lowers[0],
                             self._choose(ns, tier, rows[~covered], n - done))
        return done

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
            dst = self._alloc(ns, lower, rows.size, partial=True)
        finally:
            src.leases[src_slots] -= 1
        rows = rows[: dst.size]
        ns.slots[lower].pool.write(dst, _to_numpy(src.pool.read(src_slots[: dst.size])))
        self._set_copy(ns, rows, lower, dst, cols["copy_ver"][rows, tier])
        self.counters.tiers[lower].bytes_written += int(dst.size) * ns.block_bytes

    def _choose(self, ns: Namespace, tier: Tier, rows: np.ndarray, n: int) -> np.ndarray:
        cols = ns.table.cols
        score = self.policies[tier](cols, rows, self.clock)
        if not self.settings.leaf_first:
            return rows[np.argsort(score, kind="stable")[:n]]
        # Leaf-first: a row with a child cached in this tier goes after every leaf.
        parents = cols["parent"][rows]
        has_child = np.zeros(ns.table.n_rows, dtype=bool)
        if tier is Tier.NVME:
            held = cols["copy_ver"][:ns.table.n_rows, Tier.NVME] > 0
        else:
            held = np.zeros(ns.table.n_rows, dtype=bool)
            held[ns.slots[tier].slot_row[ns.slots[tier].slot_row >= 0]] = True
        kids = np.flatnonzero(held)
        kp = cols["parent"][kids]
        has_child[kp[kp >= 0]] = True
        del parents
        inner = has_child[rows]
        order = np.lexsort((score, inner))
        return rows[order[:n]]

    def _forget_empty(self, ns: Namespace, rows: np.ndarray) -> None:
        """Rows that no longer have any current copy lose their block (state LOST -> EMPTY)."""
        cols = ns.table.cols
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

    def _evict_other_namespaces(self, ns: Namespace, n: int) -> None:
        for other in self.namespaces.values():
            over = self.host_used + n * ns.block_bytes - self.settings.host_capacity
            if over <= 0:
                return
            if other is not ns:
                self._evict(other, Tier.HOST, -(-over // other.block_bytes))

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
                    done += self._evict(ns, tier, count - done)
            return done
