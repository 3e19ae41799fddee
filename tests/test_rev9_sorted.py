"""rev9: sorted gets (kvtier.api.sortedgets) against a real `kvtier serve`, refused requests
and the releases piggybacked on them.

The client piggybacks its queued releases on a request (``release_first``), and the service
ends them before the op whatever the op's own outcome (Server._dispatch_req: "the request
itself must still be answered"). lease_sorted puts them on a sorted get's last piece (or on
its first request, when it has one piece), so a refused sorted request must end them too.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvtier
from kvtier.errors import BadRequest
from tests.conftest import blocks, keys

BB = 4096


@pytest.fixture
def ns(service):
    with kvtier.Client(str(service.socket)) as c:
        yield c.namespace("s", block_bytes=BB)


def _held(ns) -> int:
    return ns._client._call("stats")["leases"]


REFUSED = [
    ({"of": 4242, "piece": 1}, "no sorted get"),                     # its head was refused
    ({"keys": keys(range(8)), "sort": np.array([4, 7], "<u4").tobytes()}, "rise strictly"),
    ({"keys": keys(range(8)), "sort": np.array([8], "<u4").tobytes(), "tier": "hbm"}, "host"),
    ({"of": "x", "piece": 1}, "integers"),
]


@pytest.mark.parametrize("args,says", REFUSED)
def test_a_refused_sorted_request_still_ends_the_releases_piggybacked_on_it(ns, args, says):
    ns.put(keys(range(8)), blocks(8, BB))
    c = ns._client
    lease = c._call("get", ns="s", keys=keys(range(8)))["lease"]
    assert _held(ns) == 1
    c._pending.append(lease)                  # a release queued, as GetReply.release queues it
    with pytest.raises(BadRequest, match=says):
        c._call("get", ns="s", **args)         # carries release_first
    assert c._pending == []
    assert _held(ns) == 0                     # the piggybacked lease ended all the same


class _Lying:
    """A client whose replies carry a damaged order (a service bug, which cannot be produced
    for real: the one stand-in of this file). Each reply is a real service's, its order
    replaced."""

    def __init__(self, real, order):
        self.real, self.order = real, order

    def _send(self, op, args, piggyback=True):
        return self.real._send(op, args, piggyback)

    def _reply(self, rid):
        r = self.real._reply(rid)
        r["order"] = self.order(r)
        return r


@pytest.mark.parametrize("order", [
    lambda r: r["order"][:-1],                 # not a whole number of positions
    lambda r: [0, 1, 2],                       # not bytes
    lambda r: None,
])
def test_an_order_that_is_not_an_array_is_a_protocol_error_and_every_reply_is_read(ns, order):
    from kvtier.api import pipeline
    from kvtier.errors import ProtocolError
    ns.put(keys(range(32)), blocks(32, BB))
    real = ns._client
    ns._client = _Lying(real, order)
    got = []
    try:
        found, leases, error, _moved = pipeline.lease_sorted(
            ns, keys(range(32)), 32, lambda rep, at: got.append(at), None, 8)
    finally:
        ns._client = real
    assert isinstance(error, ProtocolError)
    assert len(leases) == 5                   # every reply read, its lease known
    assert got == [] and not found.any()
    for lid in leases:
        real._call("release", lease=lid)
    assert _held(ns) == 0


def test_a_refused_sorted_request_ends_its_releases_once_the_engine_lock_is_free(tmp_path):
    # In process (Server._dispatch_req, a real engine): with the engine lock held by another
    # thread the piggybacked releases cannot end inline, so the refusal comes back as an
    # awaitable that ends them on the memory lane and then answers the error.
    import asyncio
    import inspect
    import struct
    import threading
    from kvtier.api.quota import ClientInfo
    from kvtier.api.server import Server
    from kvtier.coherence.engine import Engine
    from kvtier.config import make_settings
    eng = Engine(make_settings({"data_dir": str(tmp_path), "host_capacity": "1MiB"}))
    srv = Server(eng, eng.settings)
    cl = ClientInfo(1, 0, 0)
    try:
        eng.create_namespace("m", BB)
        eng.put("m", keys(range(8)), blocks(8, BB))
        lease = srv.op_get(cl, {"ns": "m", "keys": keys(range(8))})["lease"]
        assert len(eng.leases) == 1
        taken, go = threading.Event(), threading.Event()

        def hold():
            with eng.lock:
                taken.set()
                go.wait(10)
        t = threading.Thread(target=hold)
        t.start()
        taken.wait(10)
        out = srv._dispatch_req(cl, {"ns": "m", "of": 4242, "piece": 1,
                                     "release_first": struct.pack("<Q", lease)}, 7, "get")
        go.set()
        t.join()
        assert inspect.isawaitable(out)

        async def answer():
            return await out
        body, _fd, _op = asyncio.run(answer())
        assert not body["ok"] and "no sorted get" in body["error"]["message"]
        assert len(eng.leases) == 0
    finally:
        srv._pool.shutdown(wait=True)
        srv._mem_pool.shutdown(wait=True)
        eng.close(flush=False)


class _Longer:
    """A client whose get replies carry one block more than the chunk asked (a service bug,
    which cannot be produced for real: a stand-in, as _Lying). The extra block is a copy of
    the reply's first, so it would land in the next chunk's first row."""

    def __init__(self, real):
        self.real = real

    def _send(self, op, args, piggyback=True):
        return self.real._send(op, args, piggyback)

    def _reply(self, rid):
        r = self.real._reply(rid)
        for f, w in (("found", 1), ("slots", 4), ("versions", 8), ("checksums", 8)):
            r[f] = r[f] + r[f][:w]
        return r


def test_a_chunk_reply_of_another_size_than_its_chunk_is_a_protocol_error(ns):
    # pipeline.lease: before the shared reply loop (_read_replies) found[lo:hi] = rep.found
    # raised for it (a ValueError out of the loop, the later replies unread); since, it was
    # taken as it came, a block moved into the next chunk's first row.
    from kvtier.api import pipeline
    from kvtier.errors import ProtocolError
    ns.put(keys(range(32)), blocks(32, BB))
    real = ns._client
    ns._client = _Longer(real)
    got = []
    try:
        found, leases, error, _moved = pipeline.lease(
            ns, keys(range(32)), 32, lambda rep, lo: got.append(lo), None, 8)
    finally:
        ns._client = real
    assert isinstance(error, ProtocolError)
    assert len(leases) == 5                   # every reply read, its lease known
    assert got == [] and not found.any()
    for lid in leases:
        real._call("release", lease=lid)
    assert _held(ns) == 0


def test_a_sorted_piece_whose_slots_outnumber_its_found_is_a_protocol_error(ns):
    # The GPU move takes every slot of a reply whose blocks were all found (transfer.py's
    # _launch: slots against the rows of its positions): more slots than positions would
    # move blocks to rows that are not theirs.
    from kvtier.api import pipeline
    from kvtier.errors import ProtocolError

    class _MoreSlots(_Longer):
        def _reply(self, rid):
            r = self.real._reply(rid)
            r["slots"] = r["slots"] + r["slots"][:4]
            return r
    ns.put(keys(range(32)), blocks(32, BB))
    real = ns._client
    ns._client = _MoreSlots(real)
    got = []
    try:
        found, leases, error, _moved = pipeline.lease_sorted(
            ns, keys(range(32)), 32, lambda rep, at: got.append(at), None, 8)
    finally:
        ns._client = real
    assert isinstance(error, ProtocolError)
    assert len(leases) == 5 and got == [] and not found.any()
    for lid in leases:
        real._call("release", lease=lid)
    assert _held(ns) == 0


@pytest.mark.parametrize("sorted_", [False, True], ids=["chunked", "sorted"])
def test_a_reply_that_does_not_decode_is_a_protocol_error_and_every_reply_is_read(ns, sorted_):
    # GetReply.decode's KeyError / ValueError escaped the shared reply loop (_read_replies)
    # with the later replies, and their leases, unread. A service bug: a stand-in, as above.
    from kvtier.api import pipeline
    from kvtier.errors import ProtocolError

    class _Broken(_Longer):
        n = 0

        def _reply(self, rid):
            r = self.real._reply(rid)
            self.n += 1
            if self.n == 2:
                del r["versions"]
            return r
    ns.put(keys(range(32)), blocks(32, BB))
    real = ns._client
    ns._client = _Broken(real)
    got = []
    try:
        fn = pipeline.lease_sorted if sorted_ else pipeline.lease
        found, leases, error, _moved = fn(ns, keys(range(32)), 32,
                                          lambda rep, at: got.append(at), None, 8)
    finally:
        ns._client = real
    assert isinstance(error, ProtocolError)
    assert len(leases) == 5                   # the broken reply's lease too
    assert len(got) == 1                      # the first chunk, before the broken reply
    for lid in leases:
        real._call("release", lease=lid)
    assert _held(ns) == 0
