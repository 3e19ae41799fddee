"""Busy polling: the event loop keeps polling, not sleeping, for a short while after a request.

A worker that gets a batch of blocks spends the next few hundred microseconds copying them out
of shared memory, and then sends its next request. If the service's loop went to sleep in
epoll_wait meanwhile, that request first has to wake it, and on a virtual machine a vCPU that
halted for longer than its host's halt-polling window is descheduled. On the dev VM a get of
64 x 64 KiB blocks took 180 us when the client sent the next one at once, and 260-350 us after
the client had been busy for 200-300 us without touching the socket (docs/DESIGN-NOTES.md,
"The socket loop busy-polls"). SO_BUSY_POLL does this for network sockets; Unix sockets have no
such option.

``BusyPoll.touch()`` (called on every frame received and every reply written) keeps one
callback re-queued with ``call_soon`` until ``window_s`` has passed since the last touch. While
a callback is ready, asyncio's loop and uvloop's both poll with a zero timeout, so the next
frame is read within a poll cycle (a few microseconds) instead of after a wake-up. Nothing else changes: requests are
answered by the same code, in the same order.

The price is CPU: up to one core while any client sends requests less than ``window_s`` apart,
and window_s of spinning after the last one. Two limits keep it from buying nothing:

- it follows the clients: the gaps between a reply (or frame) and the next frame are averaged
  (each capped at 2 x window_s), and while that average is longer than window_s the loop does
  not spin, since the next request would mostly come after the spin had ended. A worker that
  sends a request every 2 ms costs no spinning; one that speeds up is spun for again after a
  few requests, because the gaps are measured whether or not the loop spun;
- it stops while the engine's threads have work (``may_spin`` false): the loop thread would
  take the GIL from them at every poll, and CPython hands a waiting thread the GIL only after
  its 5 ms switch interval.

Set busy_poll_us to 0 to turn it off (a host short of cores).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable


class BusyPoll:
    """Keep the loop polling for ``window_s`` after each touch(), while may_spin() holds.
    loop: the loop to keep busy; None (the service's case) takes the running loop of the
    touch that starts a spin period."""

    def __init__(self, window_s: float, may_spin: Callable[[], bool] = lambda: True,
                 loop: asyncio.AbstractEventLoop | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._loop = loop
        self.window_s = window_s
        self._may_spin = may_spin
        self._clock = clock
        self._last = 0.0
        self._armed = False
        self._spin_started = 0.0
        self.gap_s = 0.0           # recent gaps before a frame (moving average, capped)
        self.spun_s = 0.0          # total seconds spent spinning (for stats: the CPU it cost)
        self.spins = 0             # spin periods started

    def touch(self, frame: bool = False) -> None:
        """A frame arrived (frame=True) or a reply went out: spin for window_s from now,
        unless recent frames came further apart than that."""
        if self.window_s <= 0:
            return
        now = self._clock()
        if frame and self._last:
            gap = min(now - self._last, 2.0 * self.window_s)
            self.gap_s = 0.8 * self.gap_s + 0.2 * gap
        self._last = now
        if not self._armed and self.gap_s <= self.window_s:
            self._armed = True
            self._spin_started = now
            self.spins += 1
            (self._loop or asyncio.get_running_loop()).call_soon(self._tick)

    def _tick(self) -> None:
        now = self._clock()
        if now - self._last < self.window_s and self._may_spin():
            (self._loop or asyncio.get_running_loop()).call_soon(self._tick)
            return
        self._armed = False
        self.spun_s += now - self._spin_started

    def stats(self) -> dict[str, float]:
        return {"window_us": self.window_s * 1e6, "spun_s": round(self.spun_s, 6),
                "periods": self.spins, "recent_gap_us": round(self.gap_s * 1e6, 1)}
