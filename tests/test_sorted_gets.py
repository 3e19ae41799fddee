"""Gets leased in the service's slot order, piece by piece (kvtier.api.sortedgets, the GPU
onboard's whole gets), against a real `kvtier serve`: the pieces' positions make a permutation
of the batch, each piece's slots are a dense ascending range where the batch was put together,
every leased slot holds its own key's bytes (also when keys were rewritten or left for NVMe
between the order and the pieces), the leases end, and every malformed request is refused
with a one-line error while the connection goes on."""

from __future__ import annotations

import numpy as np
import pytest

import kvtier
from kvtier.api import pipeline
from kvtier.errors import BadRequest, ProtocolError
from tests.conftest import blocks, keys

BB = 4096


@pytest.fixture
def ns(service):
    with kvtier.Client(str(service.socket)) as c:
        yield c.namespace("s", block_bytes=BB)


def _sorted(ns, ids, size):
    """lease_sorted of keys(ids): (found, leases, error, [(reply, positions)])."""
    got = []

    def on_reply(rep, at):
        got.append((rep, np.arange(rep.found.size) if type(at) is int else at.copy()))
    found, leases, error, _moved = pipeline.lease_sorted(ns, keys(ids), len(ids), on_reply,
                                                         None, size)
    return found, leases, error, got


def _release(ns, leases):
    for lid in leases:
        ns._client._call("release", lease=lid)


def _held(ns) -> int:
    return ns._client._call("stats")["leases"]


def test_pieces_are_dense_slot_ranges_whose_slots_hold_their_keys(ns):
    data = blocks(512, BB)
    ns.put(keys(range(512)), data)
    ids = np.random.default_rng(1).permutation(512)
    found, leases, error, got = _sorted(ns, ids.tolist(), 128)
    assert error is None and found.all()
    assert [at.size for _rep, at in got] == [32, 128, 128, 128, 96]     # pipeline.chunks
    at_all = np.concatenate([at for _rep, at in got])
    assert sorted(at_all.tolist()) == list(range(512))
    assert (got[0][1] == np.arange(32)).all()     # piece 0: the first keys, in their order
    view = ns._view()
    slots_all = []
    for k, (rep, at) in enumerate(got):
        s = rep.slots.astype(np.int64)
        assert (view[s] == data[ids[at]]).all()    # each slot holds its own key's block
        if k:
            # Ascending, and dense as stage_sorted asks (piece 0's keys leave holes).
            assert (np.diff(s) > 0).all() and s[-1] - s[0] + 1 <= s.size * 5 // 4 + 8
            slots_all.append(s)
    s = np.concatenate(slots_all)
    assert (np.diff(s) > 0).all()                  # the pieces follow one another in slot order
    _release(ns, leases)
    assert _held(ns) == 0


def test_misses_and_nvme_blocks_come_last_and_right(tmp_path):
    from tests.service import Service
    svc = Service(tmp_path / "svc", host_capacity="256KiB", nvme_capacity="16MiB",
                  segment_bytes="1MiB").start()
    try:
        with kvtier.Client(str(svc.socket)) as c:
            ns = c.namespace("s", block_bytes=BB)
            data = blocks(160, BB)
            for lo in range(0, 160, 32):             # 640 KiB through a 256 KiB host tier
                ns.put(keys(range(lo, lo + 32)), data[lo:lo + 32])
            c._call("flush")
            ids = list(range(0, 160, 5)) + [10_000, 10_001]    # two never stored
            found, leases, error, got = _sorted(ns, ids, 16)
            assert error is None
            want = np.array([i < 160 for i in ids])
            assert (found == want).all()
            view = ns._view()
            for rep, at in got:
                hit = np.flatnonzero(rep.found)
                assert (view[rep.slots[hit].astype(np.int64)] ==
                        data[np.array(ids)[at[hit]]]).all()
            last = got[-1][1]
            assert {len(ids) - 2, len(ids) - 1} <= set(last.tolist())   # misses last
            _release(ns, leases)
    finally:
        svc.stop()


def test_a_key_rewritten_between_the_order_and_its_piece_is_served_as_it_is_then(service):
    with kvtier.Client(str(service.socket)) as c, kvtier.Client(str(service.socket)) as other:
        ns = c.namespace("s", block_bytes=BB)
        ns2 = other.namespace("s")
        data = blocks(64, BB)
        ns.put(keys(range(64)), data)
        # The first request alone (piece 0 answered), then a rewrite, then the later piece
        # (the order is taken at it: the rewritten keys' new slots).
        head = c._send("get", {"ns": "s", "keys": keys(range(64)),
                               "sort": np.array([16, 64], "<u4").tobytes()})
        first = c._reply(head)
        new = blocks(64, BB, seed=9)
        ns2.put(keys(range(64)), new)
        rest = c._reply(c._send("get", {"ns": "s", "of": head, "piece": 1}))
        view = ns._view()
        for r, want in ((first, data), (rest, new)):
            at = np.frombuffer(r["order"], "<u4")
            slots = np.frombuffer(r["slots"], "<i4").astype(np.int64)
            assert (view[slots] == want[at]).all()
        assert sorted(np.frombuffer(first["order"], "<u4").tolist() +
                      np.frombuffer(rest["order"], "<u4").tolist()) == list(range(64))
        _release(ns, [first["lease"], rest["lease"]])


