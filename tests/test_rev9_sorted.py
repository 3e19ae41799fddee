"""rev9: sorted gets (kvtier.api.sortedgets) against a real `kvtier serve`, refused requests
and the releases piggybacked on them.

The client piggybacks its queued releases on a request (``release_first``), and the service
ends them before the op whatever the op's own outcome (Server._dispatch_req: "the request
itself must still be answered"). lease_sorted puts them on a sorted get's last piece (or on
its first request, when it has one piece), so a refused sorted request must end them too.
"""

from __future__ import annotations

import contextlib
import threading

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


class _Rewriting:
    """A client whose get replies are a real service's, rewritten by rewrite(reply, i) (i:
    the reply's rank): a service bug, which cannot be produced for real, the one stand-in of
    this file (as test_sorted_gets.py's _Lying)."""

    def __init__(self, real, rewrite):
        self.real, self.rewrite, self.n = real, rewrite, 0

    def _send(self, op, args, piggyback=True):
        return self.real._send(op, args, piggyback)

    def _reply(self, rid):
        r = self.real._reply(rid)
        self.rewrite(r, self.n)
        self.n += 1
        return r


def _lease_rewritten(ns, rewrite, sorted_: bool):
    """lease_sorted (or lease) of 32 stored keys in pieces (chunks) of 8 through a _Rewriting
    client: (its error, its leases, the positions on_reply was called with). Every lease it
    returns is then ended, and none may stay held."""
    from kvtier.api import pipeline
    ns.put(keys(range(32)), blocks(32, BB))
    real = ns._client
    ns._client = _Rewriting(real, rewrite)
    got = []
    try:
        fn = pipeline.lease_sorted if sorted_ else pipeline.lease
        found, leases, error, _moved = fn(ns, keys(range(32)), 32,
                                          lambda rep, at: got.append(at), None, 8)
    finally:
        ns._client = real
    for lid in leases:
        real._call("release", lease=lid)
    assert _held(ns) == 0
    return error, leases, got, found


def _set(field, value):
    def rewrite(r, _i):
        r[field] = value(r)
    return rewrite


def _longer(r, _i):
    # One block more than asked: a copy of the reply's first, which would land in the next
    # chunk's first row.
    for f, w in (("found", 1), ("slots", 4), ("versions", 8), ("checksums", 8)):
        r[f] = r[f] + r[f][:w]


def _second_without_versions(r, i):
    if i == 1:
        del r["versions"]


@pytest.mark.parametrize("rewrite,sorted_,moved", [
    # lease_sorted's positions: anything but whole "<u4" bytes raised out of the reply loop.
    (_set("order", lambda r: r["order"][:-1]), True, 0),
    (_set("order", lambda r: [0, 1, 2]), True, 0),
    (_set("order", lambda r: None), True, 0),
    # A piece with more slots than positions (the GPU move takes every slot of an all-found
    # reply against the rows of its positions).
    (_set("slots", lambda r: r["slots"] + r["slots"][:4]), True, 0),
    # pipeline.lease: before the shared reply loop found[lo:hi] = rep.found raised for a reply
    # of another size than its chunk (out of the loop); since, it was taken as it came.
    (_longer, False, 0),
    # A reply that does not decode (GetReply.decode's KeyError), both gets: the first chunk
    # moved before it.
    (_second_without_versions, False, 1),
    (_second_without_versions, True, 1),
], ids=["order-3-bytes", "order-list", "order-none", "more-slots", "chunk-longer",
        "undecodable-chunked", "undecodable-sorted"])
def test_a_reply_that_cannot_be_placed_is_a_protocol_error_and_every_reply_is_read(
        ns, rewrite, sorted_, moved):
    from kvtier.errors import ProtocolError
    error, leases, got, found = _lease_rewritten(ns, rewrite, sorted_)
    assert isinstance(error, ProtocolError)
    assert len(leases) == 5                   # every reply read, its lease known (and ended)
    assert len(got) == moved                  # nothing of a bad reply moved, nor after it
    if not moved:
        assert not found.any()                # every reply was a bad one


@contextlib.contextmanager
def _held_elsewhere(lock):
    """lock taken by another thread for the with block."""
    taken, done = threading.Event(), threading.Event()
    holder = threading.Thread(target=lambda: (lock.acquire(), taken.set(), done.wait(10),
                                              lock.release()))
    holder.start()
    taken.wait(10)
    try:
        yield
    finally:
        done.set()
        holder.join()


def test_a_refused_sorted_request_ends_its_releases_once_the_engine_lock_is_free(tmp_path):
    # In process (Server._dispatch_req, a real engine): with the engine lock held by another
    # thread the piggybacked releases cannot end inline, so the refusal comes back as an
    # awaitable that ends them on the memory lane and then answers the error.
    import asyncio
    import inspect
    import struct
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
        with _held_elsewhere(eng.lock):
            out = srv._dispatch_req(cl, {"ns": "m", "of": 4242, "piece": 1,
                                         "release_first": struct.pack("<Q", lease)}, 7, "get")
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
