"""Transfers: the part of the engine that moves copies between tiers (the caller holds the
engine lock, except where a method says it takes it itself).

- bring-up: the current version into the tier a get wants it in, from the highest tier that
  holds it (HBM or host copy, or NVMe copy-on-read with the checksum verified);
- prefetch: after a prefix hit, the chain's next blocks from NVMe to host, into free slots;
- stage: a prefix an engine found and is about to load, from NVMe to host (evicting others);
- the remote tier: write-through or write-back to Redis, and local misses filled from it.

Interface. Owns nothing. Public: prefetch_after, wants_prefetch, stage (the engine's methods of
those names are these, bound), bring_up, install_read, give_back, from_remote (coherence.gets
calls them), push_remote (the engine's puts and flushes). Calls: the engine's slot ops through
``TierSlots`` (alloc, set_copy, free_slots, unpin_slots, drop_copies, the host budget it reads),
the NVMe store's read plans, the remote tier, the settings, the counters and the namespaces.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvtier.coherence.namespace import add_one, to_numpy as _to_numpy
from kvtier.coherence.persist import ReadPlan
from kvtier.coherence.states import Event, next_states
from kvtier.config import Settings
from kvtier.types import SERVE_ORDER, Tier

try:        # the NVMe bring-up's hit check in one call (_gets.c nvme_hits); numpy otherwise
    from kvtier.coherence._gets import nvme_hits as _nvme_hits
except ImportError:
    _nvme_hits = None
try:        # a shared install's writes in one call (_gets.c install_shares); numpy otherwise
    from kvtier.coherence._gets import install_shares as _install_shares
except ImportError:
    _install_shares = None
try:        # the C helper (setup.py builds it where a compiler is present); numpy otherwise
    from kvtier.coherence import _fast
except ImportError:
    _fast = None

if TYPE_CHECKING:
    from kvtier.coherence.namespace import EngineCounters, Namespace
    from kvtier.coherence.persist import NvmeStore

# Looked up once: Tier.HOST read on the class goes through EnumType's __getattr__ (~0.2 us in
# Python 3.11), and numpy's names are module lookups (why: kvtier.pagetable.table, at _empty).
_HOST, _NVME, _HBM = Tier.HOST, Tier.NVME, Tier.HBM
_NVME_NUM = int(Tier.NVME)
_I64, _contiguous, _empty = np.int64, np.ascontiguousarray, np.empty


class TierSlots(Protocol):
    """What moving copies needs of the engine's slot tiers (the caller holds the lock)."""

    host_used: int               # bytes of host slots in use, all namespaces

    def alloc(self, ns: Namespace, tier: Tier, n: int, partial: bool = False) -> np.ndarray: ...
    def set_copy(self, ns: Namespace, rows: np.ndarray, tier: Tier, slots: np.ndarray,
                 versions: np.ndarray) -> None: ...
    def free_slots(self, ns: Namespace, tier: Tier, slots: np.ndarray) -> None: ...
    def unpin_slots(self, ns: Namespace, tier: Tier, slots: np.ndarray) -> None: ...
    def drop_copies(self, ns: Namespace, rows: np.ndarray, tier: Tier,
                    slots: np.ndarray | None = None) -> None: ...
    def placed(self, ns: Namespace, tier: Tier, rows: np.ndarray, slots: np.ndarray) -> None: ...


