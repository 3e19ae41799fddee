"""Where the service sends a host get (Server.op_get, in process, a real engine on disk): a
resident batch is leased by try_get on the loop with no unlocked look at its keys first; one
that needs the disk goes to its steps; and with the engine lock taken, only a get that looks
resident waits for it on the loop."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvtier.api.quota import ClientInfo
from kvtier.api.server import Server
from kvtier.coherence.engine import Engine
from kvtier.config import make_settings
from kvtier.types import Tier
from tests.conftest import blocks, key, keys

BB = 4096


@pytest.fixture
def split(tmp_path: Path):
    """An engine whose namespace holds 24 blocks, 8 of them on NVMe only; its server, a client,
    the resident and the cold block ids, and the number of looks_resident calls so far."""
    eng = Engine(make_settings({"data_dir": str(tmp_path), "host_capacity": "1MiB",
                                "nvme_capacity": "16MiB"}))
    eng.create_namespace("m", BB)
    eng.put("m", keys(range(24)), blocks(24, BB))
    eng.flush()
    eng.evict(Tier.HOST, 8)
    resident = [i for i in range(24) if eng.entry("m", key(i))["copies"].get("host")]
    cold = [i for i in range(24) if i not in resident]
    assert len(resident) >= 8 and cold
    looks = []
    hint = eng.looks_resident

    def counted(*a):
        looks.append(a)
        return hint(*a)
    eng.looks_resident = counted          # bound per instance in Engine.__init__
    yield Server(eng, eng.settings), ClientInfo(1, 0, 0), resident, cold, looks
    eng.close(flush=False)


def _get(srv, cl, ids):
    return srv.op_get(cl, {"ns": "m", "keys": keys(ids)})


def test_a_resident_batch_is_leased_on_the_loop_without_the_unlocked_hint(split):
    srv, cl, resident, _cold, looks = split
    out = _get(srv, cl, resident[:8])
    assert isinstance(out, dict) and out["found"] == b"\x01" * 8      # answered at once
    assert looks == []                # before: looks_resident, then try_get looked them up again
    srv.engine.release(out["lease"], cl.cid)


def test_a_batch_that_needs_the_disk_goes_to_its_steps_and_leases_nothing(split):
    srv, cl, resident, cold, _looks = split
    leases = srv.engine.namespace("m").slots[Tier.HOST].leases.copy()
    out = _get(srv, cl, resident[:4] + cold[:2])
    try:
        assert out.cr_code.co_name == "_get_slow"
    finally:
        out.close()
    assert (srv.engine.namespace("m").slots[Tier.HOST].leases == leases).all()


@pytest.mark.parametrize("which", ["resident", "cold"])
def test_with_the_lock_taken_only_a_get_that_looks_resident_waits_for_it(split, which):
    srv, cl, resident, cold, looks = split
    held, done = threading.Event(), threading.Event()

    def hold():
        with srv.engine.lock:
            held.set()
            done.wait(10)
    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(10)
        out = _get(srv, cl, resident[:4] if which == "resident" else resident[:4] + cold[:1])
        try:
            assert out.cr_code.co_name == ("_get_waiting" if which == "resident"
                                           else "_get_slow")
        finally:
            out.close()
        assert len(looks) == 1        # the hint decides only here
    finally:
        done.set()
        t.join(10)


def test_only_another_connections_waiting_frame_defers_a_long_request(split):
    # A connection's own next frames cannot go before its request (its replies keep their
    # order), so they no longer defer it: a GPU put's chunks, sent together, had their first
    # reserve (which gates the first copy) deferred a poll in about half the puts (off7).
    # Real sockets in the server's real epoll.
    import socket
    srv, cl, resident, _cold, _looks = split

    class Conn:
        def __init__(self, sock):
            self.fd = -1
            self.transport = type("T", (), {"get_extra_info": lambda _s, _k: sock})()
    pairs = [socket.socketpair() for _ in range(2)]
    a, b = Conn(pairs[0][0]), Conn(pairs[1][0])
    try:
        srv._watch_frames(a)
        srv._watch_frames(b)
        assert a.fd == pairs[0][0].fileno() and b.fd == pairs[1][0].fileno()
        assert not srv._frames_waiting() and not srv._frames_waiting(a.fd)
        pairs[0][1].sendall(b"\x00" * 16)              # a frame waits in a's socket
        assert srv._frames_waiting()                    # for the step runner: any socket
        assert not srv._frames_waiting(a.fd)            # a's own: no reason to defer a
        assert srv._frames_waiting(b.fd)                # b's long request waits its turn
        from kvtier.api import protocol as P
        from kvtier.api.connection import Later
        body = P.pack({"id": 1, "op": "get", "ns": "m", "keys": keys(resident[:8])})[4:]
        out = srv._dispatch(cl, body, a.fd)
        assert not isinstance(out, Later) and out[0]["ok"]
        srv.engine.release(out[0]["lease"], cl.cid)
        assert isinstance(srv._dispatch(cl, body, b.fd), Later)
    finally:
        srv._unwatch_frames(a)
        srv._unwatch_frames(b)
        for s1, s2 in pairs:
            s1.close()
            s2.close()
