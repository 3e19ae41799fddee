"""Credits (kvtier.api.credits): host slots reserved by count before a put's keys are known,
committed with the keys of their first slots, against a real `kvtier serve`. A credit is a
reservation: its slots are fresh and invisible until the commit, the slots it does not use go
back at the commit, a commit that fails ends it, it counts in the connection's share, expires
after reserve_timeout and ends with its connection. Every malformed request is refused in one
line, with the connection going on and nothing held."""

from __future__ import annotations

import time

import numpy as np
import pytest
import xxhash

import kvtier
from kvtier.api import credits as cr
from kvtier.errors import BadRequest, CapacityError, LeaseError
from tests.conftest import blocks, key, keys

BB = 4096


@pytest.fixture
def client(service):
    with kvtier.Client(str(service.socket)) as c:
        yield c


@pytest.fixture
def ns(client):
    return client.namespace("c", block_bytes=BB)


def _stats(c) -> dict:
    return c._call("stats")


def _sums(data: np.ndarray) -> bytes:
    return np.array([xxhash.xxh3_64_intdigest(b) for b in data], "<u8").tobytes()


def _credit(ns, n: int) -> dict:
    return ns._client._call("reserve", ns=ns.name, count=n)


def test_a_credits_first_slots_take_the_keys_of_its_commit_and_the_rest_go_back(ns, client):
    before = _stats(client)["tiers"]["host"]
    r = _credit(ns, 16)
    slots = np.frombuffer(r["slots"], "<i4")
    assert slots.size == 16 and np.unique(slots).size == 16 and r["expires_s"] > 0
    assert _stats(client)["reservations"] == 1
    assert _stats(client)["tiers"]["host"]["blocks"] == before["blocks"] + 16
    data = blocks(10, BB, seed=3)
    ns._view()
    ns._write(slots[:10], data)
    v = client._call("commit", rid=r["rid"], keys=keys(range(10)), checksums=_sums(data))
    assert np.frombuffer(v["versions"], "<u8").min() > 0
    s = _stats(client)
    assert s["reservations"] == 0
    assert s["tiers"]["host"]["blocks"] == before["blocks"] + 10      # six went back
    found, got = ns.get(keys(range(10)))
    assert found.all() and (got == data).all()


def test_a_credit_commit_rewrites_and_keeps_parents(ns, client):
    ns.put(keys(range(4)), blocks(4, BB, seed=1))
    r = _credit(ns, 4)
    new = blocks(4, BB, seed=2)
    ns._view()
    ns._write(np.frombuffer(r["slots"], "<i4"), new)
    parents = b"".join([bytes(16), key(0), key(1), key(2)])
    client._call("commit", rid=r["rid"], keys=keys(range(4)), parents=parents,
                 checksums=_sums(new))
    found, got = ns.get(keys(range(4)))
    assert found.all() and (got == new).all()
    assert ns.match_prefix(keys(range(4))) == 4


def test_a_torn_credit_write_is_refused_and_nothing_of_it_is_seen(ns, client):
    r = _credit(ns, 2)
    data = blocks(2, BB, seed=4)
    ns._view()
    ns._write(np.frombuffer(r["slots"], "<i4"), data)
    wrong = np.frombuffer(_sums(data), "<u8").copy()
    wrong[1] ^= 1
    with pytest.raises(kvtier.errors.ChecksumError):
        client._call("commit", rid=r["rid"], keys=keys(range(2)), checksums=wrong.tobytes())
    found, _ = ns.get(keys(range(2)))
    assert not found.any() and _stats(client)["reservations"] == 0


@pytest.mark.parametrize("commit, why", [
    (lambda rid: {"rid": rid}, "credit"),                                   # no keys
    (lambda rid: {"rid": rid, "keys": keys(range(9))}, "9 keys for a credit of 8"),
    (lambda rid: {"rid": rid, "keys": b""}, "empty key batch"),
    (lambda rid: {"rid": rid, "keys": b"x" * 17}, ""),                       # not whole keys
    (lambda rid: {"rid": rid, "keys": keys(range(2)), "parents": keys(range(3))},
     "parents for 2 keys"),
    (lambda rid: {"rid": rid, "keys": bytes(16)}, "all-zero"),
    (lambda rid: {"rid": rid, "keys": 7}, "must be bytes"),
])
def test_a_bad_credit_commit_is_refused_in_one_line_and_ends_the_credit(ns, client, commit,
                                                                          why):
    before = _stats(client)["tiers"]["host"]["blocks"]
    r = _credit(ns, 8)
    with pytest.raises(kvtier.errors.KvtierError) as e:
        client._call("commit", **commit(r["rid"]))
    assert why.lower() in str(e.value).lower() and "\n" not in str(e.value)
    if "must be bytes" not in why:       # decoded: the commit ran, and ended the credit
        with pytest.raises(LeaseError):
            client._call("abort", rid=r["rid"])
    else:
        client._call("abort", rid=r["rid"])
    s = _stats(client)
    assert s["reservations"] == 0 and s["tiers"]["host"]["blocks"] == before
    assert client.ping() > 0


