"""The NVMe side of coherence: flush, copy-on-read, NVMe eviction, compaction and restart.

Flush order, per batch (the crash-safety argument rests on it):

    1. pick DIRTY rows, oldest version first (log-structured)
    2. append their current bytes to the segment log and fdatasync the segments
    3. commit one LMDB transaction with key -> (segment, offset, size, version, checksum, parent)
    4. only then mark the rows CLEAN and the old NVMe records dead

A crash before 3 leaves unreferenced bytes at the log's tail (dead space, reclaimed by
compaction); a crash after 3 loses nothing that was acknowledged as flushed. Compaction follows
the same order: copy live records forward, fsync, commit LMDB, then delete the old segment.

These functions run under the engine lock; they are the only code besides the engine that
writes the page table.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from kvtier.checksums import block_checksums
from kvtier.coherence.states import BlockState, Event, next_states
from kvtier.errors import StorageError
from kvtier.pagetable.store import FLAG_PARENT, record_dtype
from kvtier.tiers.host import SlotPool
from kvtier.tiers.nvme import _aligned
from kvtier.types import Tier

if TYPE_CHECKING:
    from kvtier.coherence.engine import Engine
    from kvtier.coherence.namespace import Namespace

log = logging.getLogger("kvtier.persist")


def _records(ns: "Namespace", rows: np.ndarray, segs: np.ndarray, offs: np.ndarray,
             versions: np.ndarray, sums: np.ndarray) -> np.ndarray:
    cols = ns.table.cols
    rec = np.zeros(rows.size, dtype=record_dtype(ns.key_width))
    rec["seg"], rec["off"], rec["size"] = segs, offs, ns.block_bytes
    rec["version"], rec["checksum"] = versions, sums
    par = cols["parent"][rows]
    has = par >= 0
    rec["flags"] = np.where(has, FLAG_PARENT, 0)
    if has.any():
        rec["parent"][has] = cols["key"][par[has]]
    return rec


def _set_nvme(engine: "Engine", ns: "Namespace", rows: np.ndarray, segs: np.ndarray,
              offs: np.ndarray, versions: np.ndarray, sums: np.ndarray) -> None:
    cols = ns.table.cols
    old = rows[cols["copy_ver"][rows, Tier.NVME] > 0]
    ns.log.add_live(cols["slot"][old, Tier.NVME], -1)
    cols["slot"][rows, Tier.NVME] = segs
    cols["nvme_off"][rows] = offs
    cols["copy_ver"][rows, Tier.NVME] = versions
    cols["nvme_checksum"][rows] = sums
    ns.log.add_live(segs, +1)


def flush_rows(engine: "Engine", ns: "Namespace", rows: np.ndarray, strict: bool = False) -> int:
    """Flush the DIRTY rows among ``rows``. Returns how many reached NVMe.

    NVMe full or failing: with strict=False (puts, eviction) the rows stay dirty in the upper
    tiers and a counter says so; with strict=True (an explicit flush) StorageError is raised.
    """
    if ns.log is None:
        return 0
    cols = ns.table.cols
    rows = np.unique(np.asarray(rows, dtype=np.int64))
    rows = rows[cols["state"][rows] == BlockState.DIRTY]
    if rows.size == 0:
        return 0
    rows = rows[np.argsort(cols["version"][rows], kind="stable")]
    room = _make_room(engine, ns, rows.size)
    if room < rows.size:
        engine.counters.nvme_full += 1
        if strict and room == 0:
            raise StorageError(f"the NVMe tier is full ({engine.settings.nvme_capacity} bytes) "
                               "and nothing can be evicted; raise nvme_capacity")
        rows = rows[:room]
        if rows.size == 0:
            return 0
    versions = cols["version"][rows].copy()
    sums = cols["checksum"][rows].copy()
    host = ns.slots[Tier.HOST]
    on_host = cols["copy_ver"][rows, Tier.HOST] == versions
    views: list[memoryview] = []
    staging = None
    if not on_host.all():
        # Only an HBM copy is current (its host copy was evicted after a write-back): stage it.
        from kvtier.coherence.engine import _to_numpy
        miss = np.flatnonzero(~on_host)
        hbm = ns.slots[Tier.HBM].pool
        staging = _to_numpy(hbm.read(cols["slot"][rows[miss], Tier.HBM]))
    k = 0
    for i, r in enumerate(rows.tolist()):
        if on_host[i]:
            views.append(host.pool.slot_view(int(cols["slot"][r, Tier.HOST])))
        else:
            views.append(memoryview(staging[k]))
            k += 1
    try:
        segs, offs = ns.log.append(views)
        engine.catalog.put_records(ns.ns_id, cols["key"][rows],
                                   _records(ns, rows, segs, offs, versions, sums))
    except StorageError:
        engine.counters.nvme_full += 1
        if strict:
            raise
        log.warning("flush of %d blocks of %s failed; they stay dirty", rows.size, ns.name,
                    exc_info=True)
        return 0
    _set_nvme(engine, ns, rows, segs, offs, versions, sums)
    cols["state"][rows] = next_states(cols["state"][rows], Event.FLUSHED)
    engine.counters.flushes += 1
    engine.counters.flushed_blocks += int(rows.size)
    engine.counters.tiers[Tier.NVME].bytes_written += int(rows.size) * ns.block_bytes
    if ns.log.compaction_candidates(engine.settings.compact_threshold):
        compact(engine, ns)
    return int(rows.size)


def _nvme_used(engine: "Engine") -> int:
    return sum(n.log.total_bytes() for n in engine.namespaces.values() if n.log is not None)


def _make_room(engine: "Engine", ns: "Namespace", n: int) -> int:
    """How many of n records fit under nvme_capacity, after compaction and eviction."""
    cap = engine.settings.nvme_capacity
    rec = ns.log.record_bytes

    def fits() -> int:
        free = cap - _nvme_used(engine) - ns.log.data_start   # a new segment's head
        return max(0, min(n, free // rec))

    if fits() == n:
        return n
    compact(engine, ns)
    if fits() < n:
        evict_nvme(engine, ns, n - fits() + max(1, n // 8))
        compact(engine, ns, threshold=1.0)
    return fits()


def read_nvme(engine: "Engine", ns: "Namespace", rows: np.ndarray, pool: SlotPool,
              dst: np.ndarray) -> np.ndarray:
    """Copy-on-read of rows' NVMe copies into pool slots dst, checksums verified.

    Returns a bool mask of the rows served. A record that is unreadable (truncated segment) or
    fails its checksum is dropped from NVMe and LMDB and counted; its row falls back or goes.
    """
    cols = ns.table.cols
    outs = [pool.slot_view(int(s)) for s in dst.tolist()]
    ok = ns.log.read(cols["slot"][rows, Tier.NVME], cols["nvme_off"][rows], outs)
    sums = np.zeros(rows.size, dtype=np.uint64)
    sums[ok] = block_checksums(pool.array, dst[ok].tolist())
    ok &= sums == cols["nvme_checksum"][rows]
    bad = rows[~ok]
    if bad.size:
        engine.counters.checksum_failures += int(bad.size)
        log.error("%d NVMe records of %s failed their checksum or could not be read; dropped",
                  bad.size, ns.name)
        drop_nvme(engine, ns, bad)
        engine._forget_empty(ns, bad)
    return ok


def drop_nvme(engine: "Engine", ns: "Namespace", rows: np.ndarray) -> None:
    """Forget rows' NVMe copies: dead bytes in their segments, LMDB records deleted."""
    if ns.log is None:
        return
    cols = ns.table.cols
    rows = rows[cols["copy_ver"][rows, Tier.NVME] > 0]
    if rows.size == 0:
        return
    ns.log.add_live(cols["slot"][rows, Tier.NVME], -1)
    engine.catalog.delete_records(ns.ns_id, [bytes(k) for k in cols["key"][rows]])
    cols["copy_ver"][rows, Tier.NVME] = 0
    cols["slot"][rows, Tier.NVME] = -1
    cols["nvme_checksum"][rows] = 0


