"""A circuit breaker per Redis shard (seed 3.3), with its states and moves written as data.

    CLOSED    --trip-->     OPEN        error rate >= 50% with >= 20 calls in the last 60 s
    OPEN      --cooldown--> HALF_OPEN   after `cooldown` seconds, one probe call is let through
    HALF_OPEN --success-->  CLOSED      the window starts afresh
    HALF_OPEN --failure-->  OPEN

While OPEN (and while a HALF_OPEN probe is out) calls are refused without touching the network:
the caller counts a remote miss and the local tiers keep serving.
"""

from __future__ import annotations

import collections
import threading
import time
from enum import Enum


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class BreakerEvent(Enum):
    TRIP = "trip"
    COOLDOWN = "cooldown"
    SUCCESS = "success"
    FAILURE = "failure"


TRANSITIONS: dict[tuple[BreakerState, BreakerEvent], BreakerState] = {
    (BreakerState.CLOSED, BreakerEvent.TRIP): BreakerState.OPEN,
    (BreakerState.OPEN, BreakerEvent.COOLDOWN): BreakerState.HALF_OPEN,
    (BreakerState.HALF_OPEN, BreakerEvent.SUCCESS): BreakerState.CLOSED,
    (BreakerState.HALF_OPEN, BreakerEvent.FAILURE): BreakerState.OPEN,
}


class CircuitBreaker:
    def __init__(self, window: float = 60.0, min_calls: int = 20, threshold: float = 0.5,
                 cooldown: float = 5.0, clock=time.monotonic) -> None:
        self.window, self.min_calls, self.threshold, self.cooldown = (window, min_calls,
                                                                      threshold, cooldown)
        self.state = BreakerState.CLOSED
        self._clock = clock
        self._calls: collections.deque[tuple[float, bool]] = collections.deque()
        self._opened_at = 0.0
        self._probe_out = False
        self._lock = threading.Lock()
        self.opened = 0            # how many times it tripped

    def _move(self, event: BreakerEvent) -> None:
        self.state = TRANSITIONS[(self.state, event)]

    def allow(self) -> bool:
        """May a call go out now? In HALF_OPEN, only one probe at a time."""
        with self._lock:
            if self.state is BreakerState.OPEN:
                if self._clock() - self._opened_at < self.cooldown:
                    return False
                self._move(BreakerEvent.COOLDOWN)
            if self.state is BreakerState.HALF_OPEN:
                if self._probe_out:
                    return False
                self._probe_out = True
            return True

    def record(self, ok: bool) -> None:
        with self._lock:
            now = self._clock()
            if self.state is BreakerState.HALF_OPEN:
                self._probe_out = False
                if ok:
                    self._move(BreakerEvent.SUCCESS)
                    self._calls.clear()
                else:
                    self._move(BreakerEvent.FAILURE)
                    self._opened_at = now
                return
            if self.state is BreakerState.OPEN:
                return
            self._calls.append((now, ok))
            while self._calls and now - self._calls[0][0] > self.window:
                self._calls.popleft()
            n = len(self._calls)
            errors = sum(1 for _, good in self._calls if not good)
            if n >= self.min_calls and errors / n >= self.threshold:
                self._move(BreakerEvent.TRIP)
                self._opened_at = now
                self.opened += 1

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            n = len(self._calls)
            errors = sum(1 for _, good in self._calls if not good)
            return {"state": self.state.value, "calls": n, "errors": errors,
                    "opened": self.opened}
