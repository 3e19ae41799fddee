"""A sorted get whose first request carries piece 0's keys alone and piece 1 the others
(pipeline.lease_sorted's requests since lease13; kvtier.api.sortedgets), against a real
`kvtier serve`: every piece's slots hold its own keys' bytes, the older form (every key in the
first request) is still served, and a piece 1 that brings no keys, the wrong number, or keys
where none are due is refused in one line, the get ended, no lease left, the connection going
on."""

from __future__ import annotations

import numpy as np
import pytest

import kvtier
from kvtier.errors import BadRequest
from tests.conftest import blocks, keys
from tests.test_sorted_gets import BB, _held, _release


@pytest.fixture
def ns(service):
    with kvtier.Client(str(service.socket)) as c:
        yield c.namespace("s", block_bytes=BB)


def _pieces(ns, first: dict, later: list[dict]) -> list[dict]:
    """Send a sorted get's requests at once (as lease_sorted does), read every reply."""
    c = ns._client
    head = c._send("get", {"ns": "s", **first})
    ids = [head] + [c._send("get", {"ns": "s", "of": head, "piece": i + 1, **extra})
                    for i, extra in enumerate(later)]
    return [c._reply(i) for i in ids]


@pytest.mark.parametrize("split", [True, False])
def test_both_forms_serve_every_piece_from_its_own_keys_slots(ns, split):
    data = blocks(96, BB)
    ns.put(keys(range(96)), data)
    ids = np.random.default_rng(2).permutation(96)
    kb = keys(ids.tolist())
    ends = np.array([16, 48, 96], "<u4").tobytes()
    first = {"keys": kb[:16 * 16] if split else kb, "sort": ends}
    later = [{"keys": kb[16 * 16:]} if split else {}, {}]
    replies = _pieces(ns, first, later)
    view = ns._view()
    seen = []
    for r in replies:
        at = np.frombuffer(r["order"], "<u4")
        slots = np.frombuffer(r["slots"], "<i4").astype(np.int64)
        assert np.frombuffer(r["found"], "u1").all()
        assert (view[slots] == data[ids[at]]).all()
        seen.append(at)
    assert (seen[0] == np.arange(16)).all()
    assert sorted(np.concatenate(seen).tolist()) == list(range(96))
    for s in (np.frombuffer(r["slots"], "<i4") for r in replies[1:]):
        assert (np.diff(s) > 0).all()                   # the later pieces in slot order
    _release(ns, [r["lease"] for r in replies])
    assert _held(ns) == 0


@pytest.mark.parametrize("piece1,says", [
    ({}, "carries 0 keys where the pieces' ends leave 6"),
    ({"keys": keys(range(2, 7))}, "carries 5 keys where"),
    ({"keys": b"\x01" * 17}, "multiple"),
    ({"keys": "x"}, "must be bytes"),
])
def test_a_piece_1_without_the_other_keys_ends_the_get(ns, piece1, says):
    ns.put(keys(range(8)), blocks(8, BB))
    c = ns._client
    head = c._send("get", {"ns": "s", "keys": keys(range(2)),
                           "sort": np.array([2, 5, 8], "<u4").tobytes()})
    lease0 = c._reply(head)["lease"]
    with pytest.raises(BadRequest, match=says) as err:
        c._call("get", ns="s", of=head, piece=1, **piece1)
    assert "the get is ended" in str(err.value) and "\n" not in str(err.value)
    # The last piece, refused with the get, still ends the releases piggybacked on it.
    c._release_later(lease0)
    with pytest.raises(BadRequest, match="no sorted get"):
        c._call("get", ns="s", of=head, piece=2)
    assert _held(ns) == 0
    assert ns.get(keys(range(8)))[0].all()              # the connection goes on


def test_keys_on_any_other_later_piece_are_refused(ns):
    ns.put(keys(range(8)), blocks(8, BB))
    c = ns._client
    ends = np.array([2, 5, 8], "<u4").tobytes()
    head = c._send("get", {"ns": "s", "keys": keys(range(8)), "sort": ends})   # every key
    leases = [c._reply(head)["lease"]]
    with pytest.raises(BadRequest, match="no keys"):        # piece 1, nothing due
        c._call("get", ns="s", of=head, piece=1, keys=keys(range(2, 8)))
    leases.append(c._call("get", ns="s", of=head, piece=1)["lease"])
    head2 = c._send("get", {"ns": "s", "keys": keys(range(2)), "sort": ends})  # split
    leases.append(c._reply(head2)["lease"])
    leases.append(c._call("get", ns="s", of=head2, piece=1, keys=keys(range(2, 8)))["lease"])
    with pytest.raises(BadRequest, match="no keys"):        # piece 2 of the split one
        c._call("get", ns="s", of=head2, piece=2, keys=keys(range(5, 8)))
    leases.append(c._call("get", ns="s", of=head2, piece=2)["lease"])
    leases.append(c._call("get", ns="s", of=head, piece=2)["lease"])
    _release(ns, leases)
    assert _held(ns) == 0


def test_a_first_request_of_neither_every_key_nor_piece_0s_is_refused(ns):
    ns.put(keys(range(8)), blocks(8, BB))
    for n in (1, 3, 7, 9):
        with pytest.raises(BadRequest, match="rise strictly"):
            ns._client._call("get", ns="s", keys=keys(range(n)),
                             sort=np.array([2, 5, 8], "<u4").tobytes())
    assert _held(ns) == 0
    assert ns.get(keys(range(8)))[0].all()
