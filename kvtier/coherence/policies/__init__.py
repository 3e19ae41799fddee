"""Eviction policies, as data: POLICIES maps a name to the code that implements it and to its
parameters' defaults. Each parameter is a setting (``eviction_<param>``, one value for every tier
or ``tier:value`` pairs), so a tier's policy is its name plus these values.

    lru     least recently used, exactly (policies.queues.LruQueue)
    s3fifo  S3-FIFO as published: probation FIFO of 10% of the tier, main FIFO with 2-bit
            frequency counters, ghost of evicted keys as large as the main queue (0.9x)
    chain   S3-FIFO shaped for prefix chains (the default, chosen by replaying Mooncake's
            traces, bench/RESULTS.md): a ghost of 4x the tier, so that a conversation's blocks
            are still remembered when its next turn comes (median reuse distance on the
            conversation trace: 8,678 blocks), leaf_first, so that each put batch enters the
            queues deepest block first and a chain loses its leaves before its parents, and a
            probation share of 2%: a conversation's new blocks come back after its think time
            or not at all (conversation trace, a 3e6-token tier: 0.3% of first-time blocks are
            reused within a quarter of the tier's size in accesses, 6% within one tier),
            so probation only has to hold a put until the next eviction finds it, and each
            slot it does not need is a main-queue slot (2% >= 5% at every size, 5e5 to 6e6, on each
            quarter of the conversation trace, the first half cut in two; 10%, 20% lower)

The slot tiers (HBM, host) run the maintained structures of policies.queues. The NVMe tier is
reclaimed by whole segments, oldest first (coherence.space); a policy's ``readmit`` says which of
a reclaimed segment's blocks are copied forward instead of leaving the cache, from the rows of
that segment and a sample of the tier (O(segment) whatever the table holds):

    recency         (lru, chain)  accessed more recently than the median of a sample of the
                                  tier (the "hotter half", as the scan over every row ranked)
    recency_reused  (s3fifo)      that, and accessed more than once (one-hit blocks leave)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

import numpy as np

from kvtier.coherence.policies.queues import LruQueue, S3Fifo
from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.coherence.namespace import SlotState
    from kvtier.pagetable.table import PageTable


class TierPolicy(Protocol):
    """What coherence.eviction calls (policies.queues describes the contract)."""

    def on_insert(self, rows: np.ndarray, slots: np.ndarray) -> None: ...
    def on_remove(self, slots: np.ndarray) -> None: ...
    def victims(self, n: int, drop: bool = False) -> np.ndarray: ...
    def give_back(self, slots: np.ndarray) -> None: ...


def ghost_blocks(spec: str, n_slots: int) -> int:
    """'4x' -> 4 x the tier's slots; '100000' -> that many blocks."""
    text = spec.strip().lower()
    try:
        if text.endswith("x"):
            value = float(text[:-1])
            if value >= 0:
                return int(round(value * n_slots))
        elif int(text) >= 0:
            return int(text)
    except ValueError:
        pass
    raise ConfigError(f"eviction_ghost: {spec!r} is neither a multiple of the tier (4x) nor a "
                      "number of blocks (100000)")


def parse_param(name: str, spec: str) -> Any:
    """A parameter's value from its text; ConfigError naming the setting when it is bad."""
    setting = f"eviction_{name}"
    text = str(spec).strip().lower()
    if name == "ghost":
        ghost_blocks(text, 1)
        return text
    if name == "leaf_first":
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{setting}: expected true or false, got {spec!r}")
    try:
        value = float(text) if name == "small" else int(text)
    except ValueError:
        raise ConfigError(f"{setting}: expected a number, got {spec!r}") from None
    if name == "small" and not 0 < value < 1:
        raise ConfigError(f"{setting}: the probation queue's share of the tier, strictly "
                          f"between 0 and 1 (0.1), got {spec!r}")
    if name == "freq_max" and not 1 <= value <= 15:
        raise ConfigError(f"{setting}: the main queue's counter limit, 1 to 15 (3), got {spec!r}")
    return value


def _lru(st: SlotState, table: PageTable, params: Mapping[str, Any]) -> TierPolicy:
    return LruQueue(st, table)


def _s3fifo(st: SlotState, table: PageTable, params: Mapping[str, Any]) -> TierPolicy:
    return S3Fifo(st, table, params["small"], ghost_blocks(params["ghost"], st.pool.n_slots),
                  params["freq_max"], params["leaf_first"])


Readmit = Callable[[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def recency(cols: dict[str, np.ndarray], rows: np.ndarray, written: np.ndarray,
            sample: np.ndarray) -> np.ndarray:
    """rows in the hotter half of the tier by last access: more recent than the median of a
    sample of the tier's rows (``written``, the clock of each row's write, is not used)."""
    last = cols["last_access"][rows]
    if sample.size == 0:
        return np.ones(rows.size, dtype=bool)
    return last > np.median(cols["last_access"][sample])


def recency_reused(cols: dict[str, np.ndarray], rows: np.ndarray, written: np.ndarray,
                   sample: np.ndarray) -> np.ndarray:
    """recency, for blocks accessed more than once (S3-FIFO's one-hit filter)."""
    return recency(cols, rows, written, sample) & (cols["freq"][rows] > 1)


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    make: Callable[[Any, Any, Mapping[str, Any]], TierPolicy]
    readmit: Readmit                     # NVMe: which of a reclaimed segment's blocks stay
    defaults: Mapping[str, str]
    # What the host tier runs instead when an HBM tier sits above it and eviction_host does
    # not name a policy (None: the same policy). See chain's entry.
    under_hbm: str | None = None


PARAMETERS = ("small", "ghost", "freq_max", "leaf_first")
_S3 = {"small": "0.1", "freq_max": "3"}
POLICIES: dict[str, Policy] = {
    "lru": Policy("lru", _lru, recency, {}),
    "s3fifo": Policy("s3fifo", _s3fifo, recency_reused,
                     {**_S3, "ghost": "0.9x", "leaf_first": "false"}),
    # The NVMe tier keeps chain's blocks by recency: the one-hit-first ranking (s3fifo's) was
    # measured far below LRU on the conversation trace (issue 18: -62% of the gap at 6e6).
    # Chain's admission needs the reuse of what a tier evicted to come back through that tier.
    # Under an HBM tier it does not for host: gets are served from HBM, a block that leaves
    # host is read back NVMe -> HBM, and host's main queue fills with the blocks lost from every
    # tier (measured, docs/DESIGN-NOTES.md: host chain 0.1463, host LRU 0.1618, synthetic
    # trace, tiered). There the host tier runs exact LRU.
    "chain": Policy("chain", _s3fifo, recency,
                    {**_S3, "small": "0.02", "ghost": "4x", "leaf_first": "true"},
                    under_hbm="lru"),
}


def tier_params(policy: str, given: Mapping[str, str]) -> dict[str, Any]:
    """The policy's parameters: its defaults, overridden by the settings that name a value."""
    spec = POLICIES[policy]
    return {k: parse_param(k, given.get(k) or v) for k, v in spec.defaults.items()}


def make_tier_policy(policy: str, st: SlotState, table: PageTable,
                     given: Mapping[str, str]) -> TierPolicy:
    return POLICIES[policy].make(st, table, tier_params(policy, given))
