"""NVMe space, for the NVMe store (coherence.persist): how much fits, which segment to reclaim,
and which of its blocks move forward.

The log is reclaimed by whole segments, as CacheLib's BlockCache reclaims regions: the emptiest
sealed segment when at most KEEP_SHARE of it is live and its blocks fit in what is left (they
all move: compaction), else the oldest sealed one of any namespace (FIFO), whose blocks move
only when the NVMe policy ranks them in the hotter half of the tier (re-admission: for lru and
chain, accessed more recently than the median of a sample of the tier's rows), at most
KEEP_SHARE of a segment, the most recently accessed first; the rest leave the cache.

Each segment's rows are kept as they are written (``Members``), with the engine's clock at the
write, so that a reclaim looks at that segment's rows only: its cost per block does not depend
on how many blocks the page table holds (issue 18; it scanned every row per reclaim before). ``nvme_capacity`` counts the segment files'
bytes, headers included, and never more than the disk has room for (capacity_now); one segment
of it is headroom that only reclaim's copies may use, so that reclaiming never needs space it
does not have. Every method here is called with the store's writer held.
"""

from __future__ import annotations

import logging
import mmap
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvtier.checksums import block_checksums
from kvtier.coherence.journal import entries_of
from kvtier.coherence.policies import POLICIES
from kvtier.coherence.records import records_of, same_key
from kvtier.coherence.states import BlockState, Event, next_states
from kvtier.errors import StorageError
from kvtier.tiers.nvme import Segment, SegmentLog, _aligned, data_start, round_up
from kvtier.tiers.reads import record_batch, run_batch, verdicts
from kvtier.types import Tier

if TYPE_CHECKING:
    from kvtier.coherence.namespace import Namespace
    from kvtier.coherence.persist import NvmeStore

log = logging.getLogger("kvtier.persist")
KEEP_SHARE = 0.5        # a reclaimed segment's records copied forward, at most
SMALL_SEGMENTS = 9      # a capacity under this many segments gets smaller ones
DISK_MARGIN = 256 << 10  # free disk space left to LMDB and the rest when the disk is small
COMPACT_ABOVE = 0.75    # compaction after a flush waits until the tier is this full
DISK_CHECK_S = 0.1      # capacity_now asks the file system at most this often (seconds)


