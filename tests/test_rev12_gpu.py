"""rev12: a CUDA put's commit replies read past by a call made before its wait() (the device
half of tests/test_rev12_client.py; needs a CUDA device, run by the lead).

put_async sends a chunk's commit as soon as its copies complete (early_commits, on by
default) and reads the commits' replies at wait(). Any call on the connection in between
(another namespace's get, stats) reads those replies first. On main (the orphan change of
session 36) they were dropped there, and wait() then waited for them: the client's timeout,
the connection closed, and a put that was stored reported as of unknown outcome. Before the
orphan change the call in between raised "reply for request N while waiting for M"."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import kvtier  # noqa: E402
from kvtier.gpu import transfer  # noqa: E402
from tests.conftest import blocks, keys  # noqa: E402
from tests.service import Service  # noqa: E402

pytestmark = pytest.mark.gpu
BB = 16384


@pytest.fixture
def gpu_service(tmp_path: Path):
    svc = Service(tmp_path / "svc", admin=False, host_capacity="256MiB",
                  nvme_capacity="1GiB").start()
    yield svc
    svc.stop()


def test_a_call_between_put_async_and_its_wait_leaves_the_commits_to_wait(
        gpu_service, monkeypatch):
    from kvtier.api import pipeline
    monkeypatch.setattr(pipeline, "CUDA_PUT_CHUNK", 64)
    monkeypatch.setattr(pipeline, "CUDA_PUT_CHUNK_MIN", 64)
    real = transfer._reserved

    def reserved(c, mover, chunks, ids, src_rows, groups, error, early=None, *given):
        def slow(parts, ends):                      # each chunk's commit before the next reply
            ends[-1].synchronize()
            torch.cuda.synchronize()
            early(parts, ends)
        return real(c, mover, chunks, ids, src_rows, groups, error,
                    slow if early is not None else None, *given)
    monkeypatch.setattr(transfer, "_reserved", reserved)
    with kvtier.Client(gpu_service.socket, timeout=5.0) as c:
        other = c.namespace("other", block_bytes=BB)
        kept = blocks(2, BB, seed=1)
        other.put(keys(range(2)), kept)
        ns = c.namespace("early", block_bytes=BB)
        n = 300
        src = torch.randint(0, 255, (n, BB), dtype=torch.uint8, device="cuda")
        h = ns.put_async(keys(range(n)), src)
        assert h._commits                           # commits sent, their replies unread
        out = np.zeros((2, BB), np.uint8)
        assert other.get(keys(range(2)), out=out)[0].all()     # the call in between
        assert np.array_equal(out, kept)
        t0 = time.monotonic()
        assert h.wait().tolist() == [1] * n
        assert time.monotonic() - t0 < 2.0
        host = np.empty((n, BB), np.uint8)
        assert ns.get(keys(range(n)), out=host)[0].all()
        assert (host == src.cpu().numpy()).all()
        st = c.stats()
        assert st["reservations"] == 0 and st["leases"] == 0
