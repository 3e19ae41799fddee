"""GPU tests (pytest -m gpu), run on the H200: CUDA tensors through the service, scattered
rows, the coherence rules on a real HBM tier, CUDA IPC from a second process, kvikio with
checksums. Skipped cleanly where there is no CUDA device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import kvtier  # noqa: E402
from kvtier.coherence.engine import Engine  # noqa: E402
from kvtier.config import make_settings  # noqa: E402
from kvtier.tiers.hbm import HbmPool  # noqa: E402
from kvtier.types import Tier  # noqa: E402
from tests.conftest import blocks, keys  # noqa: E402
from tests.service import Service  # noqa: E402
from tests.test_engine_stateful import EngineModel, SETTINGS  # noqa: E402

pytestmark = pytest.mark.gpu
BB = 16384


@pytest.fixture
def gpu_service(tmp_path: Path):
    svc = Service(tmp_path / "svc", admin=False, host_capacity="256MiB",
                  nvme_capacity="1GiB").start()
    yield svc
    svc.stop()


def test_cuda_tensors_round_trip_through_the_host_tier(gpu_service):
    with kvtier.Client(gpu_service.socket) as c:
        ns = c.namespace("gpu", block_bytes=BB)
        src = torch.randint(0, 255, (256, BB), dtype=torch.uint8, device="cuda")
        ns.put(keys(range(256)), src)
        out = torch.zeros_like(src)
        found, _ = ns.get(keys(range(256)), out=out)
        assert found.all() and torch.equal(out, src)
        host = np.empty((256, BB), np.uint8)
        ns.get(keys(range(256)), out=host)                  # the same bytes, seen by the CPU
        assert (host == src.cpu().numpy()).all()


def test_scattered_rows_of_a_paged_cache(gpu_service):
    with kvtier.Client(gpu_service.socket) as c:
        ns = c.namespace("paged", block_bytes=BB)
        cache = torch.randn(512, BB // 2, dtype=torch.bfloat16, device="cuda")   # 512 pages
        pages = np.random.default_rng(0).permutation(512)[:100]
        ns.put(keys(range(100)), cache, rows=pages)         # from scattered pages
        other = torch.zeros_like(cache)
        dest = np.random.default_rng(1).permutation(512)[:100]
        found, _ = ns.get(keys(range(100)), out=other, rows=dest)   # into other pages
        assert found.all()
        assert torch.equal(other[torch.as_tensor(dest, device="cuda")],
                           cache[torch.as_tensor(pages, device="cuda")])


@pytest.mark.parametrize("words", [2048, 513, 1])
def test_both_transfer_kernels_move_exactly_the_named_rows(words: int):
    # Even row widths take the 16-byte row kernel, odd ones the 8-byte word kernel; the rows
    # not named must keep their poison.
    from kvtier.gpu import MappedSegment, synchronize
    rng = np.random.default_rng(words)
    src = cupy.asarray(rng.integers(0, 1 << 63, (300, words), dtype=np.uint64))
    dst = cupy.full((400, words), 0xDEADBEEF, dtype=cupy.uint64)
    s_rows = rng.permutation(300)[:200]
    d_rows = rng.permutation(400)[:200]
    MappedSegment._move(src, dst, s_rows, d_rows)
    synchronize()
    host_src, host_dst = cupy.asnumpy(src), cupy.asnumpy(dst)
    assert (host_dst[d_rows] == host_src[s_rows]).all()
    untouched = np.setdiff1d(np.arange(400), d_rows)
    assert (host_dst[untouched] == 0xDEADBEEF).all()


@pytest.mark.parametrize("put_chunk", [4096, 1024], ids=["put-one-request", "put-chunked"])
def test_large_cuda_batches_round_trip_in_pipelined_chunks(gpu_service, put_chunk, monkeypatch):
    # 3,000 keys: a get in three chunks (kvtier.api.pipeline), each one launch, into scattered
    # rows; the put as one request (the default up to 2 x CUDA_PUT_CHUNK keys) or in chunks.
    from kvtier.api import pipeline
    monkeypatch.setattr(pipeline, "CUDA_PUT_CHUNK", put_chunk)
    with kvtier.Client(gpu_service.socket) as c:
        ns = c.namespace(f"chunks{put_chunk}", block_bytes=4096)
        n = 3000
        src = torch.randint(0, 255, (n, 4096), dtype=torch.uint8, device="cuda")
        rows = np.random.default_rng(2).permutation(n)
        ns.put(keys(range(n)), src, rows=rows)
        out = torch.zeros_like(src)
        dest = np.random.default_rng(3).permutation(n)
        found, _ = ns.get(keys(range(n)), out=out, rows=dest)
        assert found.all()
        assert torch.equal(out[torch.as_tensor(dest, device="cuda")],
                           src[torch.as_tensor(rows, device="cuda")])
        assert c.stats()["leases"] == 0


def test_hbm_slots_over_the_socket_by_cuda_ipc(tmp_path: Path):
    # A service with an HBM tier hands its pool to the worker by CUDA IPC: puts and gets with
    # tier="hbm" move blocks device to device, the commit writes them through to host, and a
    # later host-tier rewrite makes the HBM copy stale, so the next HBM get brings it up again.
    svc = Service(tmp_path / "svc", admin=False, host_capacity="64MiB", nvme_capacity="256MiB",
                  hbm_capacity="64MiB").start()
    try:
        with kvtier.Client(svc.socket) as c:
            ns = c.namespace("hbm", block_bytes=BB)
            src = torch.randint(0, 255, (300, BB), dtype=torch.uint8, device="cuda")
            assert ns.put(keys(range(300)), src, tier="hbm").tolist() == [1] * 300
            out = torch.zeros_like(src)
            found, _ = ns.get(keys(range(300)), out=out, tier="hbm")
            assert found.all() and torch.equal(out, src)
            host = np.empty((300, BB), np.uint8)
            assert ns.get(keys(range(300)), out=host)[0].all()       # written through
            assert (host == src.cpu().numpy()).all()
            new = blocks(10, BB, 4)
            ns.put(keys(range(10)), new)                              # host rewrite: v2
            found, _ = ns.get(keys(range(10)), out=out[:10], tier="hbm")
            assert found.all() and (out[:10].cpu().numpy() == new).all()
            assert c.stats()["leases"] == 0
    finally:
        svc.stop()


class HbmModel(EngineModel):
    """The engine's state machine with a real HBM pool in place of the stand-in."""

    def _open(self) -> None:
        self.engine = Engine(self.settings, hbm_pool_factory=HbmPool)


