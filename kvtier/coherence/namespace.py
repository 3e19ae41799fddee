"""A namespace's runtime state, and the records of reservations, leases and tier counters.

Per namespace and per slot tier (HBM, host) the engine keeps three arrays indexed by slot:

    slot_row     int64   the row whose copy is in the slot; -1 when free, reserved or retired
    leases       uint32  readers (and internal pins) holding the slot
    retired      bool    the slot held an older version that was replaced or deleted while
                         leased; it is freed when its last lease goes (MVCC)

so that eviction, lease release and slot reuse are numpy operations over the pool.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.coherence.states import HoldState
from kvtier.errors import NamespaceError
from kvtier.pagetable.table import PageTable
from kvtier.tiers.host import SlotPool
from kvtier.tiers.nvme import SegmentLog
from kvtier.types import Tier


@dataclass(slots=True)
class SlotState:
    pool: SlotPool
    slot_row: np.ndarray
    leases: np.ndarray
    retired: np.ndarray
    peak_demand: int = 0      # most slots asked of the pool at once (coherence.reserve)
    policy: Any = None        # the tier's eviction policy state (coherence.eviction)

    @classmethod
    def for_pool(cls, pool: SlotPool) -> "SlotState":
        n = pool.n_slots
        return cls(pool, np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.uint32),
                   np.zeros(n, dtype=bool))


@dataclass(slots=True)
class Namespace:
    name: str
    ns_id: int
    block_bytes: int
    key_width: int
    layout: dict[str, Any]
    table: PageTable
    slots: dict[Tier, SlotState]
    log: SegmentLog | None

    def check_layout(self, layout: dict[str, Any] | None) -> None:
        """Refuse a client whose layout differs from the stored one: the bytes are opaque, so
        two layouts of the same block size would otherwise serve each other's blocks as their
        own (a wrong KV block, not a miss). None is a client that states no layout."""
        if layout is not None and _canonical(layout) != _canonical(self.layout):
            raise NamespaceError(
                f"namespace {self.name!r} holds layout {_canonical(self.layout)}, not "
                f"{_canonical(layout)}: its blocks would be misread; use another namespace name "
                "for another layout (or delete this one's data directory)")

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "ns_id": self.ns_id, "block_bytes": self.block_bytes,
                "key_width": self.key_width, "layout": self.layout,
                "blocks": int(self.table.live),
                "host_slots": self.slots[Tier.HOST].pool.n_slots}


@dataclass(slots=True)
class Reservation:
    """Phase one of a put: fresh slots the writer fills before commit."""

    rid: int
    ns: Namespace
    tier: Tier
    keys: np.ndarray
    parents: np.ndarray | None
    slots: np.ndarray
    owner: int
    deadline: float
    state: HoldState = HoldState.HELD
    repeats: bool = True      # some key may occur twice (False: checked distinct at reserve)
    credit: bool = False      # reserved by count, no keys yet: the commit names them (Puts)


@dataclass(slots=True)
class Lease:
    """A reader's hold on the slots of one get batch."""

    lid: int
    ns: Namespace
    tier: Tier
    slots: np.ndarray
    rows: np.ndarray
    versions: np.ndarray
    owner: int
    deadline: float
    state: HoldState = HoldState.HELD


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    promotions: int = 0
    demotions: int = 0
    evictions: int = 0
    prefetched: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


@dataclass(slots=True)
class EngineCounters:
    tiers: dict[Tier, TierCounters] = field(
        default_factory=lambda: {t: TierCounters() for t in Tier})
    gets: int = 0
    get_hits: int = 0
    puts: int = 0
    checksum_failures: int = 0
    nvme_full: int = 0
    flushes: int = 0
    flushed_blocks: int = 0
    compactions: int = 0
    records_dropped: int = 0
    expired_reservations: int = 0
    expired_leases: int = 0


@dataclass(slots=True)
class GetResult:
    """One get batch. Arrays are aligned with the keys; slots are -1 where found is False."""

    found: np.ndarray
    slots: np.ndarray
    versions: np.ndarray
    checksums: np.ndarray
    lease_id: int
    tier: Tier


def _canonical(layout: dict[str, Any]) -> str:
    """One spelling of a layout, for comparing (key order and tuple/list do not count)."""
    return json.dumps(layout, sort_keys=True, default=str)


def add_one(counts: np.ndarray, idx: np.ndarray, delta: int = 1) -> None:
    """counts[idx] += 1 (or -= 1), counting repeated indices. numpy 2's ufunc.at takes ~9 us
    for 4,096 indices on the dev VM, less than the sort that used to prove them distinct
    (~80 us) so that plain fancy += could be used. The step is of the counts' own type: a
    Python int made ufunc.at ~10x slower (110 us for 4,096 on the dev VM)."""
    step = counts.dtype.type(abs(delta))      # unsigned counters: subtract, never add -1
    (np.add if delta > 0 else np.subtract).at(counts, idx, step)


def to_numpy(x: Any) -> np.ndarray:
    """Device arrays (cupy) come back to the host; numpy passes through."""
    return x if isinstance(x, np.ndarray) else x.get()