def evict_nvme(engine: "Engine", ns: "Namespace", count: int) -> int:
    """Drop up to count whole blocks whose NVMe copy is current and that no reader holds.

    NVMe is the capacity tier, so a block evicted from it leaves every local tier. Dirty
    blocks and blocks under lease are never chosen.
    """
    if count <= 0 or ns.log is None:
        return 0
    cols = ns.table.cols
    n = ns.table.n_rows
    cand = np.flatnonzero((cols["state"][:n] == BlockState.CLEAN) & (cols["leases"][:n] == 0)
                          & (cols["copy_ver"][:n, Tier.NVME] == cols["version"][:n]))
    if cand.size == 0:
        return 0
    victims = engine._choose(ns, Tier.NVME, cand, count)
    for t in list(ns.slots):
        st = ns.slots[t]
        held = victims[cols["copy_ver"][victims, t] > 0]
        if (st.leases[cols["slot"][held, t]] > 0).any():
            # A copy under lease: keep those blocks, evict the rest.
            leased = held[st.leases[cols["slot"][held, t]] > 0]
            victims = np.setdiff1d(victims, leased)
    for t in list(ns.slots):
        engine._drop_copies(ns, victims, t)
    drop_nvme(engine, ns, victims)
    next_states(cols["state"][victims], Event.DELETE)
    ns.table.remove(victims)
    engine.counters.tiers[Tier.NVME].evictions += int(victims.size)
    return int(victims.size)


