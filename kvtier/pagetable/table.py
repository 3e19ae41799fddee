"""The unified page table of one namespace: one row per key, every tier's copy of it.

Layout. Rows live in parallel numpy columns (struct-of-arrays), not in one Python object per
block, so that 10 million entries fit in about 145 bytes each (bench/pagetable.py measures it)
and every batch operation is a handful of vectorised numpy calls:

    key          V{w}     the opaque key, w = key width of the namespace (16 by default)
    version      uint64   latest committed version (0: the row is unused)
    size         uint32   bytes of the latest version
    checksum     uint64   xxh3-64 of the latest version
    state        uint8    coherence.states.BlockState
    slot         int32[3] slot of the copy in HBM and host, NVMe segment id (-1: no copy)
    nvme_off     uint32   offset of the NVMe copy in its segment, in 4 KiB units
    nvme_checksum uint64  checksum of the NVMe copy (it may hold an older version than the row)
    copy_ver     uint64[4] version each tier's copy holds (HBM, host, NVMe, remote); 0: none
    leases       uint16   readers holding the current version's copies
    parent       int32    row of the parent block (-1: none or not cached)
    first_child  int32    head of the children list, threaded through next_sib
    next_sib     int32
    last_access  uint64   policy metadata: logical clock of the last access
    prev_access  uint64   ... and of the one before (LRU-K with K = 2)
    freq         uint32   ... and the access count

Index. Keys map to rows through an open-addressing hash table of int32 (linear probing, load at
most 1/2, tombstones on delete). A batch of keys is hashed and probed with numpy, so a lookup of
1,000 keys costs a few array passes rather than 1,000 dict operations on new bytes objects.
Hashing does not trust the keys to be random: it mixes every 8-byte word with a multiply-xorshift.

Only kvtier.coherence mutates a PageTable; everything else reads it. It is not thread-safe: the
engine serialises access under its lock.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.types import NTIERS, Tier

try:        # the C helper (setup.py builds it where a compiler is present); numpy otherwise
    from kvtier.pagetable import _native
except ImportError:
    _native = None

EMPTY = np.int32(-1)
TOMBSTONE = np.int32(-2)
NO_ROW = -1
NVME_UNIT = 4096
_MIX1 = np.uint64(0x9E3779B97F4A7C15)
_MIX2 = np.uint64(0xBF58476D1CE4E5B9)
_MIX3 = np.uint64(0x94D049BB133111EB)
_SLOT_TIERS = (Tier.HBM, Tier.HOST, Tier.NVME)
_M64 = (1 << 64) - 1
_M1, _M2, _M3 = int(_MIX1), int(_MIX2), int(_MIX3)
_WORD = struct.Struct("<Q")
_SCALAR_KEYS = 8
_WINDOW = 8


# numpy's module defines __getattr__, which keeps CPython 3.11 from specialising any
# attribute read on it: np.empty or np.int64 is a full module lookup each time (~48 a
# replayed request, ~3% of its instructions). The hot paths read these as globals.
(_I64, _U8, _U64, _contiguous, _empty, _ndarray) = (
    np.int64, np.uint8, np.uint64, np.ascontiguousarray, np.empty, np.ndarray)


@functools.lru_cache(maxsize=16)
def _tier_mask(tiers: tuple[int, ...]) -> int:
    """A bit per tier (a prefix match's tier sets, computed once rather than per request)."""
    return sum(1 << int(t) for t in tiers)


def tier_masks(*tier_sets: tuple[int, ...]) -> tuple[int, ...]:
    """A bit mask per tier set, for current_prefix's masks."""
    return tuple(_tier_mask(tuple(ts)) for ts in tier_sets)


def _repeats(h: np.ndarray) -> bool:
    """Whether a batch of key hashes holds a repeat (a false alarm only costs a slower path)."""
    s = np.sort(h)
    return bool((s[1:] == s[:-1]).any())


def _columns(key_width: int) -> dict[str, tuple[np.dtype, tuple[int, ...], int]]:
    """Column name -> (dtype, trailing shape, fill value)."""
    return {
        "key": (np.dtype(f"V{key_width}"), (), 0),
        "version": (np.dtype(np.uint64), (), 0),
        "size": (np.dtype(np.uint32), (), 0),
        "checksum": (np.dtype(np.uint64), (), 0),
        "state": (np.dtype(np.uint8), (), 0),
        "slot": (np.dtype(np.int32), (len(_SLOT_TIERS),), -1),
        "nvme_off": (np.dtype(np.uint32), (), 0),
        "nvme_checksum": (np.dtype(np.uint64), (), 0),
        "copy_ver": (np.dtype(np.uint64), (NTIERS,), 0),
        "leases": (np.dtype(np.uint16), (), 0),
        "parent": (np.dtype(np.int32), (), -1),
        "first_child": (np.dtype(np.int32), (), -1),
        "next_sib": (np.dtype(np.int32), (), -1),
        "last_access": (np.dtype(np.uint64), (), 0),
        "prev_access": (np.dtype(np.uint64), (), 0),
        "freq": (np.dtype(np.uint32), (), 0),
    }


@dataclass(slots=True, frozen=True)
class Entry:
    """A snapshot of one row, for the admin API and tests. Copies absent from a tier are omitted."""

    key: bytes
    version: int
    size: int
    checksum: int
    state: int
    copies: dict[str, dict[str, int]]
    leases: int
    parent: bytes | None
    children: list[bytes]
    last_access: int
    prev_access: int
    freq: int


class PageTable:
    """Rows of one namespace. See the module docstring for the layout and costs."""

    def __init__(self, key_width: int, initial_rows: int = 1024) -> None:
        self.key_width = key_width
        self._kdtype = np.dtype(f"V{key_width}")
        self._spec = _columns(key_width)
        self._fills = [(name, np.array(fill).astype(dtype) if fill else np.zeros((), dtype))
                       for name, (dtype, _shape, fill) in self._spec.items()]
        self.capacity = 0
        self.n_rows = 0          # high-water mark of rows ever handed out
        self.live = 0
        # At least the highest version any removed row held: a key put again after it was
        # deleted or evicted from every tier starts above it, so that a version number once
        # handed out never names another block (coherence raises it across restarts too).
        self.version_floor = 0
        # Rows removed and not yet handed out again: a stack (the last removed, first reused).
        self._free = np.empty(256, dtype=np.int64)
        self._nfree = 0
        self.cols: dict[str, np.ndarray] = {}
        self._grow(max(16, initial_rows))
        self._index = np.full(1024, EMPTY, dtype=np.int32)
        self._index_used = 0     # live + tombstones
        self._words = (key_width + 7) // 8

    # ------------------------------------------------------------------ columns

    def _grow(self, capacity: int) -> None:
        # np.empty of a large array maps pages lazily, so capacity that is never handed out costs
        # no resident memory (np.full would touch every page: 16 B/entry more at 10M entries).
        # Rows are set to their fill values when _alloc_rows hands them out.
        for name, (dtype, shape, _fill) in self._spec.items():
            new = np.empty((capacity, *shape), dtype=dtype)
            old = self.cols.get(name)
            if old is not None:
                new[: self.n_rows] = old[: self.n_rows]
            self.cols[name] = new
        self.capacity = capacity
        # One row's bytes of each column at its fill value, for _native.reset_rows.
        self._row_fills = tuple(
            np.full(shape, fill if fill else 0, dtype=dtype).tobytes() if dtype.kind != "V"
            else bytes(dtype.itemsize * int(np.prod(shape)))
            for name, (dtype, shape, fill) in self._spec.items())
        self._col_tuple = tuple(self.cols[name] for name in self._spec)
        # The columns _native.put_rows writes, in its order (made once per growth: a tuple
        # of fourteen dict reads per put was ~1.5k instructions).
        self._put_cols = tuple(self.cols[name] for name in (
            "key", "version", "leases", "size", "checksum", "state", "last_access",
            "prev_access", "freq", "slot", "copy_ver", "parent", "first_child", "next_sib"))

    def _reset_rows(self, rows: np.ndarray | slice, keys: bool = True) -> None:
        if _native is not None and isinstance(rows, np.ndarray):
            _native.reset_rows(self._col_tuple, self._row_fills,
                               np.ascontiguousarray(rows, dtype=np.int64))
            return
        cols = self.cols
        for name, fill in self._fills:
            if keys or name != "key":
                cols[name][rows] = fill

    # ------------------------------------------------------------------ hashing and probing

    def keys_array(self, keys: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
        """Packed keys (a buffer of n x key_width bytes) as a V{w} array, validated."""
        if isinstance(keys, _ndarray) and keys.dtype == self._kdtype and keys.ndim == 1:
            return keys                   # the common case: a batch already in key form
        arr = np.frombuffer(keys, dtype=_U8) if not isinstance(keys, _ndarray) else keys
        if arr.dtype != self._kdtype:
            arr = _contiguous(arr).view(_U8).reshape(-1)
            if arr.size % self.key_width:
                from kvtier.errors import BadRequest
                raise BadRequest(
                    f"packed keys are {arr.size} bytes, not a multiple of the namespace's key "
                    f"width {self.key_width}; send keys as one buffer of fixed-width keys")
            arr = arr.view(f"V{self.key_width}")
        return arr

    def _hash(self, karr: np.ndarray) -> np.ndarray:
        if _native is not None:
            out = np.empty(karr.shape[0], dtype=np.uint64)
            _native.hash_keys(np.ascontiguousarray(karr), self.key_width, out)
            return out
        return self._hash_numpy(karr)

    def _hash_numpy(self, karr: np.ndarray) -> np.ndarray:
        n = karr.shape[0]
        raw = karr.view(np.uint8).reshape(n, self.key_width)
        pad = self._words * 8 - self.key_width
        if pad:
            raw = np.concatenate([raw, np.zeros((n, pad), dtype=np.uint8)], axis=1)
        words = np.ascontiguousarray(raw).view(np.uint64)
        h = np.full(n, self.key_width, dtype=np.uint64)
        for j in range(self._words):
            h = (h ^ words[:, j]) * _MIX1
            h ^= h >> np.uint64(31)
        h = (h ^ (h >> np.uint64(30))) * _MIX2
        h = (h ^ (h >> np.uint64(27))) * _MIX3
        return h ^ (h >> np.uint64(31))

    def _hash_one(self, key: bytes) -> int:
        """_hash of one key with Python ints: the same value, without a dozen numpy calls."""
        h = self.key_width
        for (word,) in _WORD.iter_unpack(key.ljust(self._words * 8, b"\0")):
            h = ((h ^ word) * _M1) & _M64
            h ^= h >> 31
        h = ((h ^ (h >> 30)) * _M2) & _M64
        h = ((h ^ (h >> 27)) * _M3) & _M64
        return h ^ (h >> 31)

    def _probe_one(self, key: bytes, pos: int) -> int:
        """Row of key by scalar linear probing from index position pos; -1 when absent."""
        index = self._index
        imask = index.size - 1
        keycol = self.cols["key"]
        while True:
            r = int(index[pos])
            if r == EMPTY:
                return NO_ROW
            if r >= 0 and keycol[r].tobytes() == key:
                return r
            pos = (pos + 1) & imask

    def lookup(self, keys: bytes | np.ndarray) -> np.ndarray:
        """Rows of a batch of packed keys (int64, -1 where absent). With the C helper: one
        call, ~2 us for 64 keys on the dev VM. Without it: O(batch) numpy passes, and batches
        of up to _SCALAR_KEYS keys probed with Python ints (a numpy call costs a microsecond
        or more, and a single-key get is the latency case)."""
        return self._rows_of(self.keys_array(keys))

    def _rows_of(self, karr: np.ndarray, h: np.ndarray | None = None) -> np.ndarray:
        n = karr.shape[0]
        if n == 0 or self.live == 0:
            return np.full(n, NO_ROW, dtype=_I64)
        if _native is not None:
            out = _empty(n, dtype=_I64)
            _native.lookup(self._index, self.cols["key"], self.key_width,
                           _contiguous(karr), out, self.n_rows)
            return out
        if n <= _SCALAR_KEYS:
            raw = karr.tobytes()
            w = self.key_width
            imask = self._index.size - 1
            out = _empty(n, dtype=_I64)
            for i in range(n):
                key = raw[i * w:(i + 1) * w]
                out[i] = self._probe_one(key, self._hash_one(key) & imask)
            return out
        return self._lookup(karr, self._hash(karr) if h is None else h)

    def _lookup(self, karr: np.ndarray, h: np.ndarray) -> np.ndarray:
        n = karr.shape[0]
        out = np.full(n, NO_ROW, dtype=np.int64)
        if n == 0 or self.live == 0:
            return out
        index = self._index
        imask = index.size - 1
        pos = (h & np.uint64(imask)).astype(np.int64)
        same = self._key_matcher(karr)
        # Round one probes every key at its home position. The keys that met another key there
        # (about a quarter at load 1/2) then probe windows of _WINDOW positions at a time: at
        # load 1/2 linear probing leaves clusters of a dozen, and one numpy round per position
        # cost more than the lookup itself (64 keys: 62 us in ~10 rounds on the dev VM).
        r = index[pos]
        hit = np.flatnonzero(r >= 0)
        won = hit[same(r[hit], hit)]
        out[won] = r[won]
        done = r == EMPTY
        done[won] = True
        pending = np.flatnonzero(~done)
        step = np.arange(1, _WINDOW + 1)
        while pending.size:
            cand = index[(pos[pending, None] + step) & imask]            # (m, _WINDOW)
            flat = cand.ravel()
            live = np.flatnonzero(flat >= 0)
            match = np.zeros(flat.size, dtype=bool)
            match[live] = same(flat[live], pending[live // _WINDOW])
            match = match.reshape(cand.shape)
            # A stored key sits before the first EMPTY of its probe sequence (EMPTY positions
            # are only ever filled), so a match in the window is the answer.
            found = match.any(axis=1)
            at = match.argmax(axis=1)
            out[pending[found]] = cand[found, at[found]]
            done = found | (cand == EMPTY).any(axis=1)
            pending = pending[~done]
            pos[pending] += _WINDOW
        return out

    def _key_matcher(self, karr: np.ndarray) -> Any:
        """same(rows, i): whether the stored keys of rows equal karr[i]. Keys whose width is a
        multiple of 8 compare as uint64 words, column by column: 2.5x faster than comparing
        V16 values (4,096 keys: 18 us against 47 us on the dev VM)."""
        keycol = self.cols["key"]
        if self.key_width % 8:
            return lambda rows, i: keycol[rows] == karr[i]
        words = self.key_width // 8
        stored = keycol.view(np.uint64).reshape(-1, words)
        query = np.ascontiguousarray(karr).view(np.uint64).reshape(-1, words)

        def same(rows: np.ndarray, i: np.ndarray) -> np.ndarray:
            eq = stored[rows, 0] == query[i, 0]
            for j in range(1, words):
                eq &= stored[rows, j] == query[i, j]
            return eq
        return same

    def key_flags(self, karr: np.ndarray) -> tuple[bool, bool]:
        """(some key is all zeros, some two keys may be equal): one C call with the helper;
        the second is exact without it, and with it may be a hash collision (a caller that
        sees it takes its exact path)."""
        if _native is not None:
            bits = _native.key_flags(_contiguous(karr), self.key_width)
            return bool(bits & 1), bool(bits & 2)
        raw = karr.view(_U8).reshape(karr.size, -1)
        return (not raw.any(axis=1).all(),
                karr.size > 1 and bool(np.unique(raw, axis=0).shape[0] < karr.size))

    def current_prefix(self, karr: np.ndarray, local: tuple[int, ...],
                       memory: tuple[int, ...],
                       masks: tuple[int, int] | None = None) -> tuple[int, int]:
        """(n, below): the n leading keys whose row has a version > 0 held by a copy in one
        of the ``local`` tiers, and how many of those n have no such copy in ``memory``
        tiers. One C call with the helper (a prefix match is per request, issue 18).
        masks: tier_masks(local, memory), made once by a caller that asks per request (the
        cached lookup hashes a tuple of tiers on each call: ~0.2 us each, two a request on
        the dev VM)."""
        if _native is not None and self.live:
            lm, mm = masks or (_tier_mask(local), _tier_mask(memory))
            return _native.current_prefix(self._index, self.cols["key"], self.key_width,
                                          _contiguous(karr), self.cols["version"],
                                          self.cols["copy_ver"], lm, mm)
        rows = self._rows_of(karr)
        cols = self.cols
        ok = rows >= 0
        r = rows[ok]
        ver = cols["version"][r, None]
        cur = (cols["copy_ver"][r][:, list(local)] == ver).any(axis=1)
        mem = np.zeros(karr.size, dtype=bool)
        mem[ok] = (cols["copy_ver"][r][:, list(memory)] == ver).any(axis=1)
        ok[ok] = cur & (cols["version"][r] > 0)
        miss = np.flatnonzero(~ok)
        n = int(miss[0]) if miss.size else int(ok.size)
        return n, n - int(mem[:n].sum())

    def insert(self, keys: bytes | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows for a batch of keys, creating the missing ones. Returns (rows, created mask).

        A key repeated inside the batch gets one row. New rows start at version 0 (unused) with
        every copy absent; the caller fills them in.
        """
        return self.insert_counted(keys)[:2]

    def insert_counted(self, keys: bytes | np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """insert, and how many rows it created (created's count, without a pass over it)."""
        karr = self.keys_array(keys)
        if _native is not None:
            return self._insert_native(karr)
        h = self._hash(karr)
        rows = self._rows_of(karr, h)
        created = np.zeros(rows.size, dtype=bool)
        missing = np.flatnonzero(rows < 0)
        if missing.size == 0:
            return rows, created, 0
        mk = karr[missing]
        mh = h[missing]
        if mh.size == 1 or not _repeats(mh):
            # The common case, settled on the hashes alone (np.unique over the keys' bytes
            # was a tenth of the replay's time, issue 18).
            first = inverse = np.arange(mh.size)
        else:
            _, first, inverse = np.unique(mk.view(np.uint8).reshape(-1, self.key_width),
                                          axis=0, return_index=True, return_inverse=True)
            # New rows in order of first occurrence, as the C helper hands them out.
            order = np.argsort(first, kind="stable")
            rank = np.empty_like(order)
            rank[order] = np.arange(order.size)
            first, inverse = first[order], rank[inverse.reshape(-1)]
        # Grow the index before the new rows exist, so that a rebuild does not index them twice.
        self._ensure_index_room(first.size)
        new_rows = self._alloc_rows(first.size)
        self.cols["key"][new_rows] = mk[first]
        self._index_insert(new_rows, h[missing[first]])
        rows[missing] = new_rows[inverse]
        created[missing[first]] = True
        self.live += first.size
        return rows, created, int(first.size)

    def _insert_native(self, karr: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """insert with the C helper: room for the whole batch made first (index, columns, the
        fresh rows reset), then one pass."""
        n = karr.shape[0]
        if (self._index_used + n) * 2 > self._index.size:   # _ensure_index_room's own test
            self._ensure_index_room(n)
        if self.n_rows + n > self.capacity:                 # _room_for_rows's
            self._room_for_rows(n)
        rows = _empty(n, dtype=_I64)
        created = _empty(n, dtype=bool)
        old = self.n_rows
        self.n_rows, self._nfree, made = _native.insert_keys(
            self._index, self.cols["key"], self.key_width, _contiguous(karr),
            self._free, self._nfree, self.n_rows, rows, created)
        if self.n_rows > old:             # fresh rows: every column but the keys just written
            self._reset_rows(slice(old, self.n_rows), keys=False)
        self._index_used += made
        self.live += made
        return rows, created, made

    def put_new(self, karr: np.ndarray, parents: np.ndarray, slot_row: np.ndarray,
                pool: np.ndarray, data: np.ndarray, slots: np.ndarray, xxh3: int,
                commit_next: np.ndarray, tier: int, base: int, clock: int,
                block_bytes: int) -> tuple[np.ndarray, np.ndarray, int] | None:
        """A host put of keys none of which has a row, in one C call (_native.put_rows): the
        rows insert would make, the data written into the pool's slots and hashed there, the
        rows installed as the engine's install_rows installs them (versions from
        version_floor and base, the touch from clock), each linked under its parent key.
        Returns (rows, versions, the highest version), or None with nothing written when the
        module is missing, some key has a row already, or two keys share a hash: the caller
        takes insert and install. The keys are checked (no all-zero key) by the caller."""
        if _native is None:
            return None
        n = karr.shape[0]
        if (self._index_used + n) * 2 > self._index.size:   # _ensure_index_room's own test
            self._ensure_index_room(n)
        fresh = n - self._nfree
        if fresh > 0:              # rows past n_rows it may take: reset before they are linked
            self._room_for_rows(fresh)
            self._reset_rows(slice(self.n_rows, self.n_rows + fresh))
        rows = _empty(n, dtype=_I64)
        versions = _empty(n, dtype=_U64)
        out = _native.put_rows(
            self._index, self._put_cols, self.key_width, karr, parents, self._free,
            self._nfree, self.n_rows, slot_row, pool, data, slots, xxh3, commit_next, tier,
            self.version_floor, base, clock, block_bytes, versions, rows)
        if out is None:
            return None
        self.n_rows, self._nfree, top = out
        self._index_used += n
        self.live += n
        return rows, versions, top

    def _alloc_rows(self, n: int) -> np.ndarray:
        take = min(n, self._nfree)
        fresh = n - take
        self._room_for_rows(fresh)
        out = np.empty(n, dtype=np.int64)
        out[:take] = self._free[self._nfree - take:self._nfree][::-1]   # last removed first
        self._nfree -= take
        if fresh:
            out[take:] = np.arange(self.n_rows, self.n_rows + fresh)
            self._reset_rows(slice(self.n_rows, self.n_rows + fresh))
            self.n_rows += fresh
        return out

    def _room_for_rows(self, fresh: int) -> None:
        """Columns for fresh more rows past n_rows, doubling the capacity as often as needed."""
        if self.n_rows + fresh > self.capacity:
            cap = self.capacity
            while self.n_rows + fresh > cap:
                cap *= 2
            self._grow(cap)

    def _free_room(self, extra: int) -> None:
        if self._nfree + extra > self._free.size:
            size = self._free.size
            while self._nfree + extra > size:
                size *= 2
            grown = np.empty(size, dtype=np.int64)
            grown[: self._nfree] = self._free[: self._nfree]
            self._free = grown

    def _ensure_index_room(self, extra: int) -> None:
        need = self._index_used + extra
        if need * 2 <= self._index.size:
            return
        # Removals leave tombstones, so a rebuild at the same load would come back after a
        # few batches (a replay at 1e6 tokens rebuilt its 4,096-entry index on one put in
        # six): the rebuilt index is at most 3/8 full, so the next one is size/8 inserts away.
        size = self._index.size
        while (self.live + extra) * 8 > size * 3:
            size *= 2
        rows = self.live_rows()
        self._index = np.full(size, EMPTY, dtype=np.int32)
        self._index_used = 0
        if rows.size:
            self._index_insert(rows, self._hash(self.cols["key"][rows]))

    def _index_insert(self, rows: np.ndarray, h: np.ndarray) -> None:
        if _native is not None:
            _native.index_insert(self._index, np.ascontiguousarray(rows, dtype=np.int64),
                                 np.ascontiguousarray(h, dtype=np.uint64))
            self._index_used += rows.size
            return
        index = self._index
        imask = index.size - 1
        pos = (h & np.uint64(imask)).astype(np.int64)
        pending = np.arange(rows.size)
        while pending.size:
            p = pos[pending]
            free = index[p] < 0
            cand = pending[free]
            won = np.zeros(rows.size, dtype=bool)
            if cand.size:
                up, first = np.unique(p[free], return_index=True)
                winners = cand[first]
                index[up] = rows[winners]
                won[winners] = True
            pending = pending[~won[pending]]
            pos[pending] = (pos[pending] + 1) & imask
        self._index_used += rows.size

    def remove(self, rows: np.ndarray) -> None:
        """Forget rows entirely: index entry, chain links and columns. Rows must be live; a
        row listed twice is removed once. With the C helper: two calls (remove_rows, then
        reset_rows, the second inside the first), whatever the batch."""
        rows = _contiguous(rows, dtype=_I64)
        if rows.size == 0:
            return
        if _native is not None:
            c = self.cols
            if self._nfree + rows.size > self._free.size:     # (the common case: no frame)
                self._free_room(rows.size)
            before = self._nfree
            self._nfree, top = _native.remove_rows(
                self._index, c["key"], self.key_width, c["parent"], c["first_child"],
                c["next_sib"], c["version"], rows, self._free, before, self._col_tuple,
                self._row_fills)
            if top > self.version_floor:
                self.version_floor = top
            self.live -= self._nfree - before
            return
        rows = np.unique(rows)
        self.version_floor = max(self.version_floor, int(self.cols["version"][rows].max()))
        self._index_remove(rows, self._hash(self.cols["key"][rows]))
        for row in rows.tolist():
            self._unlink(row)
        self._reset_rows(rows)
        self._free_room(rows.size)
        self._free[self._nfree:self._nfree + rows.size] = rows
        self._nfree += rows.size
        self.live -= rows.size

    def _index_remove(self, rows: np.ndarray, h: np.ndarray) -> None:
        index = self._index
        imask = index.size - 1
        pos = (h & np.uint64(imask)).astype(np.int64)
        pending = np.arange(rows.size)
        while pending.size:
            r = index[pos[pending]]
            found = r == rows[pending]
            index[pos[pending[found]]] = TOMBSTONE
            pending = pending[~found]
            pos[pending] = (pos[pending] + 1) & imask

    def live_rows(self) -> np.ndarray:
        """Rows in use (key present in the index), ascending."""
        used = np.ones(self.n_rows, dtype=bool)
        used[self._free[: self._nfree]] = False
        return np.flatnonzero(used)

    # ------------------------------------------------------------------ chain links

    def link(self, rows: np.ndarray, parents: np.ndarray) -> None:
        """Make parents[i] the parent of rows[i] (parents[i] = -1 unlinks).

        Rows that have no parent yet (new rows, a restart) are linked in one vectorised pass:
        each parent's new children are chained together and put in front of its old list.
        Rows that move to another parent are detached one by one (O(siblings)).
        """
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        parents = np.ascontiguousarray(parents, dtype=np.int64)
        parent, first, nxt = self.cols["parent"], self.cols["first_child"], self.cols["next_sib"]
        if _native is not None:
            _native.link_rows(parent, first, nxt, rows, parents)
            return
        # A row listed twice keeps its last parent.
        if rows.size > 1:
            _, last = np.unique(rows[::-1], return_index=True)
            pick = np.sort(rows.size - 1 - last)      # batch order, as the C helper keeps it
            rows, parents = rows[pick], parents[pick]
        same = (parent[rows] == parents) | (rows == parents)
        rows, parents = rows[~same], parents[~same]
        moving = parent[rows] >= 0
        for row in rows[moving].tolist():
            self._detach(row)
        keep = parents >= 0
        rows, parents = rows[keep], parents[keep]
        if rows.size == 0:
            return
        order = np.argsort(parents, kind="stable")
        rows, parents = rows[order], parents[order]
        group_end = np.r_[parents[1:] != parents[:-1], True]
        group_start = np.r_[True, parents[1:] != parents[:-1]]
        nxt[rows[:-1]] = rows[1:]
        nxt[rows[group_end]] = first[parents[group_end]]
        first[parents[group_start]] = rows[group_start]
        parent[rows] = parents

    def link_keys(self, rows: np.ndarray, parents: bytes | np.ndarray) -> None:
        """link(rows, lookup(parents)) for packed parent keys (a parent not in the table
        unlinks its row); with the C helper one call, the lookup and the link (a commit's
        chain)."""
        pkeys = self.keys_array(parents)
        if _native is None:
            self.link(rows, self._rows_of(pkeys))
            return
        c = self.cols
        _native.link_keys(self._index, c["key"], self.key_width, _contiguous(pkeys),
                          c["parent"], c["first_child"], c["next_sib"],
                          _contiguous(rows, dtype=_I64), self.n_rows)

    def _detach(self, row: int) -> None:
        par = int(self.cols["parent"][row])
        first, nxt = self.cols["first_child"], self.cols["next_sib"]
        if first[par] == row:
            first[par] = nxt[row]
        else:
            cur = int(first[par])
            while cur >= 0 and nxt[cur] != row:
                cur = int(nxt[cur])
            if cur >= 0:
                nxt[cur] = nxt[row]
        nxt[row] = -1
        self.cols["parent"][row] = -1

    def _unlink(self, row: int) -> None:
        if self.cols["parent"][row] >= 0:
            self._detach(row)
        first, nxt, parent = self.cols["first_child"], self.cols["next_sib"], self.cols["parent"]
        child = int(first[row])
        while child >= 0:
            following = int(nxt[child])
            parent[child] = -1
            nxt[child] = -1
            child = following
        first[row] = -1

    def children(self, row: int) -> list[int]:
        out = []
        child = int(self.cols["first_child"][row])
        while child >= 0:
            out.append(child)
            child = int(self.cols["next_sib"][child])
        return out

    # ------------------------------------------------------------------ views

    def key_of(self, row: int) -> bytes:
        return bytes(self.cols["key"][row])

    def entry(self, row: int) -> Entry:
        c = self.cols
        copies: dict[str, dict[str, int]] = {}
        for tier in Tier:
            ver = int(c["copy_ver"][row, tier])
            if ver == 0:
                continue
            copy = {"version": ver, "current": int(ver == c["version"][row])}
            if tier in _SLOT_TIERS:
                copy["slot"] = int(c["slot"][row, tier])
            if tier is Tier.NVME:
                copy["offset"] = int(c["nvme_off"][row]) * NVME_UNIT
            copies[tier.label] = copy
        par = int(c["parent"][row])
        return Entry(
            key=self.key_of(row), version=int(c["version"][row]), size=int(c["size"][row]),
            checksum=int(c["checksum"][row]), state=int(c["state"][row]), copies=copies,
            leases=int(c["leases"][row]), parent=self.key_of(par) if par >= 0 else None,
            children=[self.key_of(ch) for ch in self.children(row)],
            last_access=int(c["last_access"][row]), prev_access=int(c["prev_access"][row]),
            freq=int(c["freq"][row]))

    def nbytes(self) -> int:
        """Bytes of the columns and the index as allocated (resident use may be lower)."""
        return sum(a.nbytes for a in self.cols.values()) + self._index.nbytes


def _column_property(name: str) -> property:
    return property(lambda self: self.cols[name], doc=f"The {name} column (cols[{name!r}]).")


# Columns read as attributes (table.version, table.slot, ...), as properties: a __getattr__ on
# the class, even one never reached, makes every attribute read of a PageTable go through
# CPython's slot_tp_getattr_hook and keeps 3.11's specialising interpreter from caching it
# (~90 reads a replayed request, ~8% of its instructions: round 4 of the replay's CPU).
for _name in _columns(8):
    setattr(PageTable, _name, _column_property(_name))
del _name

