"""rev11's review of session 35's put credits (kvtier.api.credits), against a real `kvtier
serve`: what a credit holds must go back on every path, and what a connection holds must be
counted as what the service still holds for it (the connection's share, kvtier.api.quota)."""

from __future__ import annotations


import numpy as np
import pytest

import kvtier
from kvtier.api import credits as cr
from kvtier.errors import CapacityError, LeaseError
from tests.conftest import blocks, keys, wait_for

BB = 4096
HOST_SLOTS = 8 * 2**20 // BB                 # the services' host tier: 8 MiB


def _stats(c) -> dict:
    return c._call("stats")


@pytest.fixture
def short_lived(tmp_path):
    """A service whose reservations and leases expire after 0.3 s."""
    from tests.service import Service
    svc = Service(tmp_path / "short", host_capacity="8MiB", reserve_timeout="0.3",
                  lease_timeout="0.3").start()
    yield svc
    svc.stop()


def test_closing_a_namespace_gives_back_a_credit_asked_but_not_read_yet(service):
    # A put with credits on asks for the next put's credit as it completes (PutTransfer.
    # _complete), and closing the handle drains its puts first: the ask is then always in
    # flight, its reply unread. Before rev11 close() dropped only a held credit, and the
    # asked one stayed reserved (an eighth of the host slots, pinned, counted in the
    # connection's share) until reserve_timeout, 30 s by default.
    with kvtier.Client(str(service.socket)) as c:
        ns = c.namespace("c", block_bytes=BB)
        ns._credits = cr.Credits(ns)
        ns._credits.ask()                    # sent; its reply not read
        ns.close()
        assert _stats(c)["reservations"] == 0
        assert c.ping() > 0                  # no reply left over for a later call


def test_handles_closed_after_their_asks_do_not_fill_the_connections_share(service):
    # Each handle's asked credit is an eighth of the host slots: before rev11, six handles
    # opened, asked and closed within reserve_timeout held 6/8 of the slots, past the share
    # (0.75), and the connection's next put was refused.
    with kvtier.Client(str(service.socket)) as c:
        for _ in range(7):
            ns = c.namespace("c", block_bytes=BB)
            ns._credits = cr.Credits(ns)
            ns._credits.ask()
            ns.close()
        ns = c.namespace("c", block_bytes=BB)
        ns.put(keys(range(4)), blocks(4, BB, seed=1))
        assert ns.get(keys(range(4)))[0].all()
        assert _stats(c)["reservations"] == 0


def test_an_expired_credit_no_longer_counts_in_the_connections_share(short_lived):
    # The service reclaims a credit at reserve_timeout; the connection's count of what it
    # holds (Pins) kept it until the writer sent that rid again, so an idle writer's expired
    # credit refused its next reservations (CapacityError naming max_client_share) although
    # the service held nothing of it.
    with kvtier.Client(str(short_lived.socket)) as c:
        ns = c.namespace("c", block_bytes=BB)
        c._call("reserve", ns="c", count=int(0.75 * HOST_SLOTS) - 8)
        assert wait_for(lambda: _stats(c)["expired_reservations"] == 1)
        assert _stats(c)["reservations"] == 0
        r = c._call("reserve", ns="c", count=64)          # within the share: nothing is held
        c._call("abort", rid=r["rid"])
        ns.put(keys(range(64)), blocks(64, BB, seed=2))
        assert ns.get(keys(range(64)))[0].all()


def test_an_expired_lease_no_longer_counts_in_the_connections_share(short_lived):
    # The same for a get's lease reclaimed at lease_timeout.
    with kvtier.Client(str(short_lived.socket)) as c:
        ns = c.namespace("c", block_bytes=BB)
        n = int(0.75 * HOST_SLOTS) - 8
        ns.put(keys(range(n)), blocks(n, BB, seed=3))
        got = c._call("get", ns="c", keys=keys(range(n)))      # leased, never released
        assert np.frombuffer(got["found"], np.bool_).all()
        assert wait_for(lambda: _stats(c)["expired_leases"] >= 1)
        r = c._call("reserve", ns="c", count=64)
        c._call("abort", rid=r["rid"])


def test_a_live_credit_still_counts_in_the_share(service):
    # The share's count is pruned of ended holds only: one still held is counted.
    with kvtier.Client(str(service.socket)) as c:
        c.namespace("c", block_bytes=BB)
        held = c._call("reserve", ns="c", count=int(0.75 * HOST_SLOTS) - 8)
        with pytest.raises(CapacityError, match="max_client_share"):
            c._call("reserve", ns="c", count=16)
        c._call("abort", rid=held["rid"])
        r = c._call("reserve", ns="c", count=16)
        c._call("abort", rid=r["rid"])
        with pytest.raises(LeaseError):
            c._call("abort", rid=held["rid"])


def test_a_foreign_error_read_before_the_credits_reply_does_not_orphan_it(service):
    # Reading the asked credit's reply now (take or drop with wait) reads the replies before
    # it as the client reads them; an error reply of an earlier request nobody waits for
    # raised out of that read, and Credits took it for a lost connection: the credit's
    # reply, no longer stashed, later broke an unrelated call ("reply for request N while
    # waiting for M") and the credit stayed reserved until reserve_timeout.
    with kvtier.Client(str(service.socket)) as c:
        ns = c.namespace("c", block_bytes=BB)
        credits = cr.Credits(ns)
        c._send("abort", {"rid": 10**9})     # its reply (LeaseError) read by no one
        credits.ask()
        credits.drop(wait=True)
        assert c.ping() > 0
        assert _stats(c)["reservations"] == 0
        c._send("abort", {"rid": 10**9})
        credits.ask()
        got = credits.take(wait=True)
        assert got is not None and got.slots.size == credits.size()
        c._call("abort", rid=got.rid)
        assert _stats(c)["reservations"] == 0