TestHbmCoherence = HbmModel.TestCase
TestHbmCoherence.settings = SETTINGS


def test_hbm_write_is_written_through_and_served(tmp_path: Path):
    eng = Engine(make_settings({"data_dir": str(tmp_path / "d"), "host_capacity": "4MiB",
                                "hbm_capacity": "1MiB", "nvme_capacity": "16MiB"}),
                 hbm_pool_factory=HbmPool)
    eng.create_namespace("m", BB)
    data = blocks(8, BB)
    eng.put("m", keys(range(8)), data, tier=Tier.HBM)
    e = eng.entry("m", keys([0]))
    assert e["copies"]["hbm"]["current"] and e["copies"]["host"]["current"]
    assert e["copies"]["nvme"]["current"]                    # write_through reached NVMe
    eng.evict(Tier.HOST, 8)
    found, out = eng.read("m", keys(range(8)))               # from HBM, back to host
    assert found.all() and (out == data).all()
    eng.close()


def test_cuda_ipc_of_the_hbm_pool_from_a_second_process(tmp_path: Path):
    pool = HbmPool("ipc", BB, 16)
    pool.write(np.array([3]), np.full((1, BB), 7, np.uint8))
    cupy.cuda.Device().synchronize()
    handle = pool.ipc_handle()
    code = ("import cupy, sys\n"
            "h = bytes.fromhex(sys.argv[1])\n"
            "ptr = cupy.cuda.runtime.ipcOpenMemHandle(h)\n"
            f"mem = cupy.cuda.UnownedMemory(ptr, {16 * BB}, None)\n"
            f"a = cupy.ndarray(({16}, {BB}), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))\n"
            "print(int(a[3].sum()), int(a[2].sum()))\n"
            "cupy.cuda.runtime.ipcCloseMemHandle(ptr)\n")
    out = subprocess.run([sys.executable, "-c", code, handle.hex()], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(7 * BB), "0"]


def test_kvikio_round_trip_with_checksums(tmp_path: Path):
    pytest.importorskip("kvikio")
    from kvtier.tiers.kvikio_backend import kvikio_backend
    backend = kvikio_backend()
    assert backend is not None and backend.name == "kvikio"
    eng = Engine(make_settings({"data_dir": str(tmp_path / "d"), "host_capacity": "8MiB",
                                "nvme_capacity": "64MiB"}), nvme_backend=backend)
    eng.create_namespace("m", 65536)
    data = blocks(64, 65536)
    eng.put("m", keys(range(64)), data)
    eng.evict(Tier.HOST, 64)
    found, out = eng.read("m", keys(range(32)))
    assert found.all() and (out == data[:32]).all()
    assert eng.counters.checksum_failures == 0 and eng.stats()["tiers"]["nvme"]["backend"] == "kvikio"
    eng.close()
