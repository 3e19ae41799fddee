"""Busy polling of the socket loop (kvtier.api.busypoll): when it spins, when it stops, and that
the loop stays responsive while it does. On asyncio's loop and on uvloop, which kvtier serve
uses where installed."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvtier
from kvtier.api.busypoll import BusyPoll
from kvtier.memory import shmem_huge_pages
from tests.service import Service

try:
    import uvloop
except ImportError:                      # pragma: no cover - uvloop is a dependency
    uvloop = None


def loops() -> list:
    out = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    if uvloop is not None:
        out.append(pytest.param(uvloop.new_event_loop, id="uvloop"))
    return out


def run(factory, coro_fn):
    loop = factory()
    try:
        return loop.run_until_complete(coro_fn(loop))
    finally:
        loop.close()


@pytest.mark.parametrize("factory", loops())
def test_a_touch_spins_until_the_window_has_passed_since_the_last_one(factory):
    async def scenario(loop):
        ticks = []
        bp = BusyPoll(0.02, loop=loop, may_spin=lambda: ticks.append(1) or True)
        bp.touch()
        await asyncio.sleep(0.005)
        bp.touch()                               # extends the same period
        second = bp._last - bp._spin_started
        while bp._armed:
            await asyncio.sleep(0.005)
        return bp, len(ticks), second
    bp, ticks, second = run(factory, scenario)
    assert bp.spins == 1 and second > 0          # one period, extended, not two
    assert bp.spun_s >= second + 0.02            # it ran to window_s after the second touch
    assert ticks > 10                            # the loop polled over and over meanwhile


@pytest.mark.parametrize("factory", loops())
def test_timers_and_io_callbacks_still_run_while_it_spins(factory):
    async def scenario(loop):
        bp = BusyPoll(0.5, loop=loop, may_spin=lambda: True)
        bp.touch()
        fired = loop.create_future()
        loop.call_later(0.01, fired.set_result, "timer")
        rsock, wsock = socket.socketpair()
        rsock.setblocking(False)
        try:
            recv = loop.create_task(loop.sock_recv(rsock, 16))
            await asyncio.sleep(0)
            wsock.send(b"frame")
            got = (await asyncio.wait_for(fired, 5), await asyncio.wait_for(recv, 5))
        finally:
            rsock.close()
            wsock.close()
        armed = bp._armed
        bp.window_s = 0                          # end the period early
        while bp._armed:
            await asyncio.sleep(0.001)
        return got, armed
    got, armed = run(factory, scenario)
    assert got == ("timer", b"frame") and armed  # both ran inside the spin period


@pytest.mark.parametrize("factory", loops())
def test_it_does_not_spin_while_engine_threads_have_work_or_when_off(factory):
    async def scenario(loop):
        asked = []
        busy = BusyPoll(1.0, loop=loop, may_spin=lambda: asked.append(1) and False)
        busy.touch()
        off = BusyPoll(0.0, loop=loop)
        off.touch()
        await asyncio.sleep(0.01)
        return busy, off, len(asked)
    busy, off, asked = run(factory, scenario)
    assert asked == 1 and not busy._armed        # stopped at the first tick
    assert off.spins == 0 and not off._armed


@pytest.mark.parametrize("window", ["0", "300"])
def test_serve_reports_its_busy_polling_and_huge_pages(tmp_path: Path, window: str):
    # A real kvtier serve: the stats op reports the configured window, and spin periods only
    # when the window is not 0; /metrics counts the seconds spun.
    svc = Service(tmp_path / "svc", busy_poll_us=window, nvme_capacity="0").start()
    try:
        with kvtier.Client(svc.socket) as c:
            ns = c.namespace("m", block_bytes=4096)
            for i in range(20):
                ns.put((i + 1).to_bytes(16, "big"), bytes(4096))
            stats = c.stats()
            bp = stats["busy_poll"]
        # The same start-up also reports the host tier's huge-page policy (kvtier.memory).
        policy = shmem_huge_pages()
        assert stats["tiers"]["host"]["huge_pages"] == policy
        assert ("the host tier is in 4 KiB pages" in svc.output()) == (policy in ("never", "deny"))
        assert bp["window_us"] == float(window)
        if window == "0":
            assert bp["periods"] == 0 and bp["spun_s"] == 0
        else:
            assert bp["periods"] >= 1 and bp["spun_s"] > 0
        with urllib.request.urlopen(svc.url + "/metrics", timeout=10) as r:
            fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        spun = fams["kvtier_busy_poll_seconds"].samples[0].value
        assert (spun > 0) == (window != "0")
    finally:
        assert svc.stop() == 0


def test_busy_poll_us_garbage_is_a_config_error(tmp_path: Path):
    from kvtier.config import load
    from kvtier.errors import ConfigError
    for bad in ("fast", "-5", "1e999x"):
        with pytest.raises(ConfigError, match="busy_poll_us"):
            load(env={"KVTIER_BUSY_POLL_US": bad})


class _Queue:
    """Stands in for the loop's ready queue: call_soon is all BusyPoll uses of a loop."""

    def __init__(self) -> None:
        self.ready: list = []

    def call_soon(self, fn) -> None:
        self.ready.append(fn)

    def step(self) -> None:
        """One loop iteration: run what is ready now (a re-queued callback waits)."""
        ready, self.ready = self.ready, []
        for fn in ready:
            fn()


def test_it_stops_spinning_for_clients_whose_requests_come_further_apart_than_the_window():
    now = [100.0]
    q = _Queue()
    bp = BusyPoll(0.001, loop=q, clock=lambda: now[0])
    periods, armed = [], []
    for gap in [0.003] * 8 + [0.0002] * 12:      # a slow client, then a fast one
        now[0] += gap
        q.step()                                 # the loop, just before the request
        armed.append(bp._armed)
        bp.touch(frame=True)                     # its request
        now[0] += 0.00002
        bp.touch()                               # our reply
        periods.append(bp.spins)
    slow, fast = periods[:8], periods[8:]
    assert slow[:3] == [1, 2, 3]                 # at first each request starts a period
    assert slow[-1] == slow[-4]                  # none once its gaps were learned
    assert not any(armed[1:9])                   # (each had ended before the next request)
    assert fast[-1] == slow[-1] + 1 and all(armed[-5:])    # the fast one: spun for throughout
    assert bp.gap_s < bp.window_s


def test_busy_poll_us_auto_follows_the_usable_cores(monkeypatch):
    """auto (the default): the long window on a host of BUSY_POLL_CORES or more usable cores
    (a GPU server's), the short one below; a number given is kept as it is."""
    from kvtier import config
    assert config.auto_busy_poll_us(config.BUSY_POLL_CORES) == config.BUSY_POLL_LONG_US
    assert config.auto_busy_poll_us(config.BUSY_POLL_CORES - 1) == config.BUSY_POLL_SHORT_US
    assert config.BUSY_POLL_LONG_US > config.BUSY_POLL_SHORT_US > 0
    for cores, want in ((16, config.BUSY_POLL_LONG_US), (2, config.BUSY_POLL_SHORT_US)):
        monkeypatch.setattr(config, "usable_cores", lambda cores=cores: cores)
        assert config.load(env={}).busy_poll_us == want
        assert config.load(env={"KVTIER_BUSY_POLL_US": "auto"}).busy_poll_us == want
        assert config.load(env={"KVTIER_BUSY_POLL_US": "250"}).busy_poll_us == 250.0
        assert config.Settings().busy_poll_us == want
    assert config.usable_cores() >= 1
