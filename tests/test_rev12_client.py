"""rev12's review of Client._reply's read-past replies (session 36, the lead's orphan change),
against a real `kvtier serve`.

The client reads past an earlier request's reply while it waits for a later one. That reply
is not always a caller's bug: a CUDA put (kvtier.gpu.transfer.PutTransfer) sends its chunks'
commits as their copies complete (early_commits, or the namespace's next CUDA call's poll)
and reads their replies only at done()/wait(), so any call made meanwhile reads them first.
Such a reply must reach its reader when it asks; a reply whose hold was given back (a lease,
a reservation) must never reach a late reader as if it still held its slots; and a mapped
open's fd, which comes with its reply, must not be handed to the next namespace's mapping.

The tests use the client's private _send/_reply as PutTransfer does (the CUDA path cannot run
on this machine: the same sequence through put_async is the gpu-marked test at the end)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvtier
from kvtier.api import protocol as P
from kvtier.api.buffers import checksums
from kvtier.errors import ChecksumError, KvtierError, ServiceUnavailable
from tests.conftest import blocks, keys, wait_for

BB = 4096
QUICK = 3.0          # the client's reply timeout here: main waits it out, then drops the link


def _state(pid: int) -> str:
    """A process's state letter (/proc/PID/stat: T once it is stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _reserve_and_write(ns, ids, data) -> int:
    c = ns._client
    r = c._call("reserve", ns=ns.name, keys=keys(ids))
    ns._write(np.frombuffer(r["slots"], "<i4"), data)
    return int(r["rid"])


def test_a_commit_reply_read_past_by_another_call_reaches_its_later_reader(service):
    # PutTransfer's pattern: the commit goes out, another call is made on the connection
    # (a get, stats, another put's reserves), and only then is the commit's reply read.
    # On main the other call read it as an orphan and dropped it; the reader then waited for
    # a reply that had come already: the client's timeout, then the connection closed and
    # the put, stored, reported as of unknown outcome.
    with kvtier.Client(str(service.socket), timeout=QUICK) as c:
        ns = c.namespace("late", block_bytes=BB)
        data = blocks(4, BB, seed=3)
        rid = _reserve_and_write(ns, range(4), data)
        cid = c._send("commit", {"rid": rid, "checksums": P.arr(checksums(data), "<u8")})
        assert c.stats()["reservations"] == 0            # the other call, answered
        t0 = time.monotonic()
        reply = c._reply(cid)
        assert time.monotonic() - t0 < 1.0
        assert np.frombuffer(reply["versions"], "<u8").tolist() == [1] * 4
        assert c._sock is not None                        # the connection is still up
        out = np.zeros_like(data)
        assert ns.get(keys(range(4)), out=out)[0].all() and np.array_equal(out, data)


def test_a_refused_commit_read_past_raises_at_its_later_reader(service):
    # The same with a commit the service refuses (checksums of other bytes): its reader gets
    # the refusal, not a hang, and nothing was stored.
    with kvtier.Client(str(service.socket), timeout=QUICK) as c:
        ns = c.namespace("late2", block_bytes=BB)
        data = blocks(2, BB, seed=4)
        rid = _reserve_and_write(ns, range(2), data)
        wrong = P.arr(checksums(blocks(2, BB, seed=5)), "<u8")
        cid = c._send("commit", {"rid": rid, "checksums": wrong})
        c.stats()
        t0 = time.monotonic()
        with pytest.raises(ChecksumError):
            c._reply(cid)
        assert time.monotonic() - t0 < 1.0
        assert not ns.get(keys(range(2)))[0].any()
        assert c._sock is not None


def test_a_get_reply_whose_lease_was_given_back_never_reaches_a_late_reader(service):
    # A get's reply read past: its lease is released at once (the orphan change). Were the
    # reply handed to a reader later, it would read slots the service may have reused (a
    # wrong block). Its reader gets an error at once, the connection stays up.
    with kvtier.Client(str(service.socket), timeout=QUICK) as c:
        ns = c.namespace("late3", block_bytes=BB)
        ns.put(keys(range(3)), blocks(3, BB))
        gid = c._send("get", {"ns": ns.name, "keys": keys(range(3))})
        c.stats()
        t0 = time.monotonic()
        with pytest.raises(KvtierError) as err:
            c._reply(gid)
        assert not isinstance(err.value, ServiceUnavailable)
        assert "given back" in str(err.value)
        assert time.monotonic() - t0 < 1.0
        assert c._sock is not None
        assert c.stats()["leases"] == 0


