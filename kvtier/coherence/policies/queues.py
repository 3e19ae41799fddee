"""The eviction policies of the slot tiers (HBM, host), each a maintained structure per namespace
and tier, so that choosing n victims costs O(n) amortised whatever the number of resident blocks.

The engine tells a policy three things (coherence.eviction is the only caller):

    on_insert(rows, slots)   these rows' copies were just placed in these slots, in batch order
    on_remove(slots)         these slots are being freed (evicted, overwritten or deleted)
    victims(n)               pop up to n unleased slots in eviction order; the engine then frees
                             them (on_remove) or hands back those it could not use (give_back)
    victims(n, drop=True)    the same, for a caller that frees every one of them at once (the
                             lowest tier's eviction): the policy forgets them as on_remove would,
                             in the same step, and the caller does not call on_remove

Accesses are not reported: a policy reads the page table's ``freq`` and ``last_access`` columns of
the rows it looks at, which every get already maintains (the C fast path included). So a policy
works lazily: an entry is re-examined only when it reaches the head of its queue.

    LruQueue    exact LRU: entries bucketed by epoch of last access (2^10 clock ticks); the oldest
                bucket is sorted when it is reached, an entry accessed since moves to its new
                bucket. Each access moves an entry at most once.
    S3Fifo      S3-FIFO (Yang et al., SOSP'23): a probation FIFO of a fixed share of the tier, a
                main FIFO whose entries carry a 0..freq_max counter (CLOCK-like: a pass over an
                entry with count c > 0 re-queues it with c - 1, so frequency ages), and a ghost of
                evicted keys; a key found in the ghost skips probation. With leaf_first, each put
                batch enters the queues deepest block first, so among blocks of equal standing a
                chain loses its leaves before its parents.

Each method is one call of kvtier.coherence.policies._queues where that module was built (the
numpy code here is the reference, and the fallback; tests compare the two step by step).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np

from kvtier.coherence.policies.rings import Ghost, Ring

try:
    from kvtier.coherence.policies import _queues
except ImportError:                       # not built: the numpy versions below run instead
    _queues = None

if TYPE_CHECKING:
    from kvtier.coherence.namespace import SlotState
    from kvtier.pagetable.table import PageTable

NONE = -1
EPOCH_SHIFT = 10
_EMPTY = np.empty(0, dtype=np.int64)
# The copies on_remove saw replaced, for the on_insert that follows: (hash as int64, queue,
# counter) per slot.
_NO_REPLACED = np.empty((0, 3), dtype=np.int64)
# A policy's scalar state, one int64 array that the C versions (_queues.c, same names) update
# in place: the next stamp, the two queues' counts, ghost hits, each ring's head and length,
# then S3Fifo's parameters (probation target, freq_max, leaf_first, the ring compaction
# threshold).
(ST_NEXT, ST_COUNT0, ST_COUNT1, ST_GHOST_HITS, ST_HEAD0, ST_LEN0, ST_HEAD1, ST_LEN1,
 ST_SMALL_TARGET, ST_FREQ_MAX, ST_LEAF_FIRST, ST_COMPACT_AT, ST_SIZE) = range(13)


# numpy names the hot paths read as globals (why: kvtier.pagetable.table, at _empty).
(_I64, _U64, _contiguous, _empty, _ndarray) = (
    np.int64, np.uint64, np.ascontiguousarray, np.empty, np.ndarray)


def _i64(a: np.ndarray) -> np.ndarray:
    return _contiguous(a, dtype=_I64)


def _distinct(a: np.ndarray) -> np.ndarray:
    """np.unique(a) of a 1-D array, without np.unique: numpy 2's imports numpy.ma on its
    first call (~8 ms of CPU on the dev VM), which landed inside the first replayed policy's
    timed loop (lru's 0.15 s), and it is several calls more for a put's few epochs."""
    s = np.sort(a)
    first = _empty(s.size, dtype=bool)
    if s.size:
        first[0] = True
        np.not_equal(s[1:], s[:-1], out=first[1:])
    return s[first]


def _positions(table: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Index of each value in table (distinct entries), -1 where absent."""
    order = np.argsort(table, kind="stable")
    at = np.searchsorted(table, values, sorter=order)
    at = np.minimum(at, table.size - 1)
    found = table[order[at]] == values
    return np.where(found, order[at], -1)


class _SlotPolicy:
    """What every slot-tier policy keeps per slot: the stamp of its current entry (column 0 of
    _per; a subclass may keep more columns there), and where that entry is (NONE, a queue
    number, or PENDING + queue once handed out as a victim)."""

    PENDING = 8
    COLUMNS = 1

    def __init__(self, st: SlotState, table: PageTable) -> None:
        self.st = st
        self.table = table
        n = st.pool.n_slots
        self.n_slots = n
        self._per = np.zeros((n, self.COLUMNS), dtype=np.int64)
        self._per[:, 0] = -1
        self._stamp = self._per[:, 0]
        self._where = np.full(n, NONE, dtype=np.int8)
        self._st = np.zeros(ST_SIZE, dtype=np.int64)

    _next = property(lambda self: int(self._st[ST_NEXT]),
                     lambda self, v: self._st.__setitem__(ST_NEXT, v))

    def _stamps(self, slots: np.ndarray) -> np.ndarray:
        s = np.arange(self._next, self._next + slots.size, dtype=np.int64)
        self._next += int(slots.size)
        self._stamp[slots] = s
        return s

    def _valid(self, slots: np.ndarray, stamps: np.ndarray, where: int) -> np.ndarray:
        return (self._stamp[slots] == stamps) & (self._where[slots] == where)

    def _leased(self, slots: np.ndarray) -> np.ndarray:
        return self.st.leases[slots] > 0

    def _live_stamps(self, where: int) -> np.ndarray:
        return np.where(self._where == where, self._stamp, -1)

    def resident(self) -> int:
        return int(((self._where >= 0) & (self._where < self.PENDING)).sum())

    def state(self) -> dict:
        """Everything that decides the policy's next choices, as plain values (tests compare
        the C and numpy versions by it; physical ring positions are left out)."""
        return {"where": self._where.tolist(), "per": self._per.tolist(), "next": self._next}


class LruQueue(_SlotPolicy):
    """Least recently used first, exactly (see the module docstring)."""

    def __init__(self, st: SlotState, table: PageTable) -> None:
        super().__init__(st, table)
        self._buckets: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._epochs: list[int] = []          # heap of the keys of _buckets
        # The oldest bucket, sorted by last access, consumed from _pos on.
        # (slot, stamp, last access) rows, sorted by the last; int64 (the clock is far below
        # 2^63), one array so that _queues.lru_take reads it as it is.
        self._cur: np.ndarray | None = None
        self._cur_epoch = -1
        self._pos = 0
        self._scratch = np.empty((64, 3), dtype=np.int64)   # lru_take's moved and held

    def state(self) -> dict:
        out = super().state()
        out["buckets"] = {e: sorted(zip(np.concatenate([c[0] for c in ch]).tolist(),
                                        np.concatenate([c[1] for c in ch]).tolist()))
                          for e, ch in sorted(self._buckets.items())}
        out["epochs"] = sorted(self._epochs)
        out["cur"] = None if self._cur is None else self._cur[self._pos:].tolist()
        return out

    def _bucket(self, e: int) -> list[tuple[np.ndarray, np.ndarray]]:
        chunks = self._buckets.get(e)
        if chunks is None:
            chunks = self._buckets[e] = []
            heapq.heappush(self._epochs, e)
        return chunks

    def _add(self, slots: np.ndarray, stamps: np.ndarray, last: np.ndarray) -> None:
        ep = (last >> np.uint64(EPOCH_SHIFT)).astype(np.int64)
        if ep.size and ep[0] == ep[-1] and (ep.size < 3 or (ep == ep[0]).all()):
            groups = [(int(ep[0]), slice(None))]
        else:
            groups = [(int(e), ep == e) for e in _distinct(ep)]
        for e, sel in groups:
            self._bucket(e).append((slots[sel], stamps[sel]))

    def on_insert(self, rows: np.ndarray, slots: np.ndarray) -> None:
        last = self.table.cols["last_access"]
        if _queues is not None:
            rows = _contiguous(rows, dtype=_I64)     # _i64, without its frame
            slots = _contiguous(slots, dtype=_I64)
            stamps = _empty(slots.size, dtype=_I64)
            e = _queues.lru_insert(self._per, self._where, self._st, rows, slots, last, stamps)
            if e >= 0:                        # the batch's accesses are of one epoch
                chunks = self._buckets.get(e)     # (_bucket, without its frame when it exists)
                (self._bucket(e) if chunks is None else chunks).append((slots, stamps))
            elif slots.size:
                self._add(slots, stamps, last[rows])
            return
        self._where[slots] = 0
        self._add(slots, self._stamps(slots), last[rows])

    def on_remove(self, slots: np.ndarray) -> None:
        self._where[slots] = NONE

    def give_back(self, slots: np.ndarray) -> None:
        back = slots[self._where[slots] == self.PENDING]
        self._where[back] = 0
        rows = self.st.slot_row[back]
        self._add(back, self._stamp[back], self.table.cols["last_access"][rows])

    def _load_oldest(self) -> bool:
        while self._epochs:
            e = heapq.heappop(self._epochs)
            chunks = self._buckets.pop(e)
            slots = np.concatenate([c[0] for c in chunks])
            stamps = np.concatenate([c[1] for c in chunks])
            ok = self._valid(slots, stamps, 0)
            slots, stamps = slots[ok], stamps[ok]
            last = self.table.cols["last_access"][self.st.slot_row[slots]]
            moved = (last >> np.uint64(EPOCH_SHIFT)).astype(np.int64) != e
            if moved.any():
                self._add(slots[moved], stamps[moved], last[moved])
                slots, stamps, last = slots[~moved], stamps[~moved], last[~moved]
            if slots.size:
                order = np.argsort(last, kind="stable")
                self._cur = np.stack([slots[order], stamps[order],
                                      last[order].astype(np.int64)], axis=1)
                self._cur_epoch = e
                self._pos = 0
                return True
        return False

    def victims(self, n: int, drop: bool = False) -> np.ndarray:
        # No more victims than slots: an admin evict of "everything" asks for 2^30, and the
        # output and scratch arrays are sized by n.
        cap = self.st.slot_row.shape[0]
        if n > cap:                # (builtin min: a tuple and an iteration, ~0.1 us)
            n = cap
        if _queues is None:
            out = self._victims_numpy(n)
            if drop:
                self.on_remove(out)
            return out
        out = _empty(n, dtype=_I64)
        if self._scratch.shape[0] < 2 * n + 32:
            self._scratch = _empty((2 * n + 32, 3), dtype=_I64)
        scratch, size = self._scratch, self._scratch.shape[0]
        last_col, slot_row = self.table.cols["last_access"], self.st.slot_row
        pinned: list[_ndarray] = []
        k = 0
        while k < n:
            if self._cur is None or self._pos >= self._cur.shape[0]:
                self._cur = None
                if not self._load_oldest():
                    break
            # (drop: lru_take sets a victim's where to NONE, on_remove's frame and fancy
            # assignment saved on every put of the replay that evicts.)
            self._pos, took, moved, held = _queues.lru_take(
                self._per, self._where, self._st, self._cur, self._pos, n - k, slot_row,
                last_col, self.st.leases, out if k == 0 else out[k:], scratch, drop)
            k += took
            if moved:                          # accessed since the sort: to their new bucket
                m = scratch[:moved].copy()
                self._add(m[:, 0], m[:, 1], m[:, 2].astype(_U64))
            if held:                           # written from the end, last first
                pinned.append(scratch[size - held:][::-1].copy())
        for p in pinned:                       # leased now; they come round again
            self._add(p[:, 0], p[:, 1], last_col[slot_row[p[:, 0]]])
        return out if k == n else out[:k]      # (a slice is a numpy view: ~1k instructions)

    def _victims_numpy(self, n: int) -> np.ndarray:
        out: list[np.ndarray] = []
        need = n
        pinned: list[tuple[np.ndarray, np.ndarray]] = []
        last_col = self.table.cols["last_access"]
        while need > 0:
            if self._cur is None or self._pos >= self._cur.shape[0]:
                self._cur = None
                if not self._load_oldest():
                    break
            cur = self._cur
            if cur is None:
                break
            # Exactly as many as still needed, so that every entry looked at is settled here:
            # taken, re-bucketed, set aside while leased, or dropped as stale.
            slots, stamps, last = (cur[self._pos:self._pos + need, j] for j in range(3))
            last = last.astype(np.uint64)
            self._pos += slots.size
            ok = self._valid(slots, stamps, 0)
            slots, stamps, last = slots[ok], stamps[ok], last[ok]
            now = last_col[self.st.slot_row[slots]]
            touched = now != last          # accessed since the bucket was sorted: re-bucket
            if touched.any():
                self._add(slots[touched], stamps[touched], now[touched])
                slots, stamps = slots[~touched], stamps[~touched]
            held = self._leased(slots)
            if held.any():
                pinned.append((slots[held], stamps[held]))
                slots = slots[~held]
            self._where[slots] = self.PENDING
            out.append(slots)
            need -= slots.size
        for slots, stamps in pinned:       # leased now; they come round again
            self._add(slots, stamps, last_col[self.st.slot_row[slots]])
        return np.concatenate(out) if out else _EMPTY


class S3Fifo(_SlotPolicy):
    """S3-FIFO with a ghost sized as a multiple of the tier (see the module docstring).

    With kvtier.coherence.policies._queues built, each of on_insert, on_remove, victims and
    give_back is one C call over the same arrays; the numpy methods (_*_numpy) are the
    reference, and run where the module was not built."""

    SMALL, MAIN = 0, 1
    COLUMNS = 3                    # stamp, base (freq when last looked at), cnt (aging counter)

    def __init__(self, st: SlotState, table: PageTable, small: float, ghost_blocks: int,
                 freq_max: int, leaf_first: bool) -> None:
        super().__init__(st, table)
        self.small_target = max(1, int(round(small * self.n_slots)))
        self.freq_max = int(freq_max)
        self.leaf_first = bool(leaf_first)
        self.ghost = Ghost(ghost_blocks)
        self._st[ST_SMALL_TARGET] = self.small_target
        self._st[ST_FREQ_MAX] = self.freq_max
        self._st[ST_LEAF_FIRST] = int(self.leaf_first)
        self._st[ST_COMPACT_AT] = 2 * self.n_slots + 1024
        ring = min(self.n_slots, 1 << 16)
        self._rings = (Ring(ring, self._st[ST_HEAD0:ST_LEN0 + 1]),
                       Ring(ring, self._st[ST_HEAD1:ST_LEN1 + 1]))
        self._count = self._st[ST_COUNT0:ST_COUNT1 + 1]        # a view: counts per queue
        self._base = self._per[:, 1]
        self._cnt = self._per[:, 2]
        self._replaced: np.ndarray = _NO_REPLACED
        # The ghost's arrays for the C calls, as one tuple made here (Ghost never replaces
        # them): on_insert and on_remove pass them without a frame and a tuple each.
        g = self.ghost
        self._ghost_args: tuple[np.ndarray, ...] = (g._fp, g._seq, g._alive, g._st)

    ghost_hits = property(lambda self: int(self._st[ST_GHOST_HITS]))

    def state(self) -> dict:
        out = super().state()
        g = self.ghost
        out.update(counts=self._count.tolist(), ghost_hits=self.ghost_hits,
                   rings=[[a.tolist() for a in r.entries()] for r in self._rings],
                   replaced=self._replaced.tolist(),
                   ghost=[g._st.tolist(), g._fp.tolist(), g._seq.tolist(), g._alive.tolist()])
        return out

    def _hashes(self, slots: np.ndarray) -> np.ndarray:
        return self.table._hash(self.table.cols["key"][self.st.slot_row[slots]])

    def _c_args(self) -> tuple[np.ndarray, ...]:
        return (self._per, self._where, self._st, self._rings[0]._buf, self._rings[1]._buf)

    def on_insert(self, rows: np.ndarray, slots: np.ndarray) -> None:
        if _queues is None:
            return self._on_insert_numpy(rows, slots)
        n = rows.size
        st = self._st
        small, main = self._rings
        # Ring.reserve's test for both rings inline, its frames only when one must grow (every
        # NVMe get's install places its copies here: stall9).
        if (st.item(ST_LEN0) + n > small._buf.shape[0]
                or st.item(ST_LEN1) + n > main._buf.shape[0]):
            small.reserve(n)
            main.reserve(n)
        cols = self.table.cols
        _queues.s3_insert(self._per, self._where, st, small._buf, main._buf, *self._ghost_args,
                          cols["key"], self.table.key_width, cols["freq"],
                          _contiguous(rows, dtype=_I64), _contiguous(slots, dtype=_I64),
                          self._replaced)
        self._replaced = _NO_REPLACED

    def on_remove(self, slots: np.ndarray) -> None:
        if _queues is None:
            return self._on_remove_numpy(slots)
        out = _empty((slots.size, 3), dtype=_I64)
        k = _queues.s3_remove(self._per, self._where, self._st,
                              *self._ghost_args, self.st.slot_row,
                              self.table.cols["key"], self.table.key_width,
                              _contiguous(slots, dtype=_I64), out)
        if k >= 0:
            self._replaced = out[:k]

    def victims(self, n: int, drop: bool = False) -> np.ndarray:
        # No more victims than slots: an admin evict of "everything" asks for 2^30, and the
        # output and scratch arrays are sized by n.
        cap = self.st.slot_row.shape[0]
        if n > cap:                # (builtin min: a tuple and an iteration, ~0.1 us)
            n = cap
        if _queues is None:
            out = self._victims_numpy(n)
            if drop and out.size:
                self.on_remove(out)
            return out
        # Probation's entries may all move to main in this call; nothing else adds entries.
        # (Ring.reserve's test inline, and _c_args' tuple below: three frames a put.)
        st = self._st
        small, main = self._rings
        if st.item(ST_LEN1) + st.item(ST_LEN0) > main._buf.shape[0]:
            main.reserve(st.item(ST_LEN0))
        out = _empty(n, dtype=_I64)
        cols = self.table.cols
        if drop:
            # s3_remove's work on them in the same call: the ghost remembers their keys.
            k = _queues.s3_victims(self._per, self._where, st, small._buf, main._buf,
                                   self.st.slot_row, cols["freq"], self.st.leases, n, out,
                                   *self._ghost_args, cols["key"], self.table.key_width)
            if k:
                self._replaced = _NO_REPLACED     # as on_remove of pending slots leaves it
        else:
            k = _queues.s3_victims(self._per, self._where, st, small._buf, main._buf,
                                   self.st.slot_row, cols["freq"], self.st.leases, n, out)
        return out if k == n else out[:k]

    def give_back(self, slots: np.ndarray) -> None:
        if _queues is None:
            return self._give_back_numpy(slots)
        for ring in self._rings:
            ring.reserve(slots.size)
        _queues.s3_give_back(*self._c_args(), _i64(slots))

    # ---------------------------------------------------------------- the numpy versions

    def _on_insert_numpy(self, rows: np.ndarray, slots: np.ndarray) -> None:
        if self.leaf_first and rows.size > 1:
            rows, slots = rows[::-1], slots[::-1]
        stale = self._where[slots]
        for q in (self.SMALL, self.MAIN):
            self._count[q] -= int((stale == q).sum())
        cols = self.table.cols
        hashes = self.table._hash(cols["key"][rows])
        stamps = self._stamps(slots)
        freq = cols["freq"][rows].astype(np.int64)
        self._base[slots] = freq
        self._cnt[slots] = 0
        where = np.zeros(slots.size, dtype=np.int8)
        fresh = np.ones(slots.size, dtype=bool)
        rep = self._replaced
        if rep.shape[0]:
            self._replaced = _NO_REPLACED
            old_h, old_w, old_cnt = rep[:, 0].view(np.uint64), rep[:, 1], rep[:, 2]
            pos = _positions(old_h, hashes)
            back = pos >= 0
            where[back] = old_w[pos[back]]
            self._cnt[slots[back]] = np.minimum(old_cnt[pos[back]] + 1, self.freq_max)
            self._base[slots[back]] = freq[back] - (where[back] == self.SMALL)
            fresh &= ~back
        seen = np.zeros(slots.size, dtype=bool)
        seen[fresh] = self.ghost.take(hashes[fresh])
        self._st[ST_GHOST_HITS] += int(seen.sum())
        where[seen] = self.MAIN
        for q in (self.MAIN, self.SMALL):
            sel = where == q
            self._push(q, slots[sel], stamps[sel])

    def _push(self, q: int, slots: np.ndarray, stamps: np.ndarray, front: bool = False) -> None:
        if slots.size == 0:
            return
        self._where[slots] = q
        self._count[q] += int(slots.size)
        ring = self._rings[q]
        (ring.push_front if front else ring.push)(slots, stamps)
        if len(ring) > 2 * self.n_slots + 1024:
            ring.compact(self._live_stamps(q))

    def _on_remove_numpy(self, slots: np.ndarray) -> None:
        where = self._where[slots]
        gone = slots[where != NONE]
        if gone.size == 0:
            return
        w = where[where != NONE]
        for q in (self.SMALL, self.MAIN):
            self._count[q] -= int((w == q).sum())
        evicted = w >= self.PENDING
        self.ghost.add(self._hashes(gone[evicted]))
        # A copy dropped while queued is being replaced (a new version, or the same block put
        # again after a miss on an earlier block of its prefix): its standing is kept for the
        # on_insert that follows, as one more access.
        kept = gone[~evicted]
        rep = np.empty((kept.size, 3), dtype=np.int64)
        rep[:, 0] = self._hashes(kept).view(np.int64)
        rep[:, 1] = w[~evicted]
        rep[:, 2] = self._cnt[kept]
        self._replaced = rep
        self._where[gone] = NONE

    def _give_back_numpy(self, slots: np.ndarray) -> None:
        w = self._where[slots]
        for q in (self.SMALL, self.MAIN):
            back = slots[w == self.PENDING + q]
            self._push(q, back, self._stamp[back], front=True)

    def _victims_numpy(self, n: int) -> np.ndarray:
        out: list[np.ndarray] = []
        need = n
        budget = (self.freq_max + 2) * (self._count[0] + self._count[1]) + 64
        freq_col = self.table.cols["freq"]
        # Leased entries seen per queue in this call: once a queue has shown as many as it
        # holds, it has gone round with nothing to give (every entry leased), and the other
        # queue is taken instead, so that a leased probation queue never starves main.
        leased_seen = [0, 0]
        while need > 0 and budget > 0 and self._count[0] + self._count[1] > 0:
            # The n blocks to come will most likely enter probation: make their room there
            # while it would otherwise go over its share (as if they were already in).
            small = self._count[0] > 0 and (self._count[0] + n > self.small_target
                                             or self._count[1] == 0)
            q = self.SMALL if small else self.MAIN
            stuck = [leased_seen[i] >= self._count[i] for i in (self.SMALL, self.MAIN)]
            if stuck[q]:
                if stuck[1 - q] or self._count[1 - q] == 0:
                    break
                q = 1 - q
            slots, stamps = self._rings[q].pop(max(need, 32))
            if slots.size == 0:            # counts and ring disagree: nothing left to find
                self._count[q] = 0
                budget -= 1
                continue
            budget -= slots.size
            ok = self._valid(slots, stamps, q)
            slots, stamps = slots[ok], stamps[ok]
            freq = freq_col[self.st.slot_row[slots]].astype(np.int64)
            acc = freq - self._base[slots]
            held = self._leased(slots)
            if q == self.SMALL:
                keep = (acc > 0) | held            # used again while on probation, or leased
                cnt = np.zeros(slots.size, dtype=np.int64)
            else:
                cnt = np.minimum(self._cnt[slots] + acc, self.freq_max)
                keep = (cnt > 0) | held
            # Settle the entries up to the need-th victim, exactly as one at a time would; the
            # rest go back to the head untouched.
            cut = slots.size
            if (~keep).sum() > need:
                cut = int(np.flatnonzero(~keep)[need - 1]) + 1
            self._rings[q].push_front(slots[cut:], stamps[cut:])
            slots, stamps, freq, keep, held, cnt = (
                a[:cut] for a in (slots, stamps, freq, keep, held, cnt))
            leased_seen[q] += int(held.sum())
            self._count[q] -= int(slots.size)
            self._where[slots] = NONE
            self._base[slots] = freq
            if q == self.SMALL:
                up = keep & ~held
                self._cnt[slots[up]] = 0
                self._push(self.MAIN, slots[up], stamps[up])
                self._push(self.SMALL, slots[held], stamps[held])
            else:
                cnt[keep & ~held] -= 1
                self._cnt[slots] = cnt
                self._push(self.MAIN, slots[keep], stamps[keep])
            take = slots[~keep]
            self._where[take] = self.PENDING + q
            out.append(take)
            need -= take.size
        return np.concatenate(out) if out else _EMPTY
