"""A reply no caller waits for (a request sent and its reply left unread: a bug in a caller)
against a real `kvtier serve`: the client reads past it, gives back what it holds (a lease, a
reservation) at once rather than at its timeout, counts and logs it, and the connection stays
in step for the next calls. Before, the next call raised "reply for request N while waiting
for M" and every call after it read the reply before its own."""

from __future__ import annotations

import logging

import numpy as np

import kvtier
from tests.conftest import blocks, keys, wait_for

BB = 4096


def test_an_unread_reserve_reply_is_read_past_and_its_slots_aborted(service, caplog):
    with kvtier.Client(service.socket) as c:
        ns = c.namespace("orph", block_bytes=BB)
        c._send("reserve", {"ns": "orph", "keys": keys(range(8)), "tier": "host"})
        with caplog.at_level(logging.WARNING, logger="kvtier.client"):
            assert c.stats()["reservations"] in (0, 1)      # the abort may still be in flight
        assert c.orphaned_replies == 1
        assert any("no caller waiting" in r.message for r in caplog.records)
        assert wait_for(lambda: c.stats()["reservations"] == 0)
        data = blocks(8, BB)
        ns.put(keys(range(8)), data)                          # in step: its own reply
        out = np.zeros_like(data)
        assert ns.get(keys(range(8)), out=out)[0].all()
        assert np.array_equal(out, data)


def test_an_unread_get_reply_has_its_lease_released(service):
    with kvtier.Client(service.socket) as c:
        ns = c.namespace("orph2", block_bytes=BB)
        ns.put(keys(range(4)), blocks(4, BB))
        c._send("get", {"ns": "orph2", "keys": keys(range(4))})
        c.stats()
        assert c.orphaned_replies == 1
        assert wait_for(lambda: c.stats()["leases"] == 0)
        assert ns.get(keys(range(4)), out=np.zeros((4, BB), np.uint8))[0].all()


def test_an_unread_error_reply_is_read_past_too(service):
    with kvtier.Client(service.socket) as c:
        c._send("reserve", {"ns": "no-such-namespace", "keys": keys(range(2))})
        assert c.stats()["reservations"] == 0
        assert c.orphaned_replies == 1
        assert c.stats()["leases"] == 0                       # in step
