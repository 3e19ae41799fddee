"""What the socket server keeps per connection: its figures (/v1/clients) and its holds.

ClientInfo is one connection's record (peer pid and uid, ops, errors, recent latencies).
The limits below are applied before the server calls the engine (issue 20).

Any process of an allowed uid can connect, so what one connection may make the service hold
is bounded here, with errors that name the setting to change:

    Pins          host slots one connection holds under lease or reservation, by the ids the
                  engine handed it; ended by release, commit, abort or the connection. At most
                  max_client_share of a namespace's host slots: one peer leasing every slot
                  turned every other client's get of durable NVMe blocks into a miss, and its
                  puts into errors, until lease_timeout.
    inline_size   an inline get's reply carries every asked block (zeros for misses): at most
                  max_frame, checked before anything is allocated (one get of 64 keys of 1 GiB
                  blocks asked the service for 64 GiB).

The counts live in the server, not the engine, so that the engine's lease paths (the C fast
path included) are unchanged; they are the server's view of its own replies.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from kvtier.errors import BadRequest, CapacityError
from kvtier.types import Tier


@dataclass(slots=True)
class Pins:
    """Host slots held by one connection: hold id (lease or reservation) -> (namespace, n).

    live (the server's, or None): whether the engine still holds an id. A hold the engine
    ended on its own (a reservation or lease expired, reaped) has no request that ends it
    here; the count drops such ids before it refuses a request, so that what it counts is
    what the service still holds (rev11: an idle writer's expired credit refused its next
    reservations until it sent that rid again)."""

    by_id: dict[int, tuple[str, int]] = field(default_factory=dict)
    live: Callable[[int], bool] | None = None

    def add(self, hold_id: int, namespace: str, n: int) -> None:
        self.by_id[hold_id] = (namespace, n)

    def end(self, ids: Iterable[Any]) -> None:
        for i in ids:
            self.by_id.pop(int(i), None)

    def shrink(self, hold_id: int, n: int) -> None:
        """A partial release of n slots of a lease."""
        if hold_id in self.by_id:
            name, held = self.by_id[hold_id]
            self.by_id[hold_id] = (name, max(0, held - n))

    def check(self, ns: Any, keys: bytes, share: float) -> None:
        """CapacityError when len(keys) more slots of ns would pass share of its host pool."""
        self.check_count(ns, len(keys) // max(ns.key_width, 1), share)

    def check_count(self, ns: Any, want: int, share: float) -> None:
        """CapacityError when want more slots of ns would pass share of its host pool."""
        slots = ns.slots[Tier.HOST].pool.n_slots
        limit = int(share * slots)
        held = self._held(ns.name)
        if want and held + want > max(limit, 1) and self._drop_ended():
            held = self._held(ns.name)
        if want and held + want > max(limit, 1):
            raise CapacityError(
                f"this connection holds {held} slots of {ns.name!r} under lease or reservation "
                f"and asks for {want} more; one connection may pin {limit} "
                f"(max_client_share={share} of {slots}): release leases first, or raise "
                "max_client_share")

    def _held(self, namespace: str) -> int:
        return sum(n for name, n in self.by_id.values() if name == namespace)

    def _drop_ended(self) -> bool:
        """Forget the ids the engine no longer holds (live says so); whether there were any.
        Only on the way to a refusal: the common request pays nothing for it."""
        if self.live is None:
            return False
        ended = [i for i in self.by_id if not self.live(i)]
        for i in ended:
            del self.by_id[i]
        return bool(ended)


@dataclass(slots=True)
class ClientInfo:
    """Per-connection figures behind /v1/clients."""

    cid: int
    pid: int
    uid: int
    name: str = ""
    connected: float = field(default_factory=time.time)
    ops: int = 0
    errors: int = 0
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=2048))
    pins: Pins = field(default_factory=Pins)     # host slots held (api.quota)
    sorted_gets: dict = field(default_factory=dict)   # id -> SortedGet (api.sortedgets)

    def record(self, seconds: float, ok: bool) -> None:
        self.ops += 1
        self.errors += 0 if ok else 1
        self.recent.append((time.monotonic(), seconds, ok))

    def summary(self, window: float = 10.0) -> dict[str, Any]:
        now = time.monotonic()
        rec = [r for r in self.recent if now - r[0] <= window]
        qps = len(rec) / window
        lat = [r[1] for r in rec]
        p99_ms = float(np.percentile(lat, 99) * 1000) if lat else 0.0
        err = (sum(1 for r in rec if not r[2]) / len(rec)) if rec else 0.0
        return {"id": self.cid, "pid": self.pid, "uid": self.uid, "name": self.name,
                "connected_s": round(time.time() - self.connected, 1), "ops": self.ops,
                "errors": self.errors, "qps": round(qps, 2), "p99_ms": round(p99_ms, 3),
                "error_rate": round(err, 4),
                "load_weight": round(qps * (1 + 0.1 * p99_ms) / (1 + err), 3)}


def inline_size(ns: Any, keys: bytes, max_frame: int) -> None:
    """BadRequest when an inline get of keys would reply with more than max_frame bytes."""
    n = len(keys) // max(ns.key_width, 1)
    size = n * ns.block_bytes
    if size > max_frame:
        raise BadRequest(f"an inline get of {n} blocks of {ns.block_bytes} bytes ({size} bytes) "
                         f"exceeds max_frame ({max_frame}); ask for fewer keys per request, use "
                         "the mapped data path, or raise max_frame")