class Transfers:
    def __init__(self, lock: threading.RLock, settings: Settings, counters: EngineCounters,
                 namespaces: dict[str, Namespace], namespace: Any, nvme: NvmeStore,
                 remote: Any, slots: TierSlots) -> None:
        self.lock, self.settings, self.counters = lock, settings, counters
        # namespace: by name, raising NamespaceError (the engine's); remote: the remote
        # tier, or None.
        self.namespaces, self.namespace = namespaces, namespace
        self.nvme, self.remote, self.slots = nvme, remote, slots

    def bring_up(self, ns: Namespace, rows: np.ndarray, todo: np.ndarray, tier: Tier,
                  slots: np.ndarray, found: np.ndarray
                  ) -> tuple[ReadPlan | None, np.ndarray, bool]:
        """Copy the current version of rows[todo] into tier, pinned; misses clear found.

        Copies from HBM or host are made here. NVMe copies are only planned: the returned
        plan (and the batch positions it serves) is read by the caller without the lock and
        installed by install_read. The flag says some found no room in tier."""
        if tier is _HOST and _HBM not in ns.slots:
            return self._bring_up_from_nvme(ns, rows, todo, found)
        cols = ns.table.cols
        none = np.empty(0, dtype=np.int64)
        r = rows[todo]
        ver = cols["version"][r]
        sources = [t for t in SERVE_ORDER if t is not tier]
        src_of = np.full(todo.size, -1, dtype=np.int64)
        for t in reversed(sources):       # the highest tier holding the version wins
            src_of[cols["copy_ver"][r, t] == ver] = t
        hit = (src_of >= 0) & (src_of != Tier.REMOTE)   # the remote tier serves its own reads
        found[todo[~hit]] = False
        self.counters.tiers[tier].misses += int((~hit).sum())
        if not hit.any():
            return None, none, False
        todo, r, src_of = todo[hit], r[hit], src_of[hit]
        dst = self.slots.alloc(ns, tier, todo.size, partial=True)
        if dst.size < todo.size:
            # No room for all of them (the rest of the tier is leased): the tail is a miss.
            short = todo.size - dst.size
            found[todo[dst.size:]] = False
            self.counters.tiers[tier].misses += short
            todo, r, src_of = todo[:dst.size], r[:dst.size], src_of[:dst.size]
            if dst.size == 0:
                return None, none, True
        st = ns.slots[tier]
        st.leases[dst] += 1
        plan = None
        try:
            for src in (Tier.HBM, Tier.HOST, Tier.NVME):
                m = src_of == src
                if not m.any():
                    continue
                if src is Tier.NVME:
                    plan = self.nvme.plan_read(ns, r[m], dst[m])
                else:
                    st.pool.write(dst[m], _to_numpy(ns.slots[src].pool.read(
                        cols["slot"][r[m], src])))
                moved = int(m.sum())
                c = self.counters.tiers[src]
                c.hits += moved
                c.bytes_read += moved * ns.block_bytes
                if SERVE_ORDER.index(src) > SERVE_ORDER.index(tier):
                    self.counters.tiers[tier].promotions += moved
            if plan is None:
                mem = np.ones(todo.size, dtype=bool)
            elif plan.rows.size == todo.size:
                # All from NVMe, a disk reader's usual batch: no copy to set now (an empty
                # _set_copy still costs its policy's on_insert, ~5 numpy calls).
                return plan, todo, dst.size < hit.sum()
            else:
                mem = src_of != Tier.NVME
            self.slots.set_copy(ns, r[mem], tier, dst[mem], cols["version"][r[mem]])
            slots[todo[mem]] = dst[mem]
            return plan, todo[~mem], dst.size < hit.sum()
        except BaseException:
            # A copy that raised (a device copy, the plan's gathers, set_copy): the slots go
            # back and the plan's segment pins end, or the get's error kept them (fix9).
            if plan is not None:
                ns.log.unpin(plan.pins)
            self.give_back(ns, tier, r, dst)
            raise

    def _bring_up_from_nvme(self, ns: Namespace, rows: np.ndarray, todo: np.ndarray,
                            found: np.ndarray) -> tuple[ReadPlan | None, np.ndarray, bool]:
        """bring_up into a host tier with no HBM tier above it: NVMe is the only source (the
        remote tier serves its own reads), so each block is a planned read or a miss. The hit
        check is one C call where _gets is built (numpy's otherwise, the same state:
        tests/test_transfers.py): this is the decide of every NVMe reader's get on the
        server's loop (issue 17, bench/stall.py)."""
        cols = ns.table.cols
        tiers = self.counters.tiers
        host = tiers[_HOST]
        m = todo.size
        if _nvme_hits is not None:
            # The hits and the misses' found in one C call (stall9: ~15 us of numpy calls).
            out_todo, out_rows = _empty(m, dtype=_I64), _empty(m, dtype=_I64)
            k = _nvme_hits(cols["version"], cols["copy_ver"], _contiguous(rows, dtype=_I64),
                           _contiguous(todo, dtype=_I64), ns.table.n_rows, _NVME_NUM, found,
                           out_todo, out_rows)
            todo, r = (out_todo, out_rows) if k == m else (out_todo[:k], out_rows[:k])
        else:
            r = rows[todo]
            hit = cols["copy_ver"][r, _NVME] == cols["version"][r]
            k = int(np.count_nonzero(hit))
            if k < m:
                found[todo[~hit]] = False
                todo, r = todo[hit], r[hit]
        if k < m:
            host.misses += m - k
            if k == 0:
                return None, _empty(0, dtype=_I64), False
        dst = self.slots.alloc(ns, _HOST, k, partial=True)
        short = k - dst.size
        if short:                       # no room for the tail (the rest is leased): misses
            found[todo[dst.size:]] = False
            host.misses += short
            k = dst.size
            todo, r = todo[:k], r[:k]
            if k == 0:
                return None, _empty(0, dtype=_I64), True
        if _fast is not None:           # (a fresh pool's int64 slots, distinct)
            _fast.pin_slots(ns.slots[_HOST].leases, dst)
        else:
            ns.slots[_HOST].leases[dst] += 1
        try:
            plan = self.nvme.plan_read(ns, r, dst)
        except BaseException:
            self.give_back(ns, _HOST, r, dst)       # as bring_up's (fix9)
            raise
        nvme = tiers[_NVME]
        nvme.hits += k
        nvme.bytes_read += k * ns.block_bytes
        host.promotions += k
        return plan, todo, short > 0

    def install_read(self, plan: ReadPlan, tier: Tier, pos: np.ndarray, rows: np.ndarray,
                      slots: np.ndarray, found: np.ndarray) -> None:
        """Under the lock, after plan was read: install the copies that are still wanted into
        batch positions pos, pinned. A copy that another get installed meanwhile is shared
        (ours goes back); one whose block moved on is a miss."""
        ns = plan.ns
        cols = ns.table.cols
        st = ns.slots[tier]
        valid = self.nvme.finish_read(plan)
        r, dst = plan.rows, plan.dst.astype(np.int64)
        have = valid & (cols["copy_ver"][r, tier] == cols["version"][r])
        fresh = valid & ~have
        if fresh.all():                 # the usual case: every copy read is installed
            self.slots.set_copy(ns, r, tier, dst, cols["version"][r])
            slots[pos] = dst
            return
        self.slots.set_copy(ns, r[fresh], tier, dst[fresh], cols["version"][r[fresh]])
        slots[pos[fresh]] = dst[fresh]
        theirs = cols["slot"][r[have], tier].astype(np.int64)
        add_one(st.leases, theirs)
        slots[pos[have]] = theirs
        back = dst[~fresh]
        # Freed while pinned (retired), then unpinned: one that raises in between leaves
        # them pinned, for the get's give_back, never given back twice (fix9).
        self.slots.free_slots(ns, tier, back)
        self.slots.unpin_slots(ns, tier, back)
        found[pos[~valid]] = False
        self.counters.tiers[tier].misses += int((~valid).sum())

    def install_shared(self, plan: ReadPlan, tier: Tier, pos: np.ndarray, slots: np.ndarray,
                       have: np.ndarray) -> None:
        """install_read when every record of plan was read, verified and is still at its row's
        version (coherence/_gets.c read_shares said so, and marked in have the rows whose copy
        in tier another get installed first): those are shared (pinned for this get, ours go
        back), the rest installed. The same effects as install_read's, without finish_read's
        checks, which would all pass, nor its mask work (stall10: beside 4 readers of random
        batches most installs share a block; install_read was ~125 us of the service's)."""
        ns = plan.ns
        st = ns.slots[tier]
        r, dst = plan.rows, plan.dst.astype(np.int64)
        if _install_shares is not None:
            self._install_shares_native(ns, st, plan, tier, pos, slots, have, dst)
            return
        mine, shared = np.flatnonzero(~have), np.flatnonzero(have)
        self.slots.set_copy(ns, r[mine], tier, dst[mine], plan.versions[mine])
        slots[pos[mine]] = dst[mine]
        theirs = ns.table.cols["slot"][r[shared], tier].astype(np.int64)
        st.leases[theirs] += 1          # distinct: each row (distinct) has its own slot
        slots[pos[shared]] = theirs
        back = dst[shared]
        # Freed while pinned (retired), then unpinned, as in install_read (fix9).
        self.slots.free_slots(ns, tier, back)
        self.slots.unpin_slots(ns, tier, back)

    def _install_shares_native(self, ns: Namespace, st: Any, plan: ReadPlan, tier: Tier,
                               pos: np.ndarray, slots: np.ndarray, have: np.ndarray,
                               dst: np.ndarray) -> None:
        """install_shared's writes in one C call (_gets.c install_shares: stall11, ~83 us of
        the service's install step in numpy calls before, ~31 after), then the unpin and the
        policy.
        The slots going back were never placed, so the policy is not told of them
        (free_slots' on_remove of them changed nothing: tests/test_stall11_install.py); they
        come back retired and pinned, and the unpin frees them, before the policy hears of
        ours: whatever raises leaves the rest pinned for the get's give_back, and nothing
        freed twice or kept."""
        cols = ns.table.cols
        out = _empty((3, dst.size), dtype=_I64)
        k_mine, k_back = _install_shares(
            cols["slot"], cols["copy_ver"], st.slot_row, st.leases, st.retired,
            _contiguous(plan.rows, dtype=_I64), int(tier), dst,
            _contiguous(plan.versions, dtype=np.uint64), have, _contiguous(pos, dtype=_I64),
            slots, out)
        if k_back:
            self.slots.unpin_slots(ns, tier, out[2, :k_back])
        if k_mine:
            self.slots.placed(ns, tier, out[0, :k_mine], out[1, :k_mine])

    def give_back(self, ns: Namespace, tier: Tier, rows: np.ndarray, dst: np.ndarray) -> None:
        """Under the lock, after a step that raised (an NVMe read's install, a remote fill):
        the slots dst, pinned for copies of rows (distinct, aligned with dst) that the step
        was to place, go back free, with the host budget. A copy it placed is dropped: the
        row keeps its other copies, and the get that raised serves none. A slot whose pin the
        step ended itself (install_read's tail) was given back by it and is left alone."""
        st = ns.slots[tier]
        mine = st.leases[dst] > 0
        placed = mine & (ns.table.cols["slot"][rows, tier] == dst)
        if placed.any():
            self.slots.drop_copies(ns, rows[placed], tier)     # pinned: retired
        self.slots.free_slots(ns, tier, dst[mine & ~placed])    # pinned: retired too
        self.slots.unpin_slots(ns, tier, dst[mine])     # and freed with their last pin

    def _prefetch_rows(self, namespace: str, keys: Any) -> tuple[Any, np.ndarray]:
        """What prefetch_after would move: the chain's next blocks below the host tier, in
        breadth-first order from the last key's children, cut to ``prefetch_blocks`` and to the
        free host room. Memory only. Returns (namespace or None, rows)."""
        none = np.empty(0, dtype=np.int64)
        limit = self.settings.prefetch_blocks
        ns = self.namespaces.get(namespace)
        if limit <= 0 or ns is None or ns.log is None:
            return None, none
        karr = ns.table.keys_array(keys)
        if karr.size == 0:
            return None, none
        cols = ns.table.cols
        start = int(ns.table.lookup(karr[-1:])[0])
        if start < 0:
            return None, none
        want: list[int] = []
        frontier = ns.table.children(start)
        seen = 0
        while frontier and len(want) < limit and seen < 16 * limit:
            nxt: list[int] = []
            for r in frontier:
                seen += 1
                v = cols["version"][r]
                if cols["copy_ver"][r, Tier.HOST] != v and cols["copy_ver"][r, Tier.NVME] == v:
                    want.append(r)
                nxt.extend(ns.table.children(r))
            frontier = nxt
        room = min(len(want), limit, ns.slots[Tier.HOST].pool.free_count,
                   (self.settings.host_capacity - self.slots.host_used) // ns.block_bytes)
        return ns, np.asarray(want[:max(room, 0)], dtype=np.int64)

    def wants_prefetch(self, namespace: str, keys: Any) -> bool | None:
        """Whether prefetch_after(namespace, keys) would move anything (memory only, cheap), so
        that a get of blocks whose successors are resident costs no background task. None when
        the engine lock is busy (the caller then lets prefetch_after decide)."""
        ns = self.namespaces.get(namespace)
        if self.settings.prefetch_blocks <= 0 or ns is None or ns.log is None:
            return False                  # nothing below the host tier to prefetch from
        if not self.lock.acquire(blocking=False):
            return None
        try:
            return self._prefetch_rows(namespace, keys)[1].size > 0
        finally:
            self.lock.release()

    def prefetch_after(self, namespace: str, keys: Any) -> int:
        """After a prefix hit, bring the chain's next blocks one tier up (NVMe -> host), as
        _prefetch_rows picks them. Only free host slots are used: a guess never evicts. The
        read runs without the engine lock. Returns the blocks moved."""
        with self.lock:
            ns, rows = self._prefetch_rows(namespace, keys)
            if rows.size == 0:
                return 0
            dst = self.slots.alloc(ns, Tier.HOST, rows.size, partial=True)
            if dst.size == 0:
                return 0
            ns.slots[Tier.HOST].leases[dst] += 1
            plan = self.nvme.plan_read(ns, rows[:dst.size], dst)
        return self._read_up(ns, plan, dst)

    def stage(self, namespace: str, keys: Any) -> int:
        """Bring the current version of each of keys that only NVMe holds up to the host
        tier, unleased, so that a get of them soon after (an engine's load of a prefix it
        found with match_prefix) is a memory copy. Unlike prefetch_after this is demand, not a
        guess: it evicts other blocks for room, never the batch's own host copies (pinned
        while room is made). The read runs without the engine lock. Returns the blocks moved."""
        with self.lock:
            ns = self.namespace(namespace)
            cols = ns.table.cols
            rows = ns.table.lookup(ns.table.keys_array(keys))
            rows = np.unique(rows[rows >= 0])
            if ns.log is None or rows.size == 0:
                return 0
            ver = cols["version"][rows]
            held = (cols["copy_ver"][rows][:, [Tier.HBM, Tier.HOST]] == ver[:, None]).any(axis=1)
            want = rows[~held & (ver > 0) & (cols["copy_ver"][rows, Tier.NVME] == ver)]
            if want.size == 0:
                return 0
            st = ns.slots[Tier.HOST]
            resident = rows[cols["copy_ver"][rows, Tier.HOST] == ver]
            keep = cols["slot"][resident, Tier.HOST].astype(np.int64)
            add_one(st.leases, keep)
            try:
                dst = self.slots.alloc(ns, Tier.HOST, want.size, partial=True)
            finally:
                self.slots.unpin_slots(ns, Tier.HOST, keep)
            if dst.size == 0:
                return 0
            st.leases[dst] += 1
            plan = self.nvme.plan_read(ns, want[:dst.size], dst)
        moved = self._read_up(ns, plan, dst)
        if self.nvme.wanted():
            self.nvme.drain()
        return moved

    def _read_up(self, ns: Namespace, plan: ReadPlan, dst: np.ndarray) -> int:
        """Read a planned NVMe -> host promotion into dst (pinned by the caller) without the
        lock, then install it, unleased, under the lock: prefetch_after's and stage's end."""
        st = ns.slots[Tier.HOST]
        try:
            self.nvme.run_read(plan, st.pool)
        finally:
            # Installed (or, after a read that raised, given back: finish_read then keeps
            # nothing) in every case, so that the pinned slots are never lost to the tier.
            with self.lock:
                pos = np.arange(dst.size)
                slots = np.full(dst.size, -1, dtype=np.int64)
                found = np.ones(dst.size, dtype=bool)
                self.install_read(plan, Tier.HOST, pos, plan.rows, slots, found)
                self.slots.unpin_slots(ns, Tier.HOST, slots[found])    # a promoted copy: no lease
                moved = int(found.sum())
                self.counters.tiers[Tier.HOST].misses -= int((~found).sum())
                self.counters.tiers[Tier.HOST].prefetched += moved
                self.counters.tiers[Tier.HOST].promotions += moved
        self.nvme.after_read(plan)
        return moved

    # ------------------------------------------------------------------ remote tier

    def push_remote(self, ns: Namespace, rows: np.ndarray) -> None:
        """Write rows' current versions to the remote tier (from their host copies)."""
        cols = ns.table.cols
        rows = rows[cols["copy_ver"][rows, Tier.HOST] == cols["version"][rows]]
        if rows.size == 0:
            return
        pool = ns.slots[Tier.HOST].pool
        views = [pool.array[s] for s in cols["slot"][rows, Tier.HOST].tolist()]
        ok = self.remote.put_many(ns.name, [bytes(k) for k in cols["key"][rows]],
                                  cols["version"][rows], cols["checksum"][rows], views)
        cols["copy_ver"][rows[ok], Tier.REMOTE] = cols["version"][rows[ok]]

    def from_remote(self, ns: Namespace, karr: np.ndarray, rows: np.ndarray,
                     found: np.ndarray, slots: np.ndarray, tier: Tier) -> None:
        """Fill local misses from the remote tier, checksummed; install a host copy, leased."""
        miss = np.flatnonzero(~found)
        got, versions, sums, data = self.remote.get_many(
            ns.name, [bytes(k) for k in karr[miss]], ns.block_bytes)
        if not got.any() or tier is not Tier.HOST:
            return
        cols = ns.table.cols
        gi = np.flatnonzero(got)            # into miss (and get_many's outputs)
        pos = miss[gi]
        every, made = ns.table.insert(karr[pos])
        rep = _NO_SLOTS
        if every.size > 1:
            _, first = np.unique(every, return_index=True)
            if first.size < every.size:
                # A key the batch repeats is filled once, its repeats share the slot (each
                # with its pin, below): two slots for one row left one named by no copy.
                first.sort()
                rep = np.setdiff1d(np.arange(every.size), first)
                rep, rep_rows = pos[rep], every[rep]
                gi, pos, every, made = gi[first], pos[first], every[first], made[first]
        # What a fill that raises puts back (fix9): the columns it writes of those rows, and
        # the rows it made (removed again while empty, as after a fill that found no room:
        # they were left, counted as blocks, before).
        old = [cols[c][every] for c in _FILLED]
        made = every[made]
        dst = _NO_SLOTS
        try:
            vr = versions[gi]
            # A remote version older than what this host knows is stale here: never served.
            fresh = vr >= cols["version"][every]
            pos, new_rows, vr = pos[fresh], every[fresh], vr[fresh]
            blobs = [data[i] for i in gi[fresh].tolist()]
            if pos.size:
                dst = self.slots.alloc(ns, Tier.HOST, pos.size, partial=True)
                ns.slots[Tier.HOST].leases[dst] += 1
            if dst.size < pos.size:
                # No room for the tail (the rest of the tier is leased): misses, and the rows
                # made for them go again.
                ns.table.remove(np.setdiff1d(made, new_rows[:dst.size]))
                made = np.intersect1d(made, new_rows[:dst.size])
                if dst.size == 0:
                    return
                pos, new_rows, vr = pos[:dst.size], new_rows[:dst.size], vr[:dst.size]
                blobs = blobs[:dst.size]
            for t in list(ns.slots):
                self.slots.drop_copies(ns, new_rows, t)
            pool = ns.slots[Tier.HOST].pool
            for slot, blob in zip(dst.tolist(), blobs):
                pool.array[slot] = np.frombuffer(blob, dtype=np.uint8)
            cols["state"][new_rows] = next_states(cols["state"][new_rows], Event.COMMIT)
            cols["version"][new_rows] = vr
            cols["checksum"][new_rows] = sums[gi[fresh][: dst.size]]
            cols["size"][new_rows] = ns.block_bytes
            cols["leases"][new_rows] = 0
            self.slots.set_copy(ns, new_rows, Tier.HOST, dst, vr)
        except BaseException:
            # The slots go back free (a copy set_copy placed is dropped), the rows are as
            # they were and the ones made here go: rev8 gave back only the slots no row
            # named, and left a row at the remote version with no copy, dirty (fix9).
            if dst.size:
                self.give_back(ns, Tier.HOST, new_rows, dst)
            for c, before in zip(_FILLED, old):
                cols[c][every] = before
            ns.table.remove(made)
            raise
        cols["copy_ver"][new_rows, Tier.REMOTE] = vr
        rows[pos] = new_rows
        slots[pos] = dst
        found[pos] = True
        if rep.size:
            shared = np.isin(rep_rows, new_rows)
            rep, rep_rows = rep[shared], rep_rows[shared]
            share = cols["slot"][rep_rows, Tier.HOST].astype(np.int64)
            add_one(ns.slots[Tier.HOST].leases, share)
            rows[rep], slots[rep], found[rep] = rep_rows, share, True
        self.counters.tiers[Tier.REMOTE].hits += int(pos.size + rep.size)    # per position
        self.counters.tiers[Tier.HOST].promotions += int(pos.size)
        if self.settings.write_policy == "write_through" and ns.log is not None:
            self.nvme.write_down(ns, new_rows)      # written once the lock is released


# The columns a remote fill writes of its rows (put back when it raises).
_FILLED = ("state", "version", "checksum", "size", "leases")
_NO_SLOTS = np.empty(0, dtype=np.int64)


def remote_from_settings(settings: Settings) -> Any:
    """The remote tier the settings ask for, or None."""
    urls = [u.strip() for u in settings.redis.split(",") if u.strip()]
    if not urls:
        return None
    from redis.exceptions import RedisError

    from kvtier.errors import ConfigError
    from kvtier.tiers.remote import RemoteStore, RemoteTier
    try:
        return RemoteTier(RemoteStore(urls, cluster=settings.redis_cluster,
                                      ttl=settings.redis_ttl, timeout=settings.redis_timeout))
    except (RedisError, OSError, TimeoutError) as exc:
        raise ConfigError(f"redis: cannot reach {settings.redis}: {exc}") from None