BAD = [
    ({"keys": keys(range(8)), "sort": np.array([4, 7], "<u4").tobytes()}, "rise strictly"),
    ({"keys": keys(range(8)), "sort": np.array([0, 8], "<u4").tobytes()}, "rise strictly"),
    ({"keys": keys(range(8)), "sort": np.array([6, 4, 8], "<u4").tobytes()}, "rise strictly"),
    ({"keys": keys(range(8)), "sort": b""}, "rise strictly"),
    ({"keys": keys(range(8)), "sort": b"\x01\x02\x03"}, "whole number"),
    ({"keys": keys(range(8)), "sort": "x"}, "sort"),
    ({"keys": keys(range(8)), "sort": np.array([8], "<u4").tobytes(), "piece": 1}, "no 'piece'"),
    ({"keys": keys(range(8)), "sort": np.array([8], "<u4").tobytes(), "tier": "hbm"}, "host"),
    ({"keys": keys(range(8)), "sort": np.array([8], "<u4").tobytes(), "inline": True}, "inline"),
    ({"keys": b"\x01" * 7, "sort": np.array([1], "<u4").tobytes()}, "multiple"),
    ({"of": 123456, "piece": 1}, "no sorted get"),
    ({"of": "x", "piece": 1}, "integers"),
    ({"of": 1, "piece": None}, "integers"),
    ({"of": 1, "piece": 1, "keys": keys(range(2))}, "no keys"),
]


@pytest.mark.parametrize("args,says", BAD)
def test_malformed_sorted_gets_are_refused_and_the_connection_goes_on(ns, args, says):
    ns.put(keys(range(8)), blocks(8, BB))
    with pytest.raises(BadRequest, match=says) as err:
        ns._client._call("get", ns="s", **args)
    assert "\n" not in str(err.value)
    assert _held(ns) == 0
    found, _out = ns.get(keys(range(8)))
    assert found.all()


def test_pieces_must_come_in_order_of_the_same_namespace(ns):
    ns.put(keys(range(8)), blocks(8, BB))
    c = ns._client
    ends = np.array([2, 4, 8], "<u4").tobytes()
    head = c._send("get", {"ns": "s", "keys": keys(range(8)), "sort": ends})
    _release(ns, [c._reply(head)["lease"]])
    with pytest.raises(BadRequest, match="piece 2 .* where piece 1"):
        c._call("get", ns="s", of=head, piece=2)
    with pytest.raises(BadRequest, match="no sorted get"):      # a wrong piece ended it
        c._call("get", ns="s", of=head, piece=1)
    head = c._send("get", {"ns": "s", "keys": keys(range(8)), "sort": ends})
    _release(ns, [c._reply(head)["lease"]])
    with pytest.raises(BadRequest, match="of 'other'"):
        c._call("get", ns="other", of=head, piece=1)
    assert _held(ns) == 0


def test_a_connection_holds_at_most_max_sorted_gets(ns):
    from kvtier.api.sortedgets import MAX_SORTED
    ns.put(keys(range(8)), blocks(8, BB))
    c = ns._client
    ends = np.array([4, 8], "<u4").tobytes()
    heads = []
    for _ in range(MAX_SORTED):
        heads.append(c._send("get", {"ns": "s", "keys": keys(range(8)), "sort": ends}))
        _release(ns, [c._reply(heads[-1])["lease"]])
    with pytest.raises(BadRequest, match="in flight"):
        c._call("get", ns="s", keys=keys(range(8)), sort=ends)
    for h in heads:                       # their last pieces end them: room again
        _release(ns, [c._call("get", ns="s", of=h, piece=1)["lease"]])
    _release(ns, [c._call("get", ns="s", keys=keys(range(8)), sort=ends)["lease"]])
    assert _held(ns) == 0


class _Lying:
    """A client whose replies carry wrong positions (a service bug, which cannot be produced
    for real: the one stand-in of this file). Each reply is a real service's reply with its
    order replaced."""

    def __init__(self, real, order):
        self.real, self.order, self.n = real, order, 0

    def _send(self, op, args, piggyback=True):
        return self.real._send(op, args, piggyback)

    def _reply(self, rid):
        r = self.real._reply(rid)
        r["order"] = self.order(self.n, r)
        self.n += 1
        return r


@pytest.mark.parametrize("order", [
    lambda i, r: np.zeros(len(r["found"]), "<u4").tobytes(),          # repeated positions
    lambda i, r: np.full(len(r["found"]), 999, "<u4").tobytes(),      # outside the batch
    lambda i, r: r["order"][:-4],                                      # one short
    lambda i, r: b"",                                                  # none
])
def test_positions_that_are_not_a_permutation_fail_loudly_and_move_nothing_of_them(ns, order):
    ns.put(keys(range(32)), blocks(32, BB))
    real = ns._client
    ns._client = _Lying(real, order)
    try:
        found, leases, error, got = _sorted(ns, list(range(32)), 8)
    finally:
        ns._client = real
    assert isinstance(error, ProtocolError)
    assert len(leases) == 5              # every reply read, its lease known
    assert got == [] and not found.any()     # nothing of a bad piece moved, nor after it
    _release(ns, leases)
    assert _held(ns) == 0
