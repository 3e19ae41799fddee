"""rev12: a CUDA put's commit replies read past by a call made before its wait() (the device
half of tests/test_rev12_client.py; needs a CUDA device, run by the lead).

put_async sends a chunk's commit as soon as its copies complete (early_commits, on by
default, or the namespace's next CUDA call's poll) and reads the commits' replies at wait().
Any call on the connection in between (another namespace's get, stats) reads those replies
first. On main (the orphan change of session 36) they were dropped there, and wait() then
waited for them: the client's timeout, the connection closed, and a put that was stored
reported as of unknown outcome. Before the orphan change the call in between raised "reply
for request N while waiting for M"."""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
# test_gpu's service and block size (its import skips this module where CUDA is missing)
from tests import test_gpu  # noqa: E402

import kvtier  # noqa: E402
from tests.conftest import blocks, keys  # noqa: E402

pytestmark = pytest.mark.gpu
BB = test_gpu.BB
gpu_service = test_gpu.gpu_service


def test_a_call_between_put_async_and_its_wait_leaves_the_commits_to_wait(gpu_service):
    with kvtier.Client(gpu_service.socket, timeout=5.0) as c:
        other = c.namespace("other", block_bytes=BB)
        kept = blocks(2, BB, seed=1)
        other.put(keys(range(2)), kept)
        ns = c.namespace("early", block_bytes=BB)
        n = 3000                                    # several chunks (cuda_put_chunks)
        src = torch.randint(0, 255, (n, BB), dtype=torch.uint8, device="cuda")
        h = ns.put_async(keys(range(n)), src)
        torch.cuda.synchronize()
        # What the namespace's next CUDA call's poll does for a put whose copies completed
        # (early commits do it while put_async reads its later reserves): the commits go
        # out; their replies are wait()'s to read.
        h._events_done()
        assert len(h._commits) == len(h._parts) > 1
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
