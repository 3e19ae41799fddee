"""The coherence state machine, written as data.

A block (one page-table row) is in one BlockState. Events move it along TRANSITIONS; any pair
missing from the table is illegal and raises, so a test can enumerate every legal move and every
illegal one. Per-tier copies are not a separate state: a copy is CURRENT when its version equals
the row's version, STALE when lower, ABSENT when zero (CopyState, derived by ``copy_state``).

    EMPTY  --commit-->  DIRTY  --flushed-->  CLEAN
    CLEAN  --commit-->  DIRTY                (a rewrite: the NVMe copy becomes stale)
    DIRTY  --commit-->  DIRTY
    any    --delete / lost-->  EMPTY         (lost: the last current copy was dropped or failed
                                              its checksum)
    CLEAN  --flushed--> CLEAN                (compaction moved the NVMe copy)

Reservations (two-phase puts) and leases (readers) have their own small tables.
"""

from __future__ import annotations

from enum import Enum, IntEnum
from typing import Any

from kvtier.errors import KvtierError


class BlockState(IntEnum):
    EMPTY = 0   # no committed version (a fresh or deleted row)
    DIRTY = 1   # the latest version is not yet on NVMe
    CLEAN = 2   # the latest version is on NVMe and committed to LMDB


class Event(Enum):
    COMMIT = "commit"
    FLUSHED = "flushed"
    DELETE = "delete"
    LOST = "lost"


TRANSITIONS: dict[tuple[BlockState, Event], BlockState] = {
    (BlockState.EMPTY, Event.COMMIT): BlockState.DIRTY,
    (BlockState.DIRTY, Event.COMMIT): BlockState.DIRTY,
    (BlockState.CLEAN, Event.COMMIT): BlockState.DIRTY,
    (BlockState.DIRTY, Event.FLUSHED): BlockState.CLEAN,
    (BlockState.CLEAN, Event.FLUSHED): BlockState.CLEAN,
    (BlockState.DIRTY, Event.DELETE): BlockState.EMPTY,
    (BlockState.CLEAN, Event.DELETE): BlockState.EMPTY,
    (BlockState.DIRTY, Event.LOST): BlockState.EMPTY,
    (BlockState.CLEAN, Event.LOST): BlockState.EMPTY,
}


class IllegalTransition(KvtierError):
    code = "internal"


def next_state(state: BlockState, event: Event) -> BlockState:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"no transition from {state.name} on {event.value}") from None


# Vectorised form for batches: _NEXT[event][state] -> new state, 255 where illegal.
_ILLEGAL = 255
_NEXT: dict[Event, list[int]] = {
    ev: [int(TRANSITIONS.get((st, ev), _ILLEGAL)) for st in BlockState] for ev in Event
}


_NEXT_ARRAYS: dict[Event, Any] = {}


def transition_array(event: Event):  # numpy uint8 array: [state] -> next state, 255 illegal
    """TRANSITIONS for one event as an array indexed by state (ILLEGAL where there is no
    move): what next_states and the C helpers (kvtier.coherence._fast) apply."""
    table = _NEXT_ARRAYS.get(event)
    if table is None:
        import numpy as np
        table = _NEXT_ARRAYS[event] = np.asarray(_NEXT[event], dtype=np.uint8)
    return table


def next_states(states, event: Event):  # numpy uint8 array in, array out
    """Batch next_state. Raises IllegalTransition if any row has no legal move."""
    out = transition_array(event)[states]
    if out.size and out.max() == _ILLEGAL:
        bad = BlockState(int(states[(out == _ILLEGAL).argmax()]))
        raise IllegalTransition(f"no transition from {bad.name} on {event.value}")
    return out


class CopyState(Enum):
    ABSENT = "absent"
    STALE = "stale"
    CURRENT = "current"


def copy_state(copy_version: int, version: int) -> CopyState:
    if copy_version == 0:
        return CopyState.ABSENT
    return CopyState.CURRENT if copy_version == version else CopyState.STALE


class HoldState(Enum):
    """A reservation (writer) or lease (reader)."""

    HELD = "held"
    COMMITTED = "committed"    # reservations only
    RELEASED = "released"
    EXPIRED = "expired"


HOLD_TRANSITIONS: dict[tuple[HoldState, str], HoldState] = {
    (HoldState.HELD, "commit"): HoldState.COMMITTED,
    (HoldState.HELD, "release"): HoldState.RELEASED,
    (HoldState.HELD, "expire"): HoldState.EXPIRED,
    (HoldState.HELD, "disconnect"): HoldState.RELEASED,
}
