"""The coherence state machine, enumerated from its table."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvtier.coherence.states import (TRANSITIONS, BlockState, CopyState, Event,
                                     IllegalTransition, copy_state, next_state, next_states)


def test_every_pair_is_either_in_the_table_or_illegal():
    for state, event in itertools.product(BlockState, Event):
        if (state, event) in TRANSITIONS:
            assert next_state(state, event) is TRANSITIONS[(state, event)]
        else:
            with pytest.raises(IllegalTransition):
                next_state(state, event)


def test_the_table_is_exactly_the_documented_lifecycle():
    assert {(s.name, e.value, t.name) for (s, e), t in TRANSITIONS.items()} == {
        ("EMPTY", "commit", "DIRTY"), ("DIRTY", "commit", "DIRTY"), ("CLEAN", "commit", "DIRTY"),
        ("DIRTY", "flushed", "CLEAN"), ("CLEAN", "flushed", "CLEAN"),
        ("DIRTY", "delete", "EMPTY"), ("CLEAN", "delete", "EMPTY"),
        ("DIRTY", "lost", "EMPTY"), ("CLEAN", "lost", "EMPTY"),
    }


def test_an_empty_block_cannot_be_flushed_deleted_or_lost():
    for ev in (Event.FLUSHED, Event.DELETE, Event.LOST):
        with pytest.raises(IllegalTransition):
            next_state(BlockState.EMPTY, ev)


def test_batch_form_agrees_with_the_scalar_form():
    for event in Event:
        legal = [s for s in BlockState if (s, event) in TRANSITIONS]
        arr = np.array(legal, dtype=np.uint8)
        assert next_states(arr, event).tolist() == [int(next_state(s, event)) for s in legal]
    with pytest.raises(IllegalTransition, match="EMPTY"):
        next_states(np.array([BlockState.DIRTY, BlockState.EMPTY], dtype=np.uint8), Event.FLUSHED)


def test_copy_states_are_derived_from_versions():
    assert copy_state(0, 3) is CopyState.ABSENT
    assert copy_state(2, 3) is CopyState.STALE
    assert copy_state(3, 3) is CopyState.CURRENT
