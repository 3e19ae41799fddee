"""A client kept across a real `kvtier serve` restart: the first call after it succeeds (get,
put, match_prefix, stats, on the sync and the async client); a connection lost during a call is
retried once where that is safe; a put whose reply was lost is reported as PutOutcomeUnknown,
never sent again."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

import kvtier
from kvtier.errors import PutOutcomeUnknown, ServiceUnavailable
from tests.conftest import blocks, keys
from tests.service import Service

BB = 16384


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    s = Service(tmp_path / "svc", admin=False, host_capacity="8MiB", nvme_capacity="64MiB",
                segment_bytes="4MiB").start()
    yield s
    if s.proc is not None and s.proc.poll() is None:
        os.kill(s.proc.pid, signal.SIGCONT)          # a test may leave it stopped
    s.stop()


def restart(svc: Service, sig: int) -> None:
    assert svc.stop(sig) in (0, -signal.SIGKILL)
    svc.start()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["stop", "kill"])
def test_the_first_get_and_put_after_a_restart_succeed(svc: Service, sig: int):
    data = blocks(8, BB, seed=1)
    with kvtier.Client(svc.socket) as c:
        ns = c.namespace("m", block_bytes=BB)
        ns.put(keys(range(4)), data[:4])                   # write_through: durable when acked
        first = c.generation
        restart(svc, sig)
        found, out = ns.get(keys(range(4)))                # the first call after the restart
        assert found.all() and (out == data[:4]).all()
        assert c.generation == first + 1                   # a new connection, a new mapping
        restart(svc, sig)
        # New keys, so their first versions: above every version of the earlier runs (epochs).
        assert (ns.put(keys(range(4, 8)), data[4:]) > 1).all()
        found, out = ns.get(keys(range(8)))
        assert found.all() and (out == data).all()
        restart(svc, sig)
        assert ns.match_prefix(keys(range(8))) == 8
        restart(svc, sig)
        assert c.stats()["leases"] == 0


def test_inline_get_and_put_after_a_restart(svc: Service):
    data = blocks(3, BB, seed=2)
    with kvtier.Client(svc.socket) as c:
        ns = c.namespace("i", block_bytes=BB, inline=True)
        ns.put(keys(range(3)), data)
        restart(svc, signal.SIGTERM)
        found, out = ns.get(keys(range(3)))
        assert found.all() and (out == data).all()
        restart(svc, signal.SIGTERM)
        assert (ns.put(keys([9]), data[:1]) > 1).all()


def test_a_call_that_finds_the_connection_lost_retries_only_safe_ops(svc: Service):
    # What a restart that lands between a call's check (_ensure) and its request looks like:
    # the request meets the old, closed connection.
    with kvtier.Client(svc.socket) as c:
        ns = c.namespace("m", block_bytes=BB)
        ns.put(keys(range(2)), blocks(2, BB))
        restart(svc, signal.SIGTERM)
        assert c._call("match_prefix", ns="m", keys=keys([0]))["n"] == 1   # retried, once
        restart(svc, signal.SIGTERM)
        with pytest.raises(ServiceUnavailable, match="the next call reconnects") as exc:
            c._call("delete", ns="m", keys=keys([0]))       # not repeated: its count would lie
        assert not isinstance(exc.value, PutOutcomeUnknown)  # no put was in flight
        assert ns.delete(keys([0])) == 1                    # ... and the next call reconnects


def test_a_put_whose_reply_is_lost_is_reported_not_retried(svc: Service):
    """The service is stopped (SIGSTOP) once the request is in its socket, so no reply can come;
    the client's timeout then loses the connection, as a crash would. SIGCONT lets the service
    read the requests it was sent: whether the put is stored depends on that, not on the
    client, which is what PutOutcomeUnknown says."""
    data = blocks(3, BB, seed=3)
    with kvtier.Client(svc.socket, timeout=1.0) as c:
        ns = c.namespace("m", block_bytes=BB)
        inline = c.namespace("m", inline=True)

        def stopped(call, error: type) -> BaseException:
            os.kill(svc.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(error) as exc:
                    call()
            finally:
                os.kill(svc.proc.pid, signal.SIGCONT)
            assert ns.match_prefix(keys([0])) in (0, 1)      # the next call reconnects
            return exc.value

        stopped(lambda: inline.put(keys([0]), data[:1]), PutOutcomeUnknown)
        r = c._call("reserve", ns="m", keys=keys([1]))      # Namespace.put's steps, by hand
        ns._write(np.frombuffer(r["slots"], "<i4"), data[1:2])
        err = stopped(lambda: c._call("commit", rid=r["rid"]), PutOutcomeUnknown)
        assert "1 put request(s) were sent" in str(err) and "may or may not be stored" in str(err)
        ns.get(keys([2]))                                    # mapped again after the reconnects
        # A put stopped at its reserve stored nothing: only the service is said to be gone.
        err = stopped(lambda: ns.put(keys([2]), data[2:]), ServiceUnavailable)
        assert not isinstance(err, PutOutcomeUnknown)
        # Each key is stored whole or absent, and a put of it again (by the caller) works.
        found, out = ns.get(keys(range(3)))
        assert all(not f or (o == d).all() for f, o, d in zip(found, out, data))
        assert (ns.put(keys(range(3)), data) >= 1).all()
        found, out = ns.get(keys(range(3)))
        assert found.all() and (out == data).all()


def test_async_client_first_calls_after_a_restart_succeed(svc: Service):
    data = blocks(6, BB, seed=4)

    async def go() -> None:
        async with kvtier.AsyncClient(svc.socket, timeout=10) as c:
            ns = await c.namespace("a", block_bytes=BB)
            await ns.put(keys(range(3)), data[:3])
            restart(svc, signal.SIGKILL)                  # the event loop does not run meanwhile
            found, out = await ns.get(keys(range(3)))
            assert found.all() and (out == data[:3]).all()
            restart(svc, signal.SIGTERM)
            assert ((await ns.put(keys(range(3, 6)), data[3:])) > 1).all()
            restart(svc, signal.SIGTERM)
            assert (await c.stats())["leases"] == 0
            found, out = await ns.get(keys(range(6)))
            assert found.all() and (out == data).all()
    asyncio.run(go())


def test_async_put_whose_reply_is_lost_is_reported(svc: Service):
    async def go() -> None:
        async with kvtier.AsyncClient(svc.socket, timeout=1.0) as c:
            inline = await c.namespace("a", block_bytes=BB, inline=True)
            os.kill(svc.proc.pid, signal.SIGSTOP)
            with pytest.raises(PutOutcomeUnknown, match="may or may not be stored"):
                await inline.put(keys([0]), blocks(1, BB))
            os.kill(svc.proc.pid, signal.SIGCONT)
            c.timeout = 30.0
            assert (await inline.put(keys([0]), blocks(1, BB)))[0] >= 1
    asyncio.run(go())
