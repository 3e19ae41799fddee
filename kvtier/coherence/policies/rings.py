"""The maintained structures that eviction policies pop victims from, in numpy (their C
versions, which the policies call on the hot path, are in kvtier.coherence.policies._queues).

``Ring`` is a double-ended queue of (slot, stamp) pairs in a circular numpy buffer: pushes and pops
of a batch are slice copies, so a policy's cost per evicted block does not depend on how many blocks
are resident. Entries are removed lazily: a slot that was freed, or reused by another row, keeps its
old entry until that entry reaches the head, where the policy sees that the slot's stamp moved on
and drops it. ``compact`` bounds the stale entries (amortised O(1) per push).

``Ghost`` remembers recently evicted keys by a 32-bit fingerprint of their 64-bit hash, in a
set-associative table with an age per entry. A false match (a key taken for one evicted) needs
equal fingerprints in one set: about 2^-29 per lookup, and all it does is admit a block to the
main queue.
"""

from __future__ import annotations

import numpy as np

try:
    from kvtier.coherence.policies import _queues
except ImportError:                       # not built: the numpy versions below run instead
    _queues = None


class Ring:
    """A deque of (slot int64, stamp int64) pairs; grows by doubling.

    The pairs are one (capacity, 2) array and (head, length) a 2-element array, which may be a
    view into the owner's state (S3Fifo keeps both rings' there, so that the C versions in
    kvtier.coherence.policies._queues update them in place). Those cannot grow a ring: the
    owner calls reserve(extra) before a C call that may add up to extra entries."""

    def __init__(self, capacity: int = 1024, state: np.ndarray | None = None) -> None:
        cap = 1 << max(4, int(capacity - 1).bit_length())
        self._buf = np.zeros((cap, 2), dtype=np.int64)
        self._st = np.zeros(2, dtype=np.int64) if state is None else state
        self._st[:] = 0

    _head = property(lambda self: int(self._st[0]),
                     lambda self, v: self._st.__setitem__(0, v))
    _n = property(lambda self: int(self._st[1]),
                  lambda self, v: self._st.__setitem__(1, v))

    def __len__(self) -> int:
        return self._st.item(1)

    @property
    def capacity(self) -> int:
        return int(self._buf.shape[0])

    def _index(self, start: int, n: int) -> np.ndarray:
        return (start + np.arange(n)) & (self._buf.shape[0] - 1)

    def reserve(self, extra: int) -> None:
        """Room for extra more entries without growing."""
        n = self._st.item(1)          # a Python int in one call (S3Fifo asks on every put)
        if n + extra <= self._buf.shape[0]:
            return
        cap = self._buf.shape[0]
        while cap < n + extra:
            cap *= 2
        new = np.zeros((cap, 2), dtype=np.int64)
        new[:n] = self._buf[self._index(int(self._st[0]), n)]
        self._buf = new
        self._st[0] = 0

    def entries(self) -> tuple[np.ndarray, np.ndarray]:
        """(slots, stamps) from head to tail, without taking them."""
        idx = self._index(self._head, self._n)
        return self._buf[idx, 0], self._buf[idx, 1]

    def push(self, slots: np.ndarray, stamps: np.ndarray) -> None:
        """Append at the tail, in order (the last one pushed leaves last)."""
        n = int(slots.size)
        if n == 0:
            return
        self.reserve(n)
        idx = self._index(self._head + self._n, n)
        self._buf[idx, 0] = slots
        self._buf[idx, 1] = stamps
        self._n += n

    def push_front(self, slots: np.ndarray, stamps: np.ndarray) -> None:
        """Put back at the head, in order (slots[0] leaves first)."""
        n = int(slots.size)
        if n == 0:
            return
        self.reserve(n)
        self._head = (self._head - n) & (self._buf.shape[0] - 1)
        idx = self._index(self._head, n)
        self._buf[idx, 0] = slots
        self._buf[idx, 1] = stamps
        self._n += n

    def pop(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Take up to n entries from the head."""
        n = min(n, self._n)
        idx = self._index(self._head, n)
        out = self._buf[idx, 0], self._buf[idx, 1]
        self._head = (self._head + n) & (self._buf.shape[0] - 1)
        self._n -= n
        return out

    def compact(self, live: np.ndarray) -> None:
        """Drop stale entries: live[slot] is the stamp a slot's current entry carries (-1: none).
        O(len): the owner calls it when the ring holds twice as many entries as slots."""
        slots, stamps = self.pop(self._n)
        keep = live[slots] == stamps
        self.push(slots[keep], stamps[keep])


class Ghost:
    """The last ``size`` keys added and not taken back since (0: none kept): a FIFO of keys.

    Exactly that FIFO mattered: on the conversation trace, a table that let each set drop its
    own oldest key, or a window of the last ``size`` additions taken keys included, cost 2-3
    points of hit ratio against an exact FIFO (the window edge sits near the median reuse
    distance). So the FIFO is kept exactly, over sequence numbers: ``_alive`` marks which of the
    recent additions are still remembered, ``_tail`` is the oldest one that counts, moved on as
    the count goes over ``size``. Lookup is by a 32-bit fingerprint in a 4-way set-associative
    table of at least twice ``size`` entries, each key in the emptier of two sets, each entry
    with its sequence number, so a key is found in one vectorised pass per batch. About 28-52
    bytes a key.
    """

    WAYS = 4

    def __init__(self, size: int) -> None:
        self.size = max(0, int(size))
        sets = 1 << max(2, int(-(-2 * self.size // self.WAYS) - 1).bit_length()) \
            if self.size else 1
        self._fp = np.zeros((sets, self.WAYS), dtype=np.uint32)
        self._seq = np.full((sets, self.WAYS), -1, dtype=np.int64)
        self._mask = np.uint64(sets - 1)
        self._alive = np.zeros(1 << max(4, int(4 * self.size).bit_length()), dtype=bool)
        # head (next sequence number), tail (oldest one still counted), live, size: one array,
        # which the C versions (kvtier.coherence.policies._queues) update in place.
        self._st = np.array([0, 0, 0, self.size], dtype=np.int64)

    _head = property(lambda self: int(self._st[0]),
                     lambda self, v: self._st.__setitem__(0, v))
    _tail = property(lambda self: int(self._st[1]),
                     lambda self, v: self._st.__setitem__(1, v))
    _live = property(lambda self: int(self._st[2]),
                     lambda self, v: self._st.__setitem__(2, v))

    def _split(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        h = hashes.astype(np.uint64, copy=False)
        # Two candidate sets per key (the power of two choices keeps every set below its WAYS
        # when the table is half full); the high 32 bits name the key, 0 marks an empty entry.
        a = (h & self._mask).astype(np.int64)
        b = ((h >> np.uint64(20)) & self._mask).astype(np.int64)
        fp = (h >> np.uint64(32)).astype(np.uint32) | np.uint32(1)
        return a, b, fp

    def _counted(self, seq: np.ndarray) -> np.ndarray:
        return (seq >= self._tail) & self._alive[np.maximum(seq, 0) & (self._alive.size - 1)]

    def _find(self, a: np.ndarray, b: np.ndarray, fp: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per key: found, and the set and way of its entry."""
        sets = np.stack([a, b], axis=1)                                  # (n, 2)
        match = (self._fp[sets] == fp[:, None, None]) & self._counted(self._seq[sets])
        flat = match.reshape(match.shape[0], -1)
        found = flat.any(axis=1)
        at = np.argmax(flat, axis=1)
        return found, sets[np.arange(sets.shape[0]), at // self.WAYS], at % self.WAYS

    def _ring(self, lo: int, hi: int) -> np.ndarray:
        return np.arange(lo, hi) & (self._alive.size - 1)

    def add(self, hashes: np.ndarray) -> None:
        if not self.size or hashes.size == 0:
            return
        if _queues is not None:
            _queues.ghost_add(self._fp, self._seq, self._alive, self._st,
                            np.ascontiguousarray(hashes, dtype=np.uint64))
            return
        if hashes.size > self.size:
            hashes = hashes[-self.size:]
        _, last = np.unique(hashes[::-1], return_index=True)
        if last.size < hashes.size:           # a key repeated in the batch: its last counts
            hashes = hashes[np.sort(hashes.size - 1 - last)]
        a, b, fp = self._split(hashes)
        n = int(fp.size)
        # A key already remembered is renewed (its old entry forgotten first).
        found, fs, fw = self._find(a, b, fp)
        self._forget(self._seq[fs[found], fw[found]])
        self._fp[fs[found], fw[found]] = 0
        if self._head + n - self._tail > self._alive.size:       # keep the ring's span
            self._advance_to(self._head + n - self._alive.size)
        seq = self._head + np.arange(n)
        todo = np.arange(n)
        while todo.size:
            # Each key goes to the emptier of its two sets, in the way that no longer counts
            # (or, when all four do, the oldest: a key lost early, rare at half load). Keys
            # of one batch that pick the same set take turns.
            ca, cb = self._counted(self._seq[a[todo]]), self._counted(self._seq[b[todo]])
            use_b = cb.sum(axis=1) < ca.sum(axis=1)
            sets = np.where(use_b, b[todo], a[todo])
            _, first = np.unique(sets, return_index=True)
            now, sets = todo[first], sets[first]
            seqs = self._seq[sets]
            free = ~self._counted(seqs)
            way = np.where(free.any(axis=1), np.argmax(free, axis=1), np.argmin(seqs, axis=1))
            self._forget(seqs[np.arange(sets.size), way][~free.any(axis=1)])
            self._fp[sets, way] = fp[now]
            self._seq[sets, way] = seq[now]
            self._alive[seq[now] & (self._alive.size - 1)] = True
            self._live += int(now.size)
            todo = np.setdiff1d(todo, now, assume_unique=True)
        self._head += n
        if self._live > self.size:
            self._drop_oldest(self._live - self.size)

    def _forget(self, seqs: np.ndarray) -> None:
        if seqs.size:
            pos = seqs & (self._alive.size - 1)
            live = self._alive[pos]
            self._alive[pos] = False
            self._live -= int(live.sum())

    def _advance_to(self, tail: int) -> None:
        self._forget(np.arange(self._tail, tail))
        self._tail = tail

    def _drop_oldest(self, k: int) -> None:
        """Move the tail past the k oldest live entries (amortised O(1) per addition)."""
        lo = self._tail
        while k > 0:
            hi = min(self._head, lo + max(4 * k, 64))
            alive = self._alive[self._ring(lo, hi)]
            c = np.cumsum(alive)
            if c.size and c[-1] >= k:
                end = lo + int(np.searchsorted(c, k)) + 1
                self._advance_to(end)
                return
            k -= int(c[-1]) if c.size else 0
            lo = hi
            self._advance_to(lo)
            if lo >= self._head:
                return

    def take(self, hashes: np.ndarray) -> np.ndarray:
        """Which keys are remembered; those are forgotten, as they are resident again."""
        if not self.size or hashes.size == 0:
            return np.zeros(hashes.size, dtype=bool)
        if _queues is not None:
            found = np.empty(hashes.size, dtype=bool)
            _queues.ghost_take(self._fp, self._seq, self._alive, self._st,
                             np.ascontiguousarray(hashes, dtype=np.uint64), found)
            return found
        a, b, fp = self._split(hashes)
        hit, sets, ways = self._find(a, b, fp)
        _, first = np.unique(hashes, return_index=True)
        if first.size < hashes.size:          # a key repeated in the batch: its first counts
            again = np.ones(hashes.size, dtype=bool)
            again[first] = False
            hit &= ~again
        sets, ways = sets[hit], ways[hit]
        self._forget(self._seq[sets, ways])
        self._fp[sets, ways] = 0
        self._seq[sets, ways] = -1
        return hit

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        return int(self._fp.nbytes + self._seq.nbytes + self._alive.nbytes)