def compact(engine: "Engine", ns: "Namespace", threshold: float | None = None) -> int:
    """Rewrite live records out of sealed segments below the live threshold; delete those.

    Returns the segments reclaimed. Records that fail their checksum on the way are dropped
    and counted, never copied forward.
    """
    if ns.log is None:
        return 0
    threshold = engine.settings.compact_threshold if threshold is None else threshold
    cols = ns.table.cols
    done = 0
    for sid in ns.log.compaction_candidates(threshold):
        n = ns.table.n_rows
        rows = np.flatnonzero((cols["copy_ver"][:n, Tier.NVME] > 0)
                              & (cols["slot"][:n, Tier.NVME] == sid))
        if rows.size:
            buf = _aligned(rows.size * ns.block_bytes)
            arr = np.frombuffer(buf, dtype=np.uint8).reshape(rows.size, ns.block_bytes)
            outs = [memoryview(buf)[i * ns.block_bytes:(i + 1) * ns.block_bytes]
                    for i in range(rows.size)]
            ok = ns.log.read(cols["slot"][rows, Tier.NVME], cols["nvme_off"][rows], outs)
            sums = block_checksums(arr)
            ok &= sums == cols["nvme_checksum"][rows]
            if (~ok).any():
                engine.counters.checksum_failures += int((~ok).sum())
                bad = rows[~ok]
                drop_nvme(engine, ns, bad)
                engine._forget_empty(ns, bad)
            good = np.flatnonzero(ok)
            if good.size:
                grow = rows[good]
                segs, offs = ns.log.append([outs[i] for i in good.tolist()])
                versions = cols["copy_ver"][grow, Tier.NVME].copy()
                sums_g = cols["nvme_checksum"][grow].copy()
                engine.catalog.put_records(ns.ns_id, cols["key"][grow],
                                           _records(ns, grow, segs, offs, versions, sums_g))
                _set_nvme(engine, ns, grow, segs, offs, versions, sums_g)
            del arr
        ns.log.remove(sid)
        engine.counters.compactions += 1
        done += 1
    return done


def load_namespace(engine: "Engine", ns: "Namespace") -> int:
    """Restart: rebuild ns's rows from LMDB and the segments. Returns the rows loaded.

    Records pointing outside their segment (a truncated or missing file) are dropped from LMDB
    and counted; checksums are verified on first read, so restart costs no data reads.
    """
    if ns.log is None:
        return 0
    keys, recs, malformed = engine.catalog.load(ns.ns_id, ns.key_width)
    engine.counters.records_dropped += malformed
    if keys.size == 0:
        return 0
    valid = (ns.log.in_bounds(recs["seg"], recs["off"])
             & (recs["size"] == ns.block_bytes) & (recs["version"] > 0))
    if not valid.all():
        engine.counters.records_dropped += int((~valid).sum())
        engine.catalog.delete_records(ns.ns_id, [bytes(k) for k in keys[~valid]])
        keys, recs = keys[valid], recs[valid]
    table = ns.table
    rows, _ = table.insert(keys)
    cols = table.cols
    cols["version"][rows] = recs["version"]
    cols["size"][rows] = recs["size"]
    cols["checksum"][rows] = recs["checksum"]
    cols["state"][rows] = BlockState.CLEAN
    _set_nvme(engine, ns, rows, recs["seg"].astype(np.int32), recs["off"], recs["version"],
              recs["checksum"])
    has = (recs["flags"] & FLAG_PARENT) != 0
    if has.any():
        prow = np.full(rows.size, -1, dtype=np.int64)
        prow[has] = table.lookup(recs["parent"][has])
        table.link(rows[has], prow[has])
    return int(rows.size)
