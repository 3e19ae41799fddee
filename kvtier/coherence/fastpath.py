"""FastPath: the part of the engine that leases gets whose every block is already resident
(try_get_resident takes the engine lock; the other methods run under it).

These are the worker API's hot cases: a single-key get is its latency figure (bench/api.py
p50_us), and a batch of 4,096 resident keys is the control path that the GPU onboarding bench
waits on. The general path in Engine._get handles misses, bring-ups and repeats with ~40 numpy
calls. Here:

- get_one does the bookkeeping of one key on numpy scalars (a numpy call costs about a
  microsecond) where the C helper is missing, and is lease_native's one call where it is;
- lease_resident leases a batch that is all found and all current in the tier, gathering each
  column once;
- lease_native does lease_resident's checks and work in one C call (kvtier.coherence._fast);
  where that module was not built, the numpy versions run. (Ending these leases is
  coherence.leases's.)

Both leave exactly the state the general path leaves (rows, counters, lease, reply): the
engine's tests compare the two field by field
(tests/test_engine.py::test_fast_paths_leave_the_state_the_batch_path_leaves). Anything else
returns None, or is not called, and takes the general path.

Interface. Owns nothing but its scratch outputs. Public: lease_one, try_get_resident (the
engine's methods of those names are these, bound), get_one, lease_resident, lease_native,
count_hits (coherence.gets calls them). Calls: the namespaces (by name), the table of leases it
adds to (coherence.leases's), the counters, lease_timeout, and through ``Ledger`` the engine's
access clock, its id counter and its touch.
"""

from __future__ import annotations

import time
import threading
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from kvtier.coherence.leases import count_readers
from kvtier.coherence.namespace import GetResult, Lease, add_one
from kvtier.errors import BadRequest
from kvtier.types import Tier

LEASE_COUNT_MAX = 65535             # the page table's uint16 reader count

try:
    from kvtier.coherence import _fast
except ImportError:                       # not built: the numpy versions below run instead
    _fast = None

if TYPE_CHECKING:
    from kvtier.coherence.namespace import EngineCounters, Namespace
    from kvtier.config import Settings

_TRUE = np.ones(1, dtype=bool)


# numpy names the hot paths read as globals (why: kvtier.pagetable.table, at _empty).
_I32, _I64, _U64, _empty = np.int32, np.int64, np.uint64, np.empty


def _not_one_key(n: int) -> None:
    raise BadRequest(f"lease_one leases one key; {n} were given")


class Ledger(Protocol):
    """What a lease needs of the engine: the access clock (last_access is on it), the next
    lease id, and the touch of a batch's rows (advances the clock)."""

    clock: int

    def new_id(self) -> int: ...
    def touch(self, ns: Namespace, rows: np.ndarray) -> None: ...


