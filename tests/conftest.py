"""Shared fixtures: a data directory per test and engines on tiny capacities."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from hypothesis import settings as hypothesis_settings

from kvtier.coherence.engine import Engine
from kvtier.config import Settings, make_settings
from kvtier.tiers.host import SlotPool

# Every hypothesis test runs the same cases each time (derandomized), so that a red CI names a
# case anyone can rerun; KVTIER_HYPOTHESIS_RANDOM=1 explores new ones, for a soak by hand.
hypothesis_settings.register_profile(
    "kvtier", derandomize=os.environ.get("KVTIER_HYPOTHESIS_RANDOM", "") != "1")
hypothesis_settings.load_profile("kvtier")


def hbm_standin(name: str, block_bytes: int, n_slots: int) -> SlotPool:
    """The in-memory HBM stand-in (tests only; never offered to users)."""
    return SlotPool(name, block_bytes, n_slots, shared=False)


def key(i: int, width: int = 16) -> bytes:
    """A test key; i is offset by one because the all-zero key is reserved."""
    return (i + 1).to_bytes(width, "big")


def keys(ids: range | list[int], width: int = 16) -> bytes:
    return b"".join(key(i, width) for i in ids)


def blocks(n: int, block_bytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, block_bytes), dtype=np.uint8)

def wait_for(pred: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Whether pred() became true within timeout seconds (checked every 50 ms): for what a
    service does after its reply (an abort or release sent without waiting)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def drive_get(eng: Engine, steps: Any, before_install: Callable[[Any], None] | None = None
              ) -> Any:
    """A get's steps (Engine.get_steps) run as the server's loop runs them: the locked ones
    under the engine lock, a CapacityError thrown back into the steps; before_install(pending)
    just before its install step (where the loop answers other requests). Its GetResult."""
    from kvtier.coherence.gets import advance
    from kvtier.errors import CapacityError

    s, out = advance(steps, None, None)
    while s is not None:
        try:
            if s.locked:
                with eng.lock:
                    value = s.fn()
            else:
                value = s.fn()
        except CapacityError as exc:
            s, out = advance(steps, None, exc)
            continue
        s, out = advance(steps, value, None)
        if (before_install is not None and s is not None
                and getattr(s.fn, "func", None) == eng.gets._finish_get):
            before_install(s.fn.args[0])
    return out


@pytest.fixture
def make_engine(tmp_path: Path) -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(hbm: bool = False, **overrides: Any) -> Engine:
        values: dict[str, Any] = {"data_dir": str(tmp_path / "data"), "host_capacity": "64KiB",
                                  "nvme_capacity": "4MiB", "segment_bytes": "1MiB"}
        values.update(overrides)
        if hbm:
            values.setdefault("hbm_capacity", "16KiB")
        eng = Engine(make_settings(values), hbm_pool_factory=hbm_standin if hbm else None)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        if eng.namespaces:
            eng.close(flush=False)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return make_settings({"data_dir": str(tmp_path / "data")})


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Any]:
    """A real `kvtier serve` subprocess on small capacities."""
    from tests.service import Service
    svc = Service(tmp_path / "svc", host_capacity="8MiB", nvme_capacity="64MiB",
                  segment_bytes="4MiB").start()
    yield svc
    svc.stop()
