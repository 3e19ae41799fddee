"""kvtier.AsyncClient against a real `kvtier serve`: every call, pipelining, inline mode,
typed errors and a reconnect after a restart."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import kvtier
from kvtier.errors import BadRequest, NamespaceError, ServiceUnavailable
from tests.conftest import blocks, keys
from tests.service import Service

BB = 16384


def test_round_trips_and_pipelined_gets(service):
    async def go() -> None:
        async with kvtier.AsyncClient(service.socket) as c:
            ns = await c.namespace("a", block_bytes=BB)
            data = blocks(32, BB)
            v = await ns.put(keys(range(32)), data, parents=bytes(16) + keys(range(31)))
            assert v.tolist() == [1] * 32
            assert await ns.match_prefix(keys(range(40))) == 32
            results = await asyncio.gather(*(ns.get(keys([i])) for i in range(32)))
            for i, (found, out) in enumerate(results):
                assert found[0] and (out[0] == data[i]).all()
            assert (await c.stats())["leases"] <= 32
            assert await ns.delete(keys([0, 1])) == 2
            assert await ns.match_prefix(keys(range(4))) == 0
            inline = await c.namespace("a", inline=True)
            found, out = await inline.get(keys([5, 99]))
            assert found.tolist() == [True, False] and (out[0] == data[5]).all()
            assert await c.flush() >= 0
            with pytest.raises(NamespaceError):
                await c.namespace("nope")
            with pytest.raises(BadRequest):
                await ns.put(keys([1]), b"short")
        async with kvtier.AsyncClient(service.socket) as c2:
            assert (await c2.stats())["leases"] == 0          # the first client's are gone
    asyncio.run(go())


def test_reconnects_after_a_restart(tmp_path: Path):
    svc = Service(tmp_path / "svc", admin=False).start()

    async def go() -> None:
        c = kvtier.AsyncClient(svc.socket, timeout=10)
        await c.connect()
        ns = await c.namespace("r", block_bytes=BB)
        await ns.put(keys(range(4)), blocks(4, BB, 3))
        svc.kill()
        with pytest.raises(ServiceUnavailable):
            await ns.get(keys(range(4)))
        svc.start()
        found, out = await ns.get(keys(range(4)))              # reconnect and remap
        assert found.all() and (out == blocks(4, BB, 3)).all()
        await c.close()
    try:
        asyncio.run(go())
    finally:
        svc.stop()