class FastPath:
    def __init__(self, lock: threading.RLock, namespace: Callable[[str], Namespace],
                 leases: dict[int, Lease], counters: EngineCounters, settings: Settings,
                 ledger: Ledger) -> None:
        self.lock = lock
        self.namespace = namespace
        self.leases = leases
        self.counters = counters
        self.settings = settings
        self.ledger = ledger
        self._new_id = ledger.new_id         # bound once: one lookup less per lease
        # lease_one's outputs, read under this engine's lock. One set per engine, not per
        # module: another engine's lease_one (another thread, a GIL switch between the C call
        # and the reads) wrote its slot, version and checksum into a shared set (rev7).
        self._one = (np.empty(1, dtype=np.int32), np.empty(1, dtype=np.uint64),
                     np.empty(1, dtype=np.uint64))

    def lease_one(self, ns: Namespace, key: bytes | np.ndarray, owner: int,
                  tier: Tier = Tier.HOST) -> tuple[int, int, int, int] | None:
        """get_one for a socket reply: (lease id, slot, version, checksum) as Python ints, no
        GetResult; None (nothing changed) when the key is not found or not current in tier.
        key: one packed key (bytes, or a one-key array of the namespace's keys: the replay's).
        The checks and the touch are lease_rows' (one C call for a dozen numpy scalar
        operations); without the module, get_one's. BadRequest for no key or several: the
        outputs are one key's (with none, lease_rows had nothing to refuse, and the reply was
        the previous call's slot, version and checksum, unpinned: rev7)."""
        if _fast is None:
            karr = ns.table.keys_array(key)
            if karr.shape[0] != 1:
                _not_one_key(karr.shape[0])
            res = self.get_one(ns, karr, owner, tier)
            if res is None:
                return None
            return (res.lease_id, int(res.slots[0]), int(res.versions[0]),
                    int(res.checksums[0]))
        rows = ns.table.lookup(key)
        if rows.shape[0] != 1:
            _not_one_key(rows.shape[0])
        cols = ns.table.cols
        st = ns.slots[tier]
        ledger = self.ledger
        o_slot, o_ver, o_sum = self._one
        if not _fast.lease_rows(cols["version"], cols["copy_ver"], cols["slot"], cols["leases"],
                                cols["last_access"], cols["prev_access"], cols["freq"],
                                cols["checksum"], st.leases, rows, ns.table.n_rows, int(tier),
                                ledger.clock, o_slot, o_ver, o_sum):
            return None
        ledger.clock += 1
        self.count_hits(ns, 1, tier)
        lid = self._new_id()
        # The lease's own arrays from the scratch outputs: a cast and a copy (np.array of a
        # list is a Python-level conversion, ~twice either).
        self.leases[lid] = Lease(lid, ns, tier, o_slot.astype(_I64), rows, o_ver.copy(), owner,
                                 time.monotonic() + self.settings.lease_timeout)
        return lid, o_slot.item(), o_ver.item(), o_sum.item()

    def get_one(self, ns: Namespace, karr: np.ndarray, owner: int,
                 tier: Tier) -> GetResult | None:
        """Lease the one key's copy in tier when it holds the current version; else None.
        With the C helper this is lease_native's one call (a dozen numpy scalar operations
        here cost more than its few arrays); the scalar version below is the fallback."""
        table = ns.table
        if _fast is not None:
            return self.lease_native(ns, table.lookup(karr), owner, tier)
        row = int(table.lookup(karr)[0])
        if row < 0:
            return None
        cols = table.cols
        version = cols["version"][row]
        if version == 0 or cols["copy_ver"][row, tier] != version:
            return None
        slot = int(cols["slot"][row, tier])
        st = ns.slots[tier]
        st.leases[slot] += 1
        if cols["leases"][row] < LEASE_COUNT_MAX:   # saturating, as the C helpers' counts
            cols["leases"][row] += 1
        ledger = self.ledger
        ledger.clock += 1
        cols["prev_access"][row] = cols["last_access"][row]
        cols["last_access"][row] = ledger.clock
        cols["freq"][row] += 1
        c = self.counters
        c.gets += 1
        c.get_hits += 1
        tc = c.tiers[tier]
        tc.hits += 1
        tc.bytes_read += ns.block_bytes
        lid = self._new_id()
        versions = np.array([version], dtype=np.uint64)
        self.leases[lid] = Lease(lid, ns, tier, np.array([slot], dtype=np.int64),
                                 np.array([row], dtype=np.int64), versions, owner,
                                 time.monotonic() + self.settings.lease_timeout)
        return GetResult(_TRUE.copy(), np.array([slot], dtype=np.int32), versions.copy(),
                         np.array([cols["checksum"][row]], dtype=np.uint64), lid, tier)

    def try_get_resident(self, namespace: str, keys: bytes, owner: int,
                         tier: Tier) -> GetResult | None:
        """A get whose every block is found and current in tier, leased (takes the lock);
        None, with nothing changed, for anything else. The server answers HBM-tier gets so on
        its loop: the general get may copy host blocks up to the GPU, so it runs on a thread,
        and on the H200 host that hop cost each request ~0.1 ms (a 1,024-block HBM get's
        control was a quarter of its time)."""
        with self.lock:
            ns = self.namespace(namespace)
            if tier not in ns.slots:
                return None
            karr = ns.table.keys_array(keys)
            if karr.size == 0:
                return None
            rows = ns.table.lookup(karr)
            if _fast is not None:
                return self.lease_native(ns, rows, owner, tier)
            cols = ns.table.cols
            if not (rows >= 0).all():
                return None
            ver = cols["version"][rows]
            if not (ver.all() and (cols["copy_ver"][rows, tier] == ver).all()):
                return None
            return self.lease_resident(ns, rows, ver, owner, tier)

    def lease_resident(self, ns: Namespace, rows: np.ndarray, versions: np.ndarray,
                        owner: int, tier: Tier) -> GetResult:
        """Lease rows (all found, all current in tier; versions = their versions)."""
        cols = ns.table.cols
        n = rows.size
        slots = cols["slot"][rows, tier]
        slots64 = slots.astype(np.int64)
        pins = ns.slots[tier].leases
        add_one(pins, slots64)
        count_readers(cols["leases"], rows)        # saturating, as lease_rows
        try:
            self.ledger.touch(ns, rows)
            lid = self._new_id()
            lease = Lease(lid, ns, tier, slots64, rows, versions, owner,
                          time.monotonic() + self.settings.lease_timeout)
            res = GetResult(np.ones(n, dtype=bool), slots, versions.copy(),
                            cols["checksum"][rows], lid, tier)
        except BaseException:
            # No lease made (it is the last step, as Gets._lease_get's): the pins and counts
            # come off again (current copies: none of their slots is retired).
            count_readers(cols["leases"], rows, -1)
            add_one(pins, slots64, -1)
            raise
        self.count_hits(ns, n, tier)
        self.leases[lid] = lease
        return res

    def lease_native(self, ns: Namespace, rows: np.ndarray, owner: int,
                      tier: Tier) -> GetResult | None:
        """lease_resident in one C call, checks included: None when the module is missing or
        some row is not found or not current in tier (nothing was changed; the caller takes
        the general path)."""
        if _fast is None:
            return None
        cols = ns.table.cols
        n = rows.size
        st = ns.slots[tier]
        ledger = self.ledger
        slots = _empty(n, dtype=_I32)
        versions = _empty(n, dtype=_U64)
        sums = _empty(n, dtype=_U64)
        if not _fast.lease_rows(cols["version"], cols["copy_ver"], cols["slot"], cols["leases"],
                                cols["last_access"], cols["prev_access"], cols["freq"],
                                cols["checksum"], st.leases, rows, ns.table.n_rows, int(tier),
                                ledger.clock, slots, versions, sums):
            return None
        ledger.clock += n
        self.count_hits(ns, n, tier)
        lid = self._new_id()
        self.leases[lid] = Lease(lid, ns, tier, slots.astype(_I64), rows, versions, owner,
                                 time.monotonic() + self.settings.lease_timeout)
        found = _empty(n, dtype=bool)    # np.ones is a Python function: two calls more
        found.fill(True)
        return GetResult(found, slots, versions.copy(), sums, lid, tier)

    def count_hits(self, ns: Namespace, n: int, tier: Tier) -> None:
        c = self.counters
        c.gets += n
        c.get_hits += n
        tc = c.tiers[tier]
        tc.hits += n
        tc.bytes_read += n * ns.block_bytes