def test_keys_sent_to_a_reservation_that_has_its_own_are_refused(ns, client):
    r = client._call("reserve", ns=ns.name, keys=keys(range(2)))
    with pytest.raises(BadRequest, match="made for its keys"):
        client._call("commit", rid=r["rid"], keys=keys(range(2)))
    assert _stats(client)["reservations"] == 0
    assert not ns.get(keys(range(2)))[0].any()


@pytest.mark.parametrize("count", [0, -1, 4097, "8", 1.5, True, None, [1]])
def test_a_bad_count_is_refused_in_one_line_and_holds_nothing(ns, client, count):
    with pytest.raises(BadRequest) as e:
        client._call("reserve", ns=ns.name, count=count)
    assert "\n" not in str(e.value)
    assert _stats(client)["reservations"] == 0 and client.ping() > 0


def test_a_credit_of_hbm_slots_or_of_no_namespace_is_refused(ns, client):
    with pytest.raises(BadRequest, match="host slots"):
        client._call("reserve", ns=ns.name, count=4, tier="hbm")
    with pytest.raises(kvtier.errors.KvtierError, match="nope"):
        client._call("reserve", ns="nope", count=4)
    assert _stats(client)["reservations"] == 0


def test_credits_count_in_the_connections_share(ns, client):
    slots = 8 * 2**20 // BB                 # the service's host tier: 8 MiB
    held = _credit(ns, int(0.75 * slots) - 8)
    with pytest.raises(CapacityError, match="max_client_share"):
        _credit(ns, 16)
    client._call("abort", rid=held["rid"])
    assert _stats(client)["reservations"] == 0


def test_a_credit_ends_with_its_connection(service, ns):
    with kvtier.Client(str(service.socket)) as other:
        o = other.namespace("c")
        o._client._call("reserve", ns="c", count=32)
        assert _stats(ns._client)["reservations"] == 1
    deadline = time.monotonic() + 10
    while _stats(ns._client)["reservations"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _stats(ns._client)["reservations"] == 0


def test_an_expired_credit_is_not_committed(tmp_path):
    from tests.service import Service
    svc = Service(tmp_path / "short", host_capacity="8MiB", reserve_timeout="0.3").start()
    try:
        with kvtier.Client(str(svc.socket)) as c:
            ns = c.namespace("c", block_bytes=BB)
            r = _credit(ns, 4)
            assert r["expires_s"] == pytest.approx(0.3)
            deadline = time.monotonic() + 10
            while _stats(c)["expired_reservations"] == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            with pytest.raises(LeaseError):
                c._call("commit", rid=r["rid"], keys=keys(range(4)))
            assert not ns.get(keys(range(4)))[0].any()
    finally:
        svc.stop()


# ---------------------------------------------------------------- the client's side


def test_the_client_stashes_an_asked_credit_and_hands_it_over_once(ns, client):
    credits = cr.Credits(ns)
    assert credits.take() is None            # none asked yet
    credits.ask()
    credits.ask()                            # one asked at a time
    assert credits.take() is None            # asked, its reply not read yet
    client.ping()                            # a later reply read: the credit's is stashed
    got = credits.take()
    assert got is not None and got.slots.size == credits.size_for(BB)
    assert got.generation == client.generation and got.use_by > time.monotonic()
    assert credits.take() is None            # handed over once
    assert _stats(client)["reservations"] == 1
    client._call("abort", rid=got.rid)


def test_a_credit_of_an_earlier_connection_or_past_its_use_by_is_not_used(ns, client):
    credits = cr.Credits(ns)
    credits.ask()
    client.ping()
    credits._collect()
    credits._held.use_by = time.monotonic() - 1
    assert credits.take() is None            # past half its life: aborted
    client.ping()
    assert _stats(client)["reservations"] == 0
    credits.ask()
    client.ping()
    client.connect()                         # a new connection: the old one's credit ended
    ns._view()
    assert credits.take() is None
    assert _stats(client)["reservations"] == 0


def test_a_refused_ask_backs_off(ns, client, monkeypatch):
    monkeypatch.setattr(cr, "CREDIT_KEYS", 4096)
    monkeypatch.setattr(cr, "CREDIT_BYTES", 1 << 40)     # 2,048 slots: past the share
    credits = cr.Credits(ns)
    credits.ask()
    client.ping()
    assert credits.take() is None and credits._skip == cr.REFUSED_BACKOFF
    sent = client._next
    for _ in range(cr.REFUSED_BACKOFF):
        credits.ask()
    assert client._next == sent              # none asked while backing off
    credits.ask()
    assert client._next == sent + 1


def test_closing_the_namespace_gives_a_held_credit_back(service):
    with kvtier.Client(str(service.socket)) as c:
        ns = c.namespace("c", block_bytes=BB)
        ns._credits = cr.Credits(ns)
        ns._credits.ask()
        c.ping()
        ns.close()
        c.ping()
        assert _stats(c)["reservations"] == 0
