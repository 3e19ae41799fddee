"""The engine's statistics as one plain dict: the shape behind /v1/stats, `kvtier stats` and the
socket's stats op. Cheap to build (no page-table scans): counts come from pools, segment
bookkeeping and counters."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from kvtier.memory import shmem_huge_pages
from kvtier.types import Tier

if TYPE_CHECKING:
    from kvtier.coherence.namespace import EngineCounters, Lease, Namespace, Reservation
    from kvtier.coherence.persist import NvmeStore
    from kvtier.config import Settings
    from kvtier.pagetable.store import Catalog


class Reported(Protocol):
    """What the report reads of the engine (under its lock)."""

    settings: "Settings"
    counters: "EngineCounters"
    namespaces: dict[str, "Namespace"]
    leases: dict[int, "Lease"]
    reservations: dict[int, "Reservation"]
    host_used: int
    hbm_pool_factory: Any
    nvme: "NvmeStore"
    backend: Any
    remote: Any
    catalog: "Catalog"
    started: float


def engine_stats(engine: Reported) -> dict[str, Any]:
    s = engine.settings
    c = engine.counters
    tiers: dict[str, Any] = {}
    host_blocks = sum(ns.slots[Tier.HOST].pool.used_count for ns in engine.namespaces.values())
    tiers["host"] = {"capacity_bytes": s.host_capacity, "used_bytes": engine.host_used,
                     "blocks": host_blocks, "pinned": any(
                         ns.slots[Tier.HOST].pool.pinned for ns in engine.namespaces.values()),
                     "huge_pages": shmem_huge_pages()}
    if engine.hbm_pool_factory is not None:
        hbm = [ns.slots[Tier.HBM] for ns in engine.namespaces.values() if Tier.HBM in ns.slots]
        tiers["hbm"] = {"capacity_bytes": s.hbm_capacity,
                        "used_bytes": sum(st.pool.used_count * st.pool.block_bytes for st in hbm),
                        "blocks": sum(st.pool.used_count for st in hbm)}
    if s.nvme_capacity > 0:
        logs = [ns.log for ns in engine.namespaces.values() if ns.log is not None]
        live = sum(lg.live_bytes() for lg in logs)
        written = sum(lg.bytes_written for lg in logs)
        logical = c.tiers[Tier.NVME].bytes_written
        tiers["nvme"] = {"capacity_bytes": s.nvme_capacity,
                         "used_bytes": sum(lg.total_bytes() for lg in logs),
                         "live_bytes": live,
                         "blocks": sum(lg.live_bytes() // lg.record_bytes for lg in logs),
                         "segments": sum(len(lg.segments) for lg in logs),
                         "reclaimed_segments": engine.nvme.space.reclaimed,
                         "copied_forward": engine.nvme.space.copied_forward,
                         "backend": engine.backend.name,
                         "write_amplification": round(written / logical, 4) if logical else None}
    for name, d in tiers.items():
        d.update(c.tiers[Tier.parse(name)].as_dict())
    if engine.remote is not None:
        r = engine.remote.stats()
        tiers["remote"] = {"capacity_bytes": 0, "used_bytes": 0, "blocks": 0,
                           "promotions": 0, "demotions": 0, "evictions": 0, **r}
    return {
        "tiers": tiers,
        "hit_ratio": (c.get_hits / c.gets) if c.gets else None,
        "gets": c.gets, "get_hits": c.get_hits, "puts": c.puts,
        "checksum_failures": c.checksum_failures,
        "nvme_full": c.nvme_full, "flushes": c.flushes, "flushed_blocks": c.flushed_blocks,
        "compactions": c.compactions, "records_dropped": c.records_dropped,
        "expired_reservations": c.expired_reservations, "expired_leases": c.expired_leases,
        "leases": len(engine.leases), "reservations": len(engine.reservations),
        "credits": sum(1 for r in engine.reservations.values() if r.credit),
        "retired_slots": int(sum(int(st.retired.sum()) for ns in engine.namespaces.values()
                                 for st in ns.slots.values())),
        "namespaces": len(engine.namespaces), "lmdb_map_grows": engine.catalog.map_grows,
        "write_policy": s.write_policy,
        "uptime_s": round(time.time() - engine.started, 3),
    }