def test_an_unread_mapped_open_does_not_hand_its_fd_to_the_next_namespace(service):
    # ns_open with map=True passes the namespace's memory fd with its reply. Read past, the
    # reply left its fd first in the client's queue of fds, and the next namespace mapped it
    # as its own: its writes went into the first namespace's slots (a stored block replaced
    # under its checksum: a wrong block served) and its reads read the first one's blocks.
    with kvtier.Client(str(service.socket), timeout=QUICK) as c:
        first = c.namespace("fd-a", block_bytes=BB)
        kept = blocks(1, BB, seed=7)
        first.put(keys([0]), kept)
        c._send("ns_open", {"name": "fd-a", "map": True})    # its reply left unread
        second = c.namespace("fd-b", block_bytes=BB)         # reads it past
        mine = blocks(1, BB, seed=8)
        second.put(keys([0]), mine)
        out = np.zeros((1, BB), np.uint8)
        assert second.get(keys([0]), out=out, verify=True)[0].all()
        assert np.array_equal(out, mine)
        assert first.get(keys([0]), out=out, verify=True)[0].all()
        assert np.array_equal(out, kept)
        assert not c._fds                                    # none left for a later open


def test_the_orphaned_ns_open_fd_is_closed(service):
    with kvtier.Client(str(service.socket), timeout=QUICK) as c:
        c.namespace("fd-c", block_bytes=BB)
        c._send("ns_open", {"name": "fd-c", "map": True})
        c.stats()
        assert c.orphaned_replies == 1 and not c._fds


def test_replies_never_asked_for_are_kept_only_up_to_the_bound(service, monkeypatch, caplog):
    # A caller that leaves replies unread for ever (a bug) keeps at most READ_PAST_KEEP of
    # them; the oldest go, logged, and a late reader of a dropped one is not answered by
    # another's reply.
    from kvtier.api import client as client_mod
    monkeypatch.setattr(client_mod, "READ_PAST_KEEP", 2)
    with kvtier.Client(str(service.socket), timeout=QUICK) as c:
        ids = [c._send("stats", {}) for _ in range(3)]
        c.ping()
        assert c.orphaned_replies == 3 and sorted(c._read_past) == ids[1:]
        assert any("never asked for" in r.message for r in caplog.records)
        assert "tiers" in c._reply(ids[2])
        assert list(c._read_past) == [ids[1]]


def test_a_late_reader_after_the_connection_went_gets_its_reply_or_a_lost_connection(
        tmp_path):
    # A CUDA put in flight when its service goes: its commits' replies are read by wait().
    # One read past before the loss is still the commit's outcome (stored: its versions); one
    # never answered is PutOutcomeUnknown; any other reader gets ServiceUnavailable. On main
    # each was an AttributeError (the reader read a socket that was gone).
    import signal

    from kvtier.errors import PutOutcomeUnknown
    from tests.service import Service
    svc = Service(tmp_path / "svc", host_capacity="8MiB").start()
    try:
        with kvtier.Client(str(svc.socket), timeout=QUICK) as c:
            ns = c.namespace("gone", block_bytes=BB)
            data = blocks(4, BB, seed=9)
            rid = _reserve_and_write(ns, range(2), data[:2])
            answered = c._send("commit", {"rid": rid,
                                          "checksums": P.arr(checksums(data[:2]), "<u8")})
            c.ping()                                       # reads the commit's reply past
            rid = _reserve_and_write(ns, range(2, 4), data[2:])
            svc.proc.send_signal(signal.SIGSTOP)          # nothing more is answered
            assert wait_for(lambda: _state(svc.proc.pid) == "T")
            stats = c._send("stats", {})
            unanswered = c._send("commit", {"rid": rid,
                                            "checksums": P.arr(checksums(data[2:]), "<u8")})
            svc.proc.kill()
            svc.proc.wait()
            with pytest.raises(ServiceUnavailable):
                c._reply(stats)
            assert c._sock is None
            assert np.frombuffer(c._reply(answered)["versions"], "<u8").tolist() == [1, 1]
            with pytest.raises(PutOutcomeUnknown):
                c._reply(unanswered)
            with pytest.raises(ServiceUnavailable):
                c._reply(stats)
            assert not c._read_past
    finally:
        svc.stop(signal.SIGKILL)                          # (stopped or gone already)