def capacity_for(blocks: int, block_bytes: int) -> tuple[int, int]:
    """(nvme_capacity, segment_bytes) under which one namespace's NVMe tier holds at most
    ``blocks`` blocks of block_bytes and close to that many: eight segments of blocks // 8
    records, one more of headroom. For `kvtier replay`, whose capacities are in blocks."""
    rec = round_up(block_bytes)
    seg = data_start(rec) + max(1, blocks // (SMALL_SEGMENTS - 1)) * rec
    return SMALL_SEGMENTS * seg, seg


class Members:
    """The rows written to each segment of one namespace, each with the clock of its write.

    Appended on every NVMe install (NvmeStore.set_nvme); entries go stale when a row's copy
    moves or goes, and are checked against the page table when read (of_segment), so a
    segment's list is never longer than the records written to it. Dropped with the segment.
    """

    def __init__(self) -> None:
        self._chunks: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}

    def add(self, rows: np.ndarray, segs: np.ndarray, clock: int) -> None:
        if rows.size == 0:
            return
        if segs.size == 1 or (segs == segs[0]).all():
            parts = [(int(segs[0]), rows.copy())]
        else:
            parts = [(sid, rows[segs == sid]) for sid in np.unique(segs).tolist()]
        for sid, r in parts:
            self._chunks.setdefault(sid, []).append((r, np.full(r.size, clock, dtype=np.int64)))

    def _merged(self, seg_id: int) -> tuple[np.ndarray, np.ndarray]:
        chunks = self._chunks.get(seg_id)
        if not chunks:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        if len(chunks) > 1:
            chunks[:] = [(np.concatenate([c[0] for c in chunks]),
                          np.concatenate([c[1] for c in chunks]))]
        return chunks[0]

    def of_segment(self, ns: "Namespace", seg_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, clock of their write) of the rows whose NVMe copy is in seg_id now, each once
        (its latest write), ascending by row. O(records written to the segment)."""
        rows, when = self._merged(seg_id)
        rows = rows.astype(np.int64, copy=False)
        cols = ns.table.cols
        ok = rows < ns.table.n_rows
        ok[ok] = ((cols["copy_ver"][rows[ok], Tier.NVME] > 0)
                  & (cols["slot"][rows[ok], Tier.NVME] == seg_id))
        rows, when = rows[ok], when[ok]
        # A row written twice to the segment: its last write counts (chunks are in order).
        _, last = np.unique(rows[::-1], return_index=True)
        pick = rows.size - 1 - last
        return rows[pick], when[pick]

    def sample(self, ns: "Namespace", rng: np.random.Generator, segments: int = 4,
               per: int = 128) -> np.ndarray:
        """Rows with a current NVMe copy, drawn from a few segments picked at random: the
        tier's distribution as far as segments stand for it, at O(segments x segment size),
        never a scan of the table."""
        ids = list(self._chunks)
        if not ids:
            return np.empty(0, dtype=np.int64)
        out = []
        for i in rng.choice(len(ids), min(segments, len(ids)), replace=False).tolist():
            rows, _ = self._merged(ids[i])
            if rows.size:
                out.append(rows[rng.integers(0, rows.size, min(per, rows.size))])
        if not out:
            return np.empty(0, dtype=np.int64)
        rows = np.concatenate(out).astype(np.int64, copy=False)
        cols = ns.table.cols
        rows = rows[rows < ns.table.n_rows]
        cur = cols["copy_ver"][rows, Tier.NVME]
        return rows[(cur > 0) & (cur == cols["version"][rows])]

    def drop(self, seg_id: int) -> None:
        self._chunks.pop(seg_id, None)


class Space:
    """Capacity and reclaim for one NvmeStore (its writer held in every call)."""

    def __init__(self, store: "NvmeStore") -> None:
        self.store = store
        self.members: dict[int, Members] = {}    # by namespace id
        self._rng = np.random.default_rng(0x4b56)
        self.root = Path(store.settings.data_dir)
        self._disk_limited = False       # warned that the disk holds less than the capacity
        self.reclaimed = 0               # segments reclaimed to make room or compact
        self.copied_forward = 0          # blocks moved forward by a reclaim
        # (when, segment bytes + free disk bytes) at the last statvfs: see capacity_now.
        self._disk: tuple[float, int] | None = None
        self._buf: mmap.mmap | None = None   # reclaim's read buffer, kept: see _read_buffer

    def capacity_now(self, used: int | None = None, keep: bool = True) -> int:
        """nvme_capacity, or less when the file system under the data directory has less
        room than that (other files, a small disk): what the segments hold plus what the disk
        has free, less a margin for LMDB. The headroom is taken from this, so that it is
        always space the disk really has. ``used``: used_bytes(), where the caller has it.

        The file system is asked (statvfs) at most every DISK_CHECK_S: in between, the
        segments' bytes plus the free bytes are taken as they were then, since the segment
        files (spares and those kept for readers included, as used_bytes counts them) are
        what this store adds to or removes from the disk. Others' writes in between (LMDB's
        among them) are what DISK_MARGIN covers; an append that still finds the disk full
        makes the flush ask again at once (disk_changed, Flushes._disk_full), as a spare
        dropped for room does. Two statvfs a put were ~2% of a 16-block put's CPU on the dev
        VM (issue 17, fio7)."""
        used = self.store.used_bytes() if used is None else used
        now = time.monotonic()
        if self._disk is None or now - self._disk[0] >= DISK_CHECK_S:
            try:
                free = shutil.disk_usage(self.root).free
            except OSError:
                return self.store.capacity
            if keep:            # only with the writer held: no segment is being made then
                self._disk = (now, used + free)
        else:
            free = self._disk[1] - used
        real = used + max(free - DISK_MARGIN, 0)
        if real < self.store.capacity and not self._disk_limited:
            self._disk_limited = True
            self.store.counters.nvme_full += 1
            log.warning("the disk under %s has room for %d bytes of segments, less than "
                        "nvme_capacity (%d): the NVMe tier holds what the disk does", self.root,
                        real, self.store.capacity)
        return min(self.store.capacity, real)

    def disk_changed(self) -> None:
        """The file system's free space moved in a way used_bytes does not tell (an append
        found the disk full, spare files were deleted): the next capacity_now asks it."""
        self._disk = None

    def fits(self, ns: "Namespace", n: int, reserve: int, cap: int | None = None) -> int:
        """How many of n records fit under the capacity (capacity_now() unless given) less
        ``reserve`` bytes (lock held)."""
        used = self.store.used_bytes()
        cap = self.capacity_now(used) if cap is None else cap
        free = cap - reserve - used
        if ns.log.bytes_for(n) <= free:
            return n
        lo, hi = 0, n                      # the largest m with bytes_for(m) <= free
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ns.log.bytes_for(mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def make_room(self, ns: "Namespace", n: int) -> int:
        """Reclaim segments until n records fit beside the headroom (writer held). Returns
        how many fit."""
        tries = 0
        while True:
            with self.store.owner.lock:
                fit = self.fits(ns, n, self.store.headroom())
                if fit == n:
                    return n
                victim = self.next_victim(ns)
            if victim is None or tries > 4 * len(victim[0].log.segments) + 8:
                return fit
            before = self.store.used_bytes()
            self.reclaim(*victim)
            tries += 1
            if self.store.used_bytes() >= before:
                tries += 4                 # reclaim freed nothing (all copied forward)

    def next_victim(self, ns: "Namespace") -> tuple["Namespace", Segment, bool] | None:
        """The segment to reclaim, and whether all its live blocks move (lock held): the
        emptiest sealed one when at most KEEP_SHARE of it is live and its live blocks fit in
        what is left (moving them frees the rest), else the oldest sealed one of any
        namespace, whose blocks move only when the policy ranks them hot (FIFO with
        re-admission)."""
        free = self.capacity_now() - self.store.used_bytes()
        emptiest = oldest = None
        for other in self.store.owner.namespaces.values():
            if other.log is None:
                continue
            for seg in other.log.sealed():
                frac = seg.live / max(seg.size - seg.start, 1)
                fits = seg.live + other.log.data_start <= free
                if fits and (emptiest is None or frac < emptiest[0]):
                    emptiest = (frac, other, seg)
                if oldest is None or seg.born < oldest[1].born:
                    oldest = (other, seg)
        if emptiest is not None and emptiest[0] <= KEEP_SHARE:
            return emptiest[1], emptiest[2], True
        return None if oldest is None else (*oldest, False)

    def compaction_due(self) -> bool:
        """compact() has work past its fill test (read without the writer: a hint)."""
        return self._full_enough_to_compact()

    def _full_enough_to_compact(self) -> bool:
        """The tier is COMPACT_ABOVE full, its spare files left out: they are room the next
        segments take over (tiers.nvme.SPARES), not data that compacting could free."""
        used = self.store.used_bytes()
        # Not kept: this statvfs runs beside the next group's append (rev10).
        return self._filled(used) >= COMPACT_ABOVE * self.capacity_now(used, keep=False)

    def _filled(self, used: int | None = None) -> int:
        """The segments' bytes less the spare files'."""
        used = self.store.used_bytes() if used is None else used
        return used - sum(lg.spare_bytes() for lg in self.store.logs())

    def compact(self, ns: "Namespace", wrote: int = 0) -> int:
        """After a flush that wrote ``wrote`` bytes: reclaim sealed segments below
        compact_threshold, emptiest first, their live blocks all copied forward while the
        headroom allows (writer held). Returns the segments reclaimed.

        Only once the tier is COMPACT_ABOVE full: below that the dead bytes cost nothing
        (the space is free anyway) and copying live blocks forward is write amplification
        for nothing. Compacting at any fill cost the randrw fio jobs' uniform rewrites (their
        segments half live after one pass) a write amplification of 1.5 and two more LMDB
        transactions per reclaim, about 4 ms of every 16-block write_through put (issue 17).

        Paced: it stops once it has freed what the flush wrote (at least one segment), or
        once the tier is under the mark again. Reclaiming every candidate at once made one
        put in ~50 wait for ten reclaims (172-190 ms on the dev VM, the randrw jobs' write
        p99.9) where the others waited for none; one at a time, the emptiest first, the
        later candidates go on losing live blocks to rewrites before their turn, so each
        byte freed copies fewer forward. A tier that fills faster than this frees is still
        made room in by the flush's own make_room."""
        if not self._full_enough_to_compact():
            return 0
        goal = self._filled() - max(wrote, 1)
        done = 0
        for sid in ns.log.compaction_candidates(self.store.settings.compact_threshold):
            if done and (self._filled() <= goal or not self._full_enough_to_compact()):
                break
            seg = ns.log.segments.get(sid)
            if seg is not None:
                self.reclaim(ns, seg, keep_all=True)
                done += 1
        return done

    def reclaim(self, ns: "Namespace", seg: Segment, keep_all: bool) -> None:
        """Empty one sealed segment and delete it (writer held). Its live blocks are copied
        forward when they earn it (all of them with keep_all, while they fit), else they
        leave the cache; stale fallback copies are forgotten."""
        self.store.settle()        # the rows it moves are installed; no batch is in flight
        cols = ns.table.cols
        log_ = ns.log
        with self.store.owner.lock:
            rows, written = self.of_segment(ns, seg.seg_id)
            cur = cols["copy_ver"][rows, Tier.NVME] == cols["version"][rows]
            # A stale copy under a DIRTY row is the last flushed version, which a crash must
            # find: it always moves. Current copies move when they earn it.
            stale, live = rows[~cur], rows[cur]
            if self.fits(ns, stale.size, 0) < stale.size:
                log.warning("segment %d of %s not reclaimed: no room to move the %d flushed "
                            "versions of dirty blocks in it", seg.seg_id, ns.name, stale.size)
                return
            keep = self._keepers(ns, live, written[cur], stale.size, keep_all)
            if keep is None:
                return                     # they do not all fit now: the segment stays
            victims = np.setdiff1d(live, keep)
            drop_keys = self.evict_rows(ns, victims)
            keep = np.concatenate([stale, keep])
            keys = cols["key"][keep].copy()
            versions = cols["copy_ver"][keep, Tier.NVME].copy()
            sums = cols["nvme_checksum"][keep].copy()
            segs = cols["slot"][keep, Tier.NVME].copy()
            offs = cols["nvme_off"][keep].copy()
            recs = records_of(ns, keep, versions, sums)
        bb = ns.block_bytes
        buf = self._read_buffer(max(keep.size, 1) * bb, log_.segment_bytes)
        outs = [memoryview(buf)[i * bb:(i + 1) * bb] for i in range(keep.size)]
        ok = self._read_checked(log_, buf, segs, offs, sums, outs)
        good = np.flatnonzero(ok)
        new_segs = new_offs = np.empty(0)
        try:
            if good.size:
                recs = recs[good]
                new_segs, new_offs = log_.append([outs[i] for i in good.tolist()],
                                                 entries_of(keys[good], recs))
                recs["seg"], recs["off"] = new_segs, new_offs
                self.store.journal.put(ns.ns_id, keys[good], recs)
            self.store.journal.delete(ns.ns_id, drop_keys)
            self.store.checkpoint()        # LMDB knows the moves before the file goes
        except StorageError as exc:
            # As a flush's failed append does (Flushes._disk_full): the disk may hold less
            # than the kept figure says (others' files), and the reclaims after this one
            # would otherwise try to copy forward into room it does not have until the
            # figure's DISK_CHECK_S ran out (fio11).
            self.disk_changed()
            log.warning("reclaiming segment %d of %s failed (%s); it stays", seg.seg_id,
                        ns.name, exc)
            return
        with self.store.owner.lock:
            orphans = self.store.drop_bad(ns, keep[~ok], keys[~ok], versions[~ok])
            k = keep[good]
            still = same_key(ns, k, keys[good])
            still[still] = ((cols["copy_ver"][k[still], Tier.NVME] == versions[good][still])
                            & (cols["slot"][k[still], Tier.NVME] == seg.seg_id))
            m = np.flatnonzero(still)
            self.store.set_nvme(ns, k[m], new_segs[m], new_offs[m], versions[good][m],
                           sums[good][m])
            orphans += [bytes(x) for x in keys[good][~still]]
            # Whatever still points here (a record that failed to read) is gone with the file.
            left, _ = self.of_segment(ns, seg.seg_id)
            orphans += self.store.forget(ns, left)
            self.store.owner.forget_empty(ns, left)
            log_.remove(seg.seg_id)
            self.members_of(ns).drop(seg.seg_id)
            self.store.counters.compactions += 1
            self.reclaimed += 1
            self.copied_forward += int(m.size)
        self.store.delete_now(ns, orphans)

    def _read_checked(self, log_: SegmentLog, buf: mmap.mmap, segs: np.ndarray,
                      offs: np.ndarray, sums: np.ndarray, outs: list[memoryview]) -> np.ndarray:
        """A reclaim's records read into outs (consecutive records of buf) and checked: True
        where read whole and its XXH3 equals sums'. The C read of an NVMe get (tiers.reads:
        the AIO and each record's XXH3 in one GIL-free call) where it applies; read() and
        block_checksums otherwise, or after a C read that failed mid-way (nothing of it is
        in flight then). Python's read() built a request per run of records and hashed after
        them all: ~4.5 ms of a reclaim's ~9 ms of CPU in the randrw jobs (issue 17, fio10)."""
        n, bb = len(outs), log_.block_bytes
        if n == 0:
            return np.zeros(0, dtype=bool)
        rows = np.frombuffer(buf, dtype=np.uint8)[: n * bb].reshape(n, bb)
        held = log_.pin(segs)          # (the writer holds them too: reclaims run under it)
        try:
            batch = record_batch(log_, rows, np.arange(n), segs, offs, sums, held)
            if batch is not None:
                try:
                    run_batch(log_, batch)
                    return verdicts(log_, batch)
                except OSError as exc:
                    log.warning("the C read of a reclaim failed (%s); reading it again", exc)
        finally:
            log_.unpin(held)
        ok = log_.read(segs, offs, outs)
        return ok & (block_checksums(rows) == sums)

    def _keepers(self, ns: "Namespace", live: np.ndarray, written: np.ndarray, moving: int,
                 keep_all: bool) -> np.ndarray | None:
        """The live rows of a reclaimed segment that are copied forward (lock held): with
        keep_all every one (None when they do not fit: the segment is left alone), else those
        the NVMe policy readmits (``written``: the clock of each row's write here), at most
        KEEP_SHARE of a segment and within what the capacity has left, the most recently
        accessed first. O(rows of the segment, and of the few segments sampled)."""
        if live.size == 0:
            return live
        cols = ns.table.cols
        cap_rows = self.fits(ns, live.size + moving, 0) - moving
        if keep_all:                       # compaction moves every block, or none
            return live if cap_rows >= live.size else None
        per = (ns.log.segment_bytes - ns.log.data_start) // ns.log.record_bytes
        cap_rows = min(cap_rows, int(per * KEEP_SHARE) - moving)
        # The policy's "hotter half of the tier", judged against a sample of the tier.
        sample = self.members_of(ns).sample(ns, self._rng)
        read = POLICIES[self.store.settings.policy_for(Tier.NVME.label)].readmit(
            cols, live, written, sample)
        live = live[read]
        last = cols["last_access"][live]
        if cap_rows <= 0 or live.size == 0:
            return live[:0]
        if live.size <= cap_rows:
            return live
        return np.sort(live[np.argsort(-last, kind="stable")[:cap_rows]])

    def _read_buffer(self, n: int, segment_bytes: int) -> mmap.mmap:
        """(writer held: one reclaim at a time) A page-aligned buffer of at least n bytes for
        a reclaim's reads, kept between reclaims. Mapped at a segment's size (what a reclaim
        reads at most) so that it is not mapped again as reclaims grow; its memory is the
        pages reclaims have touched, at most the largest share of a segment that one
        reclaim copied. A fresh anonymous mmap per reclaim paid a page fault per 4 KiB
        inside the O_DIRECT reads: ~0.7 ms of CPU per MiB on the dev VM, ~11 ms a reclaim of
        the randrw jobs (issue 17, fio7). What it held before is never trusted: every block
        read into it is checked against its checksum."""
        if self._buf is None or len(self._buf) < n:
            self._buf = _aligned(max(n, segment_bytes))
        return self._buf

    def members_of(self, ns: "Namespace") -> Members:
        m = self.members.get(ns.ns_id)
        if m is None:
            m = self.members[ns.ns_id] = Members()
        return m

    def of_segment(self, ns: "Namespace", seg_id: int) -> tuple[np.ndarray, np.ndarray]:
        return self.members_of(ns).of_segment(ns, seg_id)

    def evict_rows(self, ns: "Namespace", rows: np.ndarray) -> list[bytes]:
        """Under the lock: blocks that leave the cache from NVMe leave every local tier (a
        reader's slots are retired, never reused under it). Returns the keys to delete."""
        if rows.size == 0:
            return []
        cols = ns.table.cols
        for t in list(ns.slots):
            self.store.owner.drop_copies(ns, rows, t)
        keys = self.store.forget(ns, rows)
        next_states(cols["state"][rows], Event.DELETE)
        ns.table.remove(rows)
        self.store.counters.tiers[Tier.NVME].evictions += int(rows.size)
        return keys

    def evict(self, ns: "Namespace", count: int) -> int:
        """Admin eviction: drop up to count clean, unleased blocks whose NVMe copy is current,
        by the NVMe policy. Unlocked."""
        if count <= 0 or ns.log is None:
            return 0
        cols = ns.table.cols
        with self.store.writer:
            self.store.settle()        # a batch in flight would be applied over the deletes
            with self.store.owner.lock:
                # Oldest segment first (the order reclaim takes them in), within it by
                # least recent read: O(rows of the segments looked at), not of the table.
                taken: list[np.ndarray] = []
                need = count
                for seg in sorted(ns.log.segments.values(), key=lambda g: g.born):
                    rows, _ = self.of_segment(ns, seg.seg_id)
                    rows = rows[(cols["state"][rows] == BlockState.CLEAN)
                                & (cols["leases"][rows] == 0)
                                & (cols["copy_ver"][rows, Tier.NVME] == cols["version"][rows])]
                    rows = rows[np.argsort(cols["last_access"][rows], kind="stable")[:need]]
                    taken.append(rows)
                    need -= rows.size
                    if need <= 0:
                        break
                victims = np.concatenate(taken) if taken else np.empty(0, dtype=np.int64)
                keys = self.evict_rows(ns, victims)
            self.store.journal.delete(ns.ns_id, keys)
        return int(victims.size)
