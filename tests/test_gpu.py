"""GPU tests (pytest -m gpu), run on the H200: asynchronous gets and puts on the engine's stream
beside a model-like workload, per-layer events, vLLM's two layouts, transfers that fail part
way, the GPU checksum, the HBM tier over CUDA IPC and its per-device pools, kvikio. Skipped
cleanly where there is no CUDA device. The host-side planning is tests/test_gpu_plan.py."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import xxhash  # noqa: E402

import kvtier  # noqa: E402
from kvtier.api.layouts import Pages  # noqa: E402
from kvtier.coherence.engine import Engine  # noqa: E402
from kvtier.config import make_settings  # noqa: E402
from kvtier.errors import BadRequest, CapacityError  # noqa: E402
from kvtier.gpu import transfer  # noqa: E402
from kvtier.gpu.device import Mover, Staging, target_table  # noqa: E402
from kvtier.gpu.slots import MappedSegment  # noqa: E402
from kvtier.gpu.streams import Stream, own  # noqa: E402
from kvtier.gpu.plan import TransferPolicy  # noqa: E402
from kvtier.tiers.hbm import HbmPool  # noqa: E402
from kvtier.types import Tier  # noqa: E402
from tests.conftest import blocks, keys  # noqa: E402
from tests.service import Service  # noqa: E402
from tests.test_engine_stateful import EngineModel, SETTINGS  # noqa: E402

pytestmark = pytest.mark.gpu
BB = 16384
# vLLM-shaped per-layer caches: 4 layers, 64 blocks of 16 tokens, 2 KV heads of 64, bf16.
LAYERS, NB, TOK, HEADS, DIM = 4, 64, 16, 2, 64
PAGE = TOK * HEADS * DIM * 2                       # one K or V page of a block: 4 KiB
VLLM_BB = LAYERS * 2 * PAGE


@pytest.fixture
def gpu_service(tmp_path: Path):
    svc = Service(tmp_path / "svc", admin=False, host_capacity="256MiB",
                  nvme_capacity="1GiB").start()
    yield svc
    svc.stop()


_K = {"copy_engine_bytes": 1 << 40, "onboard_copy_engine_bytes": 0}    # every page by kernel
POLICIES = {
    "staged": TransferPolicy(**_K),      # host->GPU by device staging
    "staged_default_priority": TransferPolicy(**_K, kernel_priority=False),
    # per-layer placements on the caller's stream, each layer's copy after them (the default
    # until session 38; "staged" forks them onto the kernel stream, copies two layers ahead)
    "staged_inline": TransferPolicy(**_K, layer_fork=False, layer_ring=2),
    # placements from device staging over more thread blocks than the kernels that read
    # host memory (TransferPolicy.place_blocks; two per SM of an H100)
    "staged_wide": TransferPolicy(**_K, place_blocks=264),
    "kernel": TransferPolicy(**_K, staged=False),
    # copy-engine onboards (16 KiB pages here, by onboard_copy_engine_bytes) with half of each
    # chunk's blocks read by the kernel beside the copies (TransferPolicy.kernel_share)
    "copy_engine_split": TransferPolicy(onboard_copy_engine_bytes=BB, kernel_share=0.5),
    "copy_engine": TransferPolicy(copy_engine_bytes=0, small_batch_copies=0),
}


@pytest.fixture(params=list(POLICIES))
def method(request):
    """Each data-path test once per transfer method (the choice is a setting)."""
    transfer.set_policy(POLICIES[request.param])
    yield request.param
    transfer.set_policy(None)


def _sleep(stream, ms: float = 200) -> None:
    """Keep stream busy for about ms (so that work queued behind it is still in flight)."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(ms * 2e6))


def _busy_model(n: int = 8):
    """A model-like workload on its own stream: bf16 matmuls."""
    s = torch.cuda.Stream()
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    with torch.cuda.stream(s):
        for _ in range(n):
            a = torch.tanh(a @ a * 1e-3)
    return s, a


def test_cuda_tensors_round_trip_through_the_host_tier(gpu_service, method):
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


def test_scattered_rows_of_a_paged_cache(gpu_service, method):
    with kvtier.Client(gpu_service.socket) as c:
        ns = c.namespace("paged", block_bytes=BB)
        cache = torch.randn(512, BB // 2, dtype=torch.bfloat16, device="cuda")   # 512 pages
        pages = np.random.default_rng(0).permutation(512)[:100]
        ns.put(keys(range(100)), cache, rows=pages)         # from scattered pages
        other = torch.full_like(cache, 7.0)
        dest = np.random.default_rng(1).permutation(512)[:100]
        found, _ = ns.get(keys(range(100)), out=other, rows=dest)   # into other pages
        assert found.all()
        assert torch.equal(other[torch.as_tensor(dest, device="cuda")],
                           cache[torch.as_tensor(pages, device="cuda")])
        untouched = np.setdiff1d(np.arange(512), dest)
        assert (other[torch.as_tensor(untouched, device="cuda")] == 7.0).all()


@pytest.mark.parametrize("words", [2048, 513])
def test_both_kernels_move_exactly_the_named_pages(words: int, method):
    # Even widths take the 16-byte kernel, odd ones the 8-byte one; pages not named keep their
    # poison, in both directions. (The layout tests below cover many blocks per page group.)
    rng, host, seg, dev = _segment_case(words, 300, 400, words)
    try:
        # 2048: a dense run of slots, in any order (staged where the policy stages);
        # 513: slots scattered over the segment (the kernel reads them in place)
        slots = 50 + rng.permutation(150) if words == 2048 else rng.permutation(300)[:160]
        rows = rng.permutation(400)[:slots.size]
        _both_ways(seg, host, dev, Stream.resolve(None, 0), slots, rows, 50)
    finally:
        seg.close()


def _segment_case(words: int, n_slots: int, n_rows: int, seed: int):
    """A mapped host segment of n_slots random blocks and a poisoned CUDA tensor of n_rows."""
    import mmap
    rng = np.random.default_rng(seed)
    region = mmap.mmap(-1, n_slots * words * 8)              # page-aligned, as a segment is
    host = np.frombuffer(region, np.uint8).reshape(n_slots, words * 8)
    host[:] = rng.integers(0, 256, host.shape, dtype=np.uint8)
    dev = torch.full((n_rows, words * 8), 0xAB, dtype=torch.uint8, device="cuda")
    return rng, host, MappedSegment(host), dev


def _both_ways(seg, host: np.ndarray, dev, st: Stream, slots: np.ndarray, rows: np.ndarray,
               back: int) -> Mover:
    """Slots into rows (unnamed rows keep dev's poison 0xAB), then the first ``back`` rows
    into their slots of a host poisoned with 0x11 (unnamed slots keep it)."""
    staging = Staging(st)
    mover = Mover(seg, target_table(dev, host.shape[1]), st, transfer.policy(), staging)
    mover.move(slots, rows, 0, 1, False)
    mover.event().synchronize()
    got = dev.cpu().numpy()
    assert (got[rows] == host[slots]).all()
    assert (got[np.setdiff1d(np.arange(dev.shape[0]), rows)] == 0xAB).all()
    host[:] = 0x11
    mover.move(slots[:back], rows[:back], 0, 1, True)
    mover.event().synchronize()
    assert (host[slots[:back]] == got[rows[:back]]).all()
    assert (host[np.setdiff1d(np.arange(host.shape[0]), slots[:back])] == 0x11).all()
    staging.release()
    return mover


def test_a_staged_offload_writes_only_its_own_slots(monkeypatch):
    # Slots in three runs with other blocks' slots between them (a put into a fragmented
    # tier), pieces of 8 blocks so that each run is several pieces and both staging buffers
    # are reused: the named slots get their rows' bytes, every other slot keeps its bytes.
    from kvtier.gpu import device
    monkeypatch.setattr(device, "OUT_STAGE_BYTES", 8 * 4096)
    transfer.set_policy(TransferPolicy(copy_engine_bytes=1 << 40))
    rng, host, seg, dev = _segment_case(512, 200, 120, 4)
    try:
        dev.random_(0, 255)
        slots = rng.permutation(np.r_[10:40, 60:61, 100:150])
        rows = rng.permutation(120)[:slots.size]
        before = host.copy()
        st = Stream.resolve(torch.cuda.Stream(), 0)
        st.wait(Stream.resolve(None, 0).event())             # dev is written first
        staging = Staging(st)
        mover = Mover(seg, target_table(dev, 4096), st, transfer.policy(), staging)
        mover.move(slots, rows, 0, 1, True)
        mover.event().synchronize()
        assert mover.staged
        assert (host[slots] == dev.cpu().numpy()[rows]).all()
        others = np.setdiff1d(np.arange(200), slots)
        assert (host[others] == before[others]).all()
        staging.release()
    finally:
        transfer.set_policy(None)
        seg.close()


@pytest.mark.parametrize("ahead,items", [(True, True), (False, True), (True, False)],
                         ids=["indices-ahead", "indices-per-piece", "pages-kernel"])
def test_stage_sorted_places_every_page_of_a_dense_range_and_times_each_piece(
        monkeypatch, ahead, items):
    # 147 blocks of a dense slot range (20..170 less three), in any order, into scattered rows
    # of 4 page tensors of 4 KiB (place_items16: 16 pages a thread block at once), pieces of
    # 64 KiB of the range and three of them copied ahead, so each staging buffer is reused
    # about a dozen times (a copy waits for its buffer's last placement): every named page
    # holds its slot's bytes, every other keeps its poison, and each piece left four timing
    # events (copy, placement) in the trace, the placement after its copy.
    from kvtier.gpu import device
    from kvtier.gpu.plan import sorted_pieces
    monkeypatch.setattr(device, "SORTED_RING_BYTES", 3 * (64 << 10))
    page = 4096
    rng, host, seg, _dev = _segment_case(4 * page // 8, 300, 1, 8)
    layers = [torch.full((200, page), 0xAB, dtype=torch.uint8, device="cuda")
              for _ in range(4)]
    try:
        slots = rng.permutation(np.setdiff1d(np.arange(20, 170), [33, 90, 91]))
        rows = rng.permutation(200)[:slots.size]
        table = target_table(Pages.from_layers(layers), 4 * page)
        st = Stream.resolve(None, 0)
        staging = Staging(st)
        pol = TransferPolicy(stage_piece_bytes=64 << 10, stage_items_kernel=items)
        mover = Mover(seg, table, st, pol, staging)
        mover.upload_ahead, mover.trace = ahead, []
        assert mover.stage_sorted(slots, rows, 0, 4)
        mover.event().synchronize()
        pieces = [p for p in sorted_pieces(slots, 4 * page, 64 << 10)[1] if p[1] > p[0]]
        assert mover.staged and len(mover.trace) == len(pieces) > 30
        for p, t in enumerate(layers):
            got = t.cpu().numpy()
            assert (got[rows] == host[slots, p * page:(p + 1) * page]).all()
            assert (np.delete(got, rows, axis=0) == 0xAB).all()
        for marks in mover.trace:
            assert len(marks) == 4 and cupy.cuda.get_elapsed_time(marks[1], marks[2]) >= 0
        staging.release()
    finally:
        seg.close()


def test_batched_copies_move_exactly_the_named_blocks():
    # Copy-engine pages on a stream of the caller's: the copies go to the driver in batches,
    # scattered slots to scattered rows and back; unnamed rows and slots keep their poison.
    transfer.set_policy(TransferPolicy(copy_engine_bytes=0, batch_copies=16))
    rng, host, seg, dev = _segment_case(512, 300, 400, 5)
    try:
        slots, rows = rng.permutation(300)[:150], rng.permutation(400)[:150]
        st = Stream.resolve(torch.cuda.Stream(), 0)
        st.wait(Stream.resolve(None, 0).event())             # the poison is written first
        assert _both_ways(seg, host, dev, st, slots, rows, 70).batched
    finally:
        transfer.set_policy(None)
        seg.close()


def test_async_get_holds_its_leases_until_its_event_completes(gpu_service, method):
    # The copies queue behind 200 ms of other work on the caller's stream: the call returns at
    # once, the lease stays while they are in flight, and ends only when the event has
    # completed; a model runs on another stream meanwhile.
    with kvtier.Client(gpu_service.socket) as c:
        ns = c.namespace("async", block_bytes=BB)
        src = torch.randint(0, 255, (300, BB), dtype=torch.uint8, device="cuda")
        ns.put(keys(range(300)), src)
        model, _a = _busy_model()
        copy_stream = torch.cuda.Stream()
        out = torch.zeros_like(src)
        copy_stream.wait_stream(torch.cuda.current_stream())     # out is zeroed first
        _sleep(copy_stream)
        h = ns.get_async(keys(range(300)), out=out, stream=copy_stream)
        assert not h.done() and not h.event.done
        assert c.stats()["leases"] == 1                  # held while the copies may read
        found = h.wait()
        assert found.all() and h.done()
        torch.cuda.current_stream().wait_stream(copy_stream)
        assert torch.equal(out, src)
        model.synchronize()
        assert c.stats()["leases"] == 0                  # released by the next request


def test_async_put_commits_only_after_its_copies_complete(gpu_service, method):
    with kvtier.Client(gpu_service.socket) as c:
        ns = c.namespace("aput", block_bytes=BB)
        src = torch.randint(0, 255, (200, BB), dtype=torch.uint8, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())                # src is written first
        _sleep(s)
        h = ns.put_async(keys(range(200)), src, stream=s)
        host = np.empty((200, BB), np.uint8)
        assert not ns.get(keys(range(200)), out=host)[0].any()     # not committed yet
        assert c.stats()["reservations"] == 1
        versions = h.wait()
        assert versions.tolist() == [1] * 200
        assert ns.get(keys(range(200)), out=host)[0].all()
        assert (host == src.cpu().numpy()).all()
        assert c.stats()["reservations"] == 0


def test_per_layer_events_let_each_layer_be_used_alone(gpu_service, method):
    # 4 layers, K and V apart (vLLM's (2, num_blocks, ...) per-layer tensors): 8 pages per
    # block, one event per layer; a "compute" stream waits for layer i only and copies it out.
    caches = [torch.randn(2, NB, TOK, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
              for _ in range(LAYERS)]
    pages = Pages.from_layers(caches, block_dim=1)
    assert len(pages.views) == 2 * LAYERS and pages.block_bytes == VLLM_BB
    with kvtier.Client(gpu_service.socket) as c:
        ns = c.namespace("layers", block_bytes=VLLM_BB)
        ids = np.random.default_rng(4).permutation(NB)[:40]
        assert ns.put_async(keys(range(40)), pages, rows=ids, layers=LAYERS).wait().all()
        fresh = [torch.zeros_like(t) for t in caches]
        dst = Pages.from_layers(fresh, block_dim=1)
        load = torch.cuda.Stream()
        compute = torch.cuda.Stream()
        load.wait_stream(torch.cuda.current_stream())            # fresh is zeroed first
        _sleep(load, 50)
        h = ns.get_async(keys(range(40)), out=dst, rows=ids, stream=load, layers=LAYERS)
        assert len(h.events) == LAYERS
        # Staged: a copy and a short kernel per layer; the kernel from host memory: all layers
        # in one launch; copy engines: a copy per page.
        assert (h.staged, h.one_launch) == {"kernel": (False, True),
                                            "copy_engine": (False, False)}.get(method,
                                                                               (True, False))
        seen = []
        idx = torch.as_tensor(ids, device="cuda")
        for i in range(LAYERS):
            h.wait_layer(i, compute)                      # the GPU waits, the host does not
            with torch.cuda.stream(compute):
                seen.append(fresh[i][:, idx].clone())
        h.synchronize_layer(0)
        assert h.events[0].done
        assert h.wait().all()
        compute.synchronize()
        for i in range(LAYERS):
            assert torch.equal(seen[i], caches[i][:, idx])


@pytest.mark.parametrize("ring", [2, 3])
def test_staged_layers_wait_for_a_late_placement_before_reusing_its_buffer(gpu_service, ring):
    # The forked per-layer get: layer l's copy goes into staging buffer l % ring on the
    # caller's stream, its placement runs on the kernel stream. With the kernel stream held
    # up (a sleep queued on it first), the copies run ahead until each buffer's next copy
    # must wait for the placement that last read it; a missing wait would let layer l + ring
    # overwrite buffer l before its placement read it, and layer l would get its bytes.
    pol = TransferPolicy(**_K, layer_fork=True, layer_ring=ring)
    transfer.set_policy(pol)
    layers = 8
    caches = [torch.randn(NB, 2, TOK, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
              for _ in range(layers)]
    bb = layers * 2 * PAGE
    try:
        with kvtier.Client(gpu_service.socket) as c:
            ns = c.namespace("late", block_bytes=bb)
            ids = np.random.default_rng(6).permutation(NB)[:48]
            ns.put(keys(range(48)), Pages.from_layers(caches), rows=ids)
            fresh = [torch.zeros_like(t) for t in caches]
            load = torch.cuda.Stream()
            load.wait_stream(torch.cuda.current_stream())        # fresh is zeroed first
            kernel_stream = own(torch.cuda.current_device(), "kernel-0", high_priority=True)
            _sleep(kernel_stream.owner, 100)
            h = ns.get_async(keys(range(48)), out=Pages.from_layers(fresh), rows=ids,
                             stream=load, layers=layers)
            assert h.staged and len(h.events) == layers
            assert h.wait().all()
            idx = torch.as_tensor(ids, device="cuda")
            for i in range(layers):
                assert torch.equal(fresh[i][idx], caches[i][idx]), f"layer {i} of ring {ring}"
    finally:
        transfer.set_policy(None)


def test_blocks_of_both_vllm_layouts_are_the_same_bytes(gpu_service, method):
    # Per-layer pages of (num_blocks, 2, ...) tensors (block_dim 0, one page per layer), put from
    # scattered blocks; read back as BLHNC rows (one row a block) they are the concatenation of
    # the pages; and rows put back load into per-layer tensors again.
    caches = [torch.randn(NB, 2, TOK, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
              for _ in range(LAYERS)]
    pages = Pages.from_layers(caches, block_dim=0)
    with kvtier.Client(gpu_service.socket) as c:
        ns = c.namespace("layouts", block_bytes=VLLM_BB)
        ids = np.random.default_rng(5).permutation(NB)[:30]
        ns.put(keys(range(30)), pages, rows=ids)
        rows = torch.zeros(30, LAYERS, 2, TOK, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
        assert ns.get(keys(range(30)), out=rows)[0].all()
        idx = torch.as_tensor(ids, device="cuda")
        assert torch.equal(rows, torch.stack([t[idx] for t in caches], dim=1))
        ns.put(keys(range(100, 130)), rows)                         # BLHNC rows in
        back = [torch.zeros_like(t) for t in caches]
        assert ns.get(keys(range(100, 130)), out=Pages.from_layers(back), rows=ids)[0].all()
        for t, b in zip(caches, back):
            assert torch.equal(b[idx], t[idx])


def test_bad_cuda_arguments_are_refused_with_what_to_do(gpu_service):
    with kvtier.Client(gpu_service.socket) as c:
        ns = c.namespace("bad", block_bytes=BB)
        out = torch.zeros(4, BB, dtype=torch.uint8, device="cuda")
        with pytest.raises(BadRequest, match="stream must be"):
            ns.get_async(keys(range(4)), out=out, stream="fast")
        with pytest.raises(BadRequest, match="stream must be"):
            ns.put_async(keys(range(4)), out, stream="fast")
        with pytest.raises(BadRequest, match="do not split into 3"):
            ns.get_async(keys(range(4)), out=out, layers=3)
        with pytest.raises(BadRequest, match="0..3"):
            ns.get(keys(range(2)), out=out, rows=[0, 9])
        with pytest.raises(BadRequest, match="contiguous"):
            ns.get(keys(range(2)), out=out[:, :BB // 2].t())
        wrong = Pages.from_layers([torch.zeros(4, 100, dtype=torch.uint8, device="cuda")])
        with pytest.raises(BadRequest, match="namespace's blocks are"):
            ns.put(keys(range(2)), wrong)
        assert c.stats()["leases"] == 0 and c.stats()["reservations"] == 0
        ns.put(keys(range(4)), out)          # the connection is in step: no reply left unread
        assert ns.get(keys(range(4)), out=torch.empty_like(out))[0].all()
        # A chunked get sends its requests before it builds its device side (transfer.
        # get_async): stored keys are leased first, and a bad stream or rows then raise with
        # every lease ended and the connection in step.
        with pytest.raises(BadRequest, match="stream must be"):
            ns.get_async(keys(range(4)), out=out, stream="fast")
        with pytest.raises(BadRequest, match="0..3"):
            ns.get_async(keys(range(2)), out=out, rows=[0, 9])
        assert c.stats()["leases"] == 0
        back = torch.zeros_like(out)
        assert ns.get_async(keys(range(4)), out=back).wait().all()
        assert torch.equal(back, out)


def test_a_put_refused_part_way_commits_nothing_and_holds_nothing(tmp_path: Path, monkeypatch):
    # Chunks of 16, 64, 64 and 36 keys into a host tier of 64 slots: the second and third
    # reserves fail; the first chunk's copies, launched as its reply came, are waited for, the
    # first and last reservations aborted; no key is stored (or the first chunk, whole, where
    # its copies had completed when its reply was handled: committed early).
    from kvtier.api import pipeline
    monkeypatch.setattr(pipeline, "CUDA_PUT_CHUNK", 64)
    svc = Service(tmp_path / "svc", admin=False, host_capacity="1MiB",
                  nvme_capacity="0").start()
    try:
        with kvtier.Client(svc.socket) as c:
            ns = c.namespace("full", block_bytes=BB)
            src = torch.randint(0, 255, (180, BB), dtype=torch.uint8, device="cuda")
            with pytest.raises(CapacityError):
                ns.put(keys(range(180)), src)
            host = np.empty((40, BB), np.uint8)    # gets under the pin cap (48 of 64 slots)
            found = []
            for lo in range(0, 180, 40):
                ids = range(lo, min(lo + 40, 180))
                found += ns.get(keys(ids), out=host[:len(ids)])[0].tolist()
            assert found in ([False] * 180, [True] * 16 + [False] * 164)
            c.ping()                                 # the last release has ridden on it
            st = c.stats()
            assert st["reservations"] == 0 and st["leases"] == 0
            assert st["puts"] == sum(found)
    finally:
        svc.stop()


_FAULT = r"""
import sys, numpy as np, torch, cupy, kvtier
from tests.conftest import blocks, keys
sock, mode = sys.argv[1], sys.argv[2]
n = 2500                                     # four pipelined chunks
c = kvtier.Client(sock)
ns = c.namespace("fault-" + mode, block_bytes=4096)
if mode == "get":
    ns.put(keys(range(n)), blocks(n, 4096))  # from host memory
dev = torch.zeros(n, 4096, dtype=torch.uint8, device="cuda")
if mode == "credit":                         # a put before, whose credit the failing one uses
    from kvtier.gpu import transfer
    from kvtier.gpu.plan import TransferPolicy
    transfer.set_policy(TransferPolicy(put_credits=True))
    ns.put_async(keys(range(n, 2 * n)), dev).wait()
    assert c.stats()["credits"] == 1
s = torch.cuda.Stream()
bad = cupy.RawKernel('extern "C" __global__ void k(unsigned long long* p) { p[0] = 1; }', "k")
with cupy.cuda.ExternalStream(s.cuda_stream):
    bad((1,), (1,), (np.uint64(16),))        # an illegal address: the stream's next work fails
try:
    if mode == "get":
        ns.get_async(keys(range(n)), out=dev, stream=s).wait()
    else:
        ns.put_async(keys(range(n)), dev, stream=s).wait()
    print("completed")
except Exception as exc:
    print("failed", type(exc).__name__)
host = np.empty((n, 4096), np.uint8)
print("found", int(ns.get(keys(range(n)), out=host)[0].sum()))
if mode == "credit":
    print("found before", int(ns.get(keys(range(n, 2 * n)), out=host)[0].sum()))
st = c.stats()
print("held", st["reservations"], st["leases"], st["puts"])
sys.stdout.flush()
import os; os._exit(0)                       # the CUDA context is lost: no orderly close
"""


@pytest.mark.parametrize("mode", ["get", "put", "credit"])
def test_a_transfer_whose_copies_fail_on_the_gpu_ends_its_holds_and_never_commits(
        gpu_service, mode):
    # A real device fault (an illegal address ahead of the copies on the caller's stream) in a
    # process of its own, since it ends that process's CUDA context: the get's four leases are
    # released, the put's reservations aborted, nothing is committed. "credit": the failing
    # put's first chunk went into the credit a put before it asked for; that credit is aborted
    # too, and the earlier put's blocks stay.
    out = subprocess.run([sys.executable, "-c", _FAULT, str(gpu_service.socket), mode],
                         capture_output=True, text=True, timeout=180,
                         cwd=Path(__file__).resolve().parent.parent)
    lines = out.stdout.split("\n")
    assert lines[0].startswith("failed"), out.stdout + out.stderr
    found = 2500 if mode == "get" else 0
    assert f"found {found}" in lines, out.stdout + out.stderr
    puts = {"get": 2500, "put": 0, "credit": 2500}[mode]
    assert f"held 0 0 {puts}" in lines, out.stdout + out.stderr
    if mode == "credit":
        assert "found before 2500" in lines, out.stdout + out.stderr


@pytest.mark.parametrize("geometry", [(16384,), (65536,), (4096,) * 16, (2 << 20,)],
                         ids=["16k", "64k", "16-pages", "2m"])
def test_the_gpu_checksum_is_the_services_xxh3(geometry):
    n = 24 if geometry[0] < (1 << 20) else 3
    views = [torch.randint(0, 255, (n + 5, p), dtype=torch.uint8, device="cuda")
             for p in geometry]
    pages = Pages(tuple(views))
    table = target_table(pages, pages.block_bytes)
    st = Stream.resolve(None, 0)
    staging = Staging(st)
    rows = np.random.default_rng(len(geometry)).permutation(n + 5)[:n]
    side = own(0, "checksums")
    addr = Mover(None, table, st, transfer.policy(), staging).checksums(rows, side)
    side.event().synchronize()
    import ctypes
    got = np.ctypeslib.as_array((ctypes.c_uint64 * n).from_address(addr)).copy()
    host = [v.cpu().numpy() for v in views]
    want = [xxhash.xxh3_64_intdigest(b"".join(h[r].tobytes() for h in host)) for r in rows]
    staging.release()
    assert got.tolist() == want


def _back_checked(c, ns, want) -> None:
    """The 400 blocks of ns (put 50 at a time) read back in batches of 50 are want, and none
    failed its checksum (most come from NVMe)."""
    out = torch.zeros_like(want)
    for lo in range(0, 400, 50):
        found, _ = ns.get(keys(range(lo, lo + 50)), out=out[lo:lo + 50])
        assert found.all()
    assert torch.equal(out, want)
    st = c.stats()
    assert st["checksum_failures"] == 0 and st["puts"] == 400


@pytest.fixture
def small_host(tmp_path: Path):
    """A service whose host tier holds 128 blocks of BB, over NVMe."""
    svc = Service(tmp_path / "svc", admin=False, host_capacity="2MiB",
                  nvme_capacity="64MiB").start()
    try:
        yield svc
    finally:
        svc.stop()


def test_an_offload_checksummed_on_the_gpu_is_verified_back_from_nvme(small_host):
    # The service records the GPU's checksums without hashing; blocks pushed out of a small
    # host tier come back from NVMe checked against them.
    with kvtier.Client(small_host.socket) as c:
        ns = c.namespace("nvme", block_bytes=BB)
        src = torch.randint(0, 255, (400, BB), dtype=torch.uint8, device="cuda")
        for lo in range(0, 400, 50):              # under the pin cap (96 of 128 slots)
            ns.put(keys(range(lo, lo + 50)), src[lo:lo + 50])
        _back_checked(c, ns, src)


def test_a_puts_gpu_hash_sees_the_writes_enqueued_before_it(small_host):
    # put_async's hash forks from the caller's stream: blocks written on that stream just
    # before the put (not waited for) are hashed as written. Pushed out of a small host tier, they come back from NVMe checked against
    # the GPU's sums: a hash of the old bytes would fail that check.
    with kvtier.Client(small_host.socket) as c:
        ns = c.namespace("fresh", block_bytes=BB)
        stream = torch.cuda.Stream()
        src = torch.zeros(400, BB, dtype=torch.uint8, device="cuda")
        big = torch.randn(4096, 4096, device="cuda")
        want = torch.randint(0, 255, (400, BB), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        for lo in range(0, 400, 50):
            with torch.cuda.stream(stream):
                for _ in range(4):                   # keep the stream busy first
                    big = big @ big / 64
                src[lo:lo + 50].copy_(want[lo:lo + 50])
            ns.put_async(keys(range(lo, lo + 50)), src[lo:lo + 50], stream=stream).wait()
        _back_checked(c, ns, want)


def test_a_single_block_get(gpu_service):
    with kvtier.Client(gpu_service.socket) as c:
        ns = c.namespace("one", block_bytes=BB)
        src = torch.randint(0, 255, (8, BB), dtype=torch.uint8, device="cuda")
        ns.put(keys(range(8)), src)
        out = torch.zeros(1, BB, dtype=torch.uint8, device="cuda")
        for i in range(8):
            assert ns.get(keys([i]), out=out)[0].all()
            assert torch.equal(out[0], src[i])
        assert c.stats()["leases"] <= 1          # the last release rides on the next request


def test_a_get_keeps_its_page_table_and_slab_while_others_reuse_theirs(gpu_service, method):
    # Session 40: page tables stay on the device between transfers (device.on_device) and
    # finished transfers' upload slabs go to the next (staging._slabs). A get queued behind a
    # second of work keeps both while the cache starts over, new device memory is handed out
    # and overwritten, and a second get runs and finishes beside it: both move the right
    # bytes, the first's table copy is not the one the cache then holds, and no slab of it
    # went to the second.
    from kvtier.gpu import device, staging
    with kvtier.Client(gpu_service.socket) as c:
        ns = c.namespace("kept", block_bytes=BB)
        src = torch.randint(0, 255, (512, BB), dtype=torch.uint8, device="cuda")
        ns.put(keys(range(512)), src)
        rows = np.random.default_rng(2).permutation(1024)[:512]
        out_a = torch.zeros(1024, BB, dtype=torch.uint8, device="cuda")
        out_b = torch.zeros_like(out_a)
        slow, quick = torch.cuda.Stream(), torch.cuda.Stream()
        cupy.full(1, -1, dtype=cupy.int64)   # its kernel compiled before the hold, not in it
        torch.cuda.synchronize()
        _sleep(slow, 1000)
        a = ns.get_async(keys(range(512)), out=out_a, rows=rows, stream=slow)
        kept_a = [s.data.ptr for _d, s in a._staging._slabs]
        tables_a = [k for k in a._staging._keep if isinstance(k, device._OnDevice)]
        device._on_device.clear()         # a's table copy now lives in a's staging alone
        junk = [cupy.full(1 << 10, -1, dtype=cupy.int64) for _ in range(256)]
        b = ns.get_async(keys(range(512)), out=out_b, rows=rows[::-1].copy(), stream=quick)
        # a is still queued (b's kernels may queue behind it on kvtier's kernel stream, so b
        # is not waited for first): the checks below are of both in flight.
        assert not a.done()
        assert not {s.data.ptr for _d, s in b._staging._slabs} & set(kept_a)
        if tables_a:                      # a kernel path: a's table was copied to the device
            again = device.on_device(device.target_table(out_a, BB))
            assert again.address != tables_a[0].address
        assert b.wait().all() and a.wait().all()
        torch.cuda.synchronize()
        idx = torch.as_tensor(rows, device="cuda")
        assert torch.equal(out_a[idx], src) and torch.equal(out_b[idx.flip(0)], src)
        del junk
        # Finished: the slabs are kept for the next get, and a table in the cache is not
        # uploaded again.
        dev = torch.cuda.current_device()
        assert len(staging._slabs.get(dev, [])) >= (1 if kept_a else 0)
        tables = len(device._on_device)
        out_b.zero_()
        assert ns.get(keys(range(512)), out=out_b, rows=rows)[0].all()
        assert len(device._on_device) == tables
        assert torch.equal(out_b[idx], src)


def test_a_64k_onboard_with_a_kernel_share_moves_each_block_by_one_of_the_two(gpu_service):
    # TransferPolicy.kernel_share: a quarter of each chunk's blocks read by the kernel beside
    # the batched copies of the rest; every row gets its own block's bytes, the rows not asked
    # for keep theirs.
    transfer.set_policy(TransferPolicy(kernel_share=0.25))
    try:
        with kvtier.Client(gpu_service.socket) as c:
            ns = c.namespace("share64k", block_bytes=65536)
            n = 300
            src = torch.randint(0, 255, (n, 65536), dtype=torch.uint8, device="cuda")
            assert ns.put(keys(range(n)), src).all()
            out = torch.full((n + 20, 65536), 7, dtype=torch.uint8, device="cuda")
            dest = np.random.default_rng(8).permutation(n + 20)[:n]
            order = np.random.default_rng(9).permutation(n)
            st = torch.cuda.Stream()
            st.wait_stream(torch.cuda.current_stream())
            h = ns.get_async(keys(order.tolist()), out=out, rows=dest, stream=st)
            assert h.methods == {"copy_engine", "kernel"} and h.batched
            assert h.wait().all()
            assert torch.equal(out[torch.as_tensor(dest, device="cuda")],
                               src[torch.as_tensor(order, device="cuda")])
            rest = np.setdiff1d(np.arange(n + 20), dest)
            assert bool((out[torch.as_tensor(rest, device="cuda")] == 7).all())
            assert c.stats()["leases"] <= 1
    finally:
        transfer.set_policy(None)


def test_a_64k_row_onboard_goes_by_copy_engines_and_its_offload_by_the_kernel(gpu_service):
    # The default policy: a get of 64 KiB rows host to GPU by batched copy engines, on a
    # non-default stream beside work on torch's; the put of the same rows by the kernel.
    with kvtier.Client(gpu_service.socket) as c:
        ns = c.namespace("ce64k", block_bytes=65536)
        n = 300
        src = torch.randint(0, 255, (n, 65536), dtype=torch.uint8, device="cuda")
        rows = np.random.default_rng(5).permutation(n)
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        p = ns.put_async(keys(range(n)), src, rows=rows, stream=st)
        assert "kernel" in p.methods and "copy_engine" not in p.methods
        assert p.wait().tolist() == [1] * n
        out = torch.full_like(src, 7)
        dest = np.random.default_rng(6).permutation(n)
        order = np.random.default_rng(7).permutation(n)      # slots scattered over the rows
        st.wait_stream(torch.cuda.current_stream())
        h = ns.get_async(keys(order.tolist()), out=out, rows=dest, stream=st)
        assert h.methods == {"copy_engine"} and h.batched
        assert h.wait().all()
        assert torch.equal(out[torch.as_tensor(dest, device="cuda")],
                           src[torch.as_tensor(rows[order], device="cuda")])
        assert c.stats()["leases"] <= 1


@pytest.mark.parametrize("bb,prepare,default_stream", [
    (65536, True, False), (65536, True, True), (16384, True, False), (16384, True, True),
    (16384, False, False)], ids=["64k", "64k-default-stream", "16k", "16k-default-stream",
                                 "16k-unprepared"])
def test_a_chunked_get_moves_exactly_its_blocks_and_records_its_timeline(
        gpu_service, bb, prepare, default_stream):
    # 2,500 keys, four chunks: 64 KiB pages by batched copies (on torch's legacy default
    # stream forked onto kvtier's copies stream), 16 KiB by the kernel whose launch was set
    # up before the first reply (or not); the bytes land in the named rows only, and
    # transfer.TRACE records each chunk's reply, enqueue and GPU start and end. (Sorted gets
    # off: under "auto" a host whose probe prefers them would sort the 16 KiB get.)
    transfer.set_policy(TransferPolicy(prepare_launch=prepare, sorted_gets="off"))
    try:
        with kvtier.Client(gpu_service.socket) as c:
            ns = c.namespace(f"chunked{bb}", block_bytes=bb)
            n = 2500
            src = torch.randint(0, 255, (n, bb), dtype=torch.uint8, device="cuda")
            ns.put(keys(range(n)), src)
            out = torch.full((n + 40, bb), 7, dtype=torch.uint8, device="cuda")
            dest = np.random.default_rng(8).permutation(n + 40)[:n]
            order = np.random.default_rng(9).permutation(n)
            st = None if default_stream else torch.cuda.Stream()
            if st is not None:
                st.wait_stream(torch.cuda.current_stream())
            transfer.TRACE = []
            try:
                h = ns.get_async(keys(order.tolist()), out=out, rows=dest, stream=st)
                tr = transfer.TRACE[0]
            finally:
                transfer.TRACE = None
            assert h.methods == ({"copy_engine"} if bb == 65536 else {"kernel"})
            assert h.wait().all()
            torch.cuda.synchronize()
            assert torch.equal(out[torch.as_tensor(dest, device="cuda")],
                               src[torch.as_tensor(order, device="cuda")])
            rest = np.setdiff1d(np.arange(n + 40), dest)
            assert (out[torch.as_tensor(rest, device="cuda")] == 7).all()
            assert len(tr["chunks"]) == 4
            for _reply, _before, after, _enq in tr["chunks"]:
                assert cupy.cuda.get_elapsed_time(tr["start"][0], after[0]) > 0
            assert c.stats()["leases"] <= 1
    finally:
        transfer.set_policy(None)


@pytest.mark.parametrize("bb,piece,keys_per", [(65536, 1 << 20, 256), (16384, 16 << 20, 64),
                                               (4096, 64 << 10, 100)],
                         ids=["64k-small-pieces", "16k-many-replies", "4k-tiny-pieces"])
def test_a_dense_batch_asked_in_any_key_order_moves_in_slot_order(gpu_service, bb, piece,
                                                                  keys_per):
    # A batch put together (dense slots) asked in another key order, into scattered rows, some
    # keys missing: leased in the service's slot order (api.sortedgets: piece 0, a quarter of
    # keys_per keys, as a chunk; then pieces of keys_per in slot order), each later reply's
    # slot range piece by piece (copy engine into staging, the kernel from there; small pieces
    # so that the staging ring is reused many times, across replies too). Every found row
    # holds its block, every other row keeps its poison.
    transfer.set_policy(TransferPolicy(sorted_gets="on", stage_piece_bytes=piece,
                                       sorted_piece_keys=keys_per))
    try:
        with kvtier.Client(gpu_service.socket) as c:
            ns = c.namespace(f"sorted{bb}", block_bytes=bb)
            n = 600
            src = torch.randint(0, 255, (n, bb), dtype=torch.uint8, device="cuda")
            st = torch.cuda.Stream()
            st.wait_stream(torch.cuda.current_stream())
            ns.put_async(keys(range(n)), src, stream=st).wait()
            rng = np.random.default_rng(bb)
            order = rng.permutation(n + 40)              # 40 keys never put: not found
            dest = rng.permutation(n + 40)
            out = torch.full((n + 40, bb), 7, dtype=torch.uint8, device="cuda")
            st.wait_stream(torch.cuda.current_stream())
            h = ns.get_async(keys(order.tolist()), out=out, rows=dest, stream=st)
            assert h.staged and {"copy_engine", "kernel"} <= h.methods
            found = h.wait()
            assert found.tolist() == (order < n).tolist()
            got = out[torch.as_tensor(dest[found], device="cuda")]
            assert torch.equal(got, src[torch.as_tensor(order[found], device="cuda")])
            assert (out[torch.as_tensor(dest[~found], device="cuda")] == 7).all()
            assert ns._whole_skip == 0
            c.ping()
            assert c.stats()["leases"] == 0
    finally:
        transfer.set_policy(None)


def test_the_mapped_read_probe_decides_auto_sorted_gets(gpu_service, monkeypatch):
    # The probe measures this host (kernel reads of mapped memory against a copy engine); a
    # 16 KiB get of scattered rows then goes sorted (staged, by copy engines) exactly where
    # the ratio is under the floor, and moves the right bytes either way.
    from kvtier.gpu import probe
    monkeypatch.setattr(probe, "_results", {})
    dev = torch.cuda.current_device()
    r = probe.measure(dev)
    assert "error" not in r, r
    assert 0 < r["kernel_gbps"] and 0 < r["copy_gbps"] and 0 < r["ratio"] < 3
    assert r["sorted"] == (r["ratio"] < TransferPolicy().mapped_read_floor)
    n = 4096                 # chunks of 1,024 scattered keys: no chunk's slots are dense
    for floor in (0.0, 1.0):             # never sorted; sorted unless the kernel outruns DMA
        transfer.set_policy(TransferPolicy(mapped_read_floor=floor))
        try:
            with kvtier.Client(gpu_service.socket) as c:
                ns = c.namespace(f"probe{int(floor)}", block_bytes=BB)
                src = torch.randint(0, 255, (n, BB), dtype=torch.uint8, device="cuda")
                ns.put(keys(range(n)), src)
                rows = np.random.default_rng(8).permutation(2 * n)[:n]
                out = torch.zeros((2 * n, BB), dtype=torch.uint8, device="cuda")
                order = np.random.default_rng(9).permutation(n)
                h = ns.get_async(keys(order.tolist()), out=out, rows=rows)
                assert h.wait().all()
                assert h.staged == (r["ratio"] < floor)
                idx = torch.as_tensor(rows, device="cuda")
                assert torch.equal(out[idx], src[torch.as_tensor(order, device="cuda")])
        finally:
            transfer.set_policy(None)


def test_a_sparse_whole_get_moves_as_before_and_the_next_ones_go_in_chunks(gpu_service):
    # Every other key of a batch: its slots span twice their count, so the sorted pieces are
    # not staged; its bytes are still right, and the namespace's next gets go in chunks.
    transfer.set_policy(TransferPolicy(sorted_gets="on", sorted_piece_keys=64))
    try:
        _sparse_whole_get(gpu_service)
    finally:
        transfer.set_policy(None)


def _sparse_whole_get(gpu_service) -> None:
    with kvtier.Client(gpu_service.socket) as c:
        ns = c.namespace("sparse", block_bytes=BB)
        n = 800
        src = torch.randint(0, 255, (n, BB), dtype=torch.uint8, device="cuda")
        ns.put(keys(range(n)), src)
        half = np.arange(0, n, 2)
        out = torch.zeros((half.size, BB), dtype=torch.uint8, device="cuda")
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        h = ns.get_async(keys(half.tolist()), out=out, stream=st)
        assert h.wait().all() and not h.staged
        assert torch.equal(out, src[torch.as_tensor(half, device="cuda")])
        assert ns._whole_skip == transfer.SPARSE_RETRY
        ns.get_async(keys(half.tolist()), out=out, stream=st).wait()
        assert ns._whole_skip == transfer.SPARSE_RETRY - 1


def test_a_put_commits_its_first_chunks_while_it_reads_the_later_reserves(
        gpu_service, monkeypatch):
    # Chunks of 64 keys (the first 16): each chunk's commit goes out as soon as its copies
    # and the GPU hash have completed, here held back until every reserve was sent and the
    # first chunk's copies ran (a wait on the host for its event); put_async then returns with
    # commits already sent, and every version is 1.
    from kvtier.api import pipeline
    monkeypatch.setattr(pipeline, "CUDA_PUT_CHUNK", 64)
    monkeypatch.setattr(pipeline, "CUDA_PUT_CHUNK_MIN", 64)
    real = transfer._reserved

    def reserved(c, mover, chunks, ids, src_rows, groups, error, early=None, *given):
        def slow(parts, ends):
            ends[-1].synchronize()
            torch.cuda.synchronize()               # the hash as well
            early(parts, ends)
        return real(c, mover, chunks, ids, src_rows, groups, error,
                    slow if early is not None else None, *given)
    monkeypatch.setattr(transfer, "_reserved", reserved)
    with kvtier.Client(gpu_service.socket) as c:
        ns = c.namespace("early", block_bytes=BB)
        n = 300
        src = torch.randint(0, 255, (n, BB), dtype=torch.uint8, device="cuda")
        h = ns.put_async(keys(range(n)), src)
        assert len(h._commits) == len(h._parts) == 6
        assert h.wait().tolist() == [1] * n
        host = np.empty((n, BB), np.uint8)
        assert ns.get(keys(range(n)), out=host)[0].all()
        assert (host == src.cpu().numpy()).all()
        transfer.set_policy(TransferPolicy(early_commits=False))
        try:
            h = ns.put_async(keys(range(n)), src)
            assert h._commits == []
            assert h.wait().tolist() == [2] * n
        finally:
            transfer.set_policy(None)
        c.ping()
        st = c.stats()
        assert st["reservations"] == 0 and st["leases"] == 0


def test_a_put_starts_in_the_credit_the_put_before_asked_for(gpu_service, monkeypatch):
    # kvtier.api.credits: a put asks for a credit behind its commits; the next put's first
    # chunk goes into it (its reservation is the credit), the rest reserved as before, and
    # every block of both reads back. A put smaller than the credit hands the rest back; a
    # credit past its use-by is aborted, not used; closing the namespace gives one back.
    from kvtier.api import pipeline
    monkeypatch.setattr(transfer, "_policy", TransferPolicy(put_credits=True))  # off by default
    with kvtier.Client(gpu_service.socket) as c:
        ns = c.namespace("credit", block_bytes=BB)
        n = 3000
        src = torch.randint(0, 255, (n, BB), dtype=torch.uint8, device="cuda")
        ns.put_async(keys(range(n)), src).wait()
        assert c.stats()["credits"] == 1
        size = ns._credits.size()
        asked = ns._credits._asked[0]
        h = ns.put_async(keys(range(n, 2 * n)), src)
        assert h._parts[0][:2] == (0, size)
        assert len(h._parts) == 1 + len(pipeline.cuda_put_chunks(n - size, BB))
        assert asked not in c._stashed and ns._credits._asked is None
        assert h.wait().tolist() == [1] * n
        host = np.empty((n, BB), np.uint8)
        for lo in (0, n):
            assert ns.get(keys(range(lo, lo + n)), out=host)[0].all()
            assert (host == src.cpu().numpy()).all()
        before = c.stats()["tiers"]["host"]["blocks"]          # the held credit's included
        parents = bytes(16) + keys(range(2 * n, 2 * n + 9))
        h = ns.put_async(keys(range(2 * n, 2 * n + 10)), src[:10], parents=parents)
        assert [p[:2] for p in h._parts] == [(0, 10)]
        assert h.wait().tolist() == [1] * 10
        st = c.stats()
        assert st["tiers"]["host"]["blocks"] == before + 10 and st["credits"] == 1
        assert ns.get(keys(range(2 * n, 2 * n + 10)), out=host[:10])[0].all()
        assert (host[:10] == src[:10].cpu().numpy()).all()
        ns._credits._collect(True)
        stale = ns._credits._held.rid
        ns._credits._held.use_by = 0.0
        h = ns.put_async(keys(range(4)), src[:4])
        assert h._parts[0][2] != stale
        assert h.wait().tolist() == [2] * 4
        c.ping()
        assert c.stats()["credits"] == 1                      # the stale one aborted
        ns.close()
        c.ping()
        st = c.stats()
        assert st["reservations"] == st["credits"] == 0 and st["leases"] == 0


@pytest.mark.parametrize("put_chunk", [4096, 1024], ids=["put-one-request", "put-chunked"])
def test_large_cuda_batches_round_trip_in_pipelined_chunks(gpu_service, put_chunk, monkeypatch):
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
        c.ping()
        assert c.stats()["leases"] == 0


@pytest.mark.parametrize("policy", [TransferPolicy(),
                                    TransferPolicy(copy_engine_bytes=0, device_copy_engines=True)],
                         ids=["kernel", "copy_engines"])
def test_hbm_slots_over_the_socket_by_cuda_ipc(tmp_path: Path, policy: TransferPolicy):
    # A service with an HBM tier hands its pools to the worker by CUDA IPC: puts and gets with
    # tier="hbm" move blocks device to device (by the kernel, or by batched copy-engine copies
    # forked off the legacy default stream), the commit writes them through to host, and a
    # later host-tier rewrite makes the HBM copy stale, so the next HBM get brings it up again.
    transfer.set_policy(policy)
    svc = Service(tmp_path / "svc", admin=False, host_capacity="64MiB", nvme_capacity="256MiB",
                  hbm_capacity="64MiB").start()
    try:
        with kvtier.Client(svc.socket) as c:
            ns = c.namespace("hbm", block_bytes=BB)
            src = torch.randint(0, 255, (300, BB), dtype=torch.uint8, device="cuda")
            assert ns.put(keys(range(300)), src, tier="hbm").tolist() == [1] * 300
            out = torch.zeros_like(src)
            dest = np.random.default_rng(8).permutation(300)          # scattered rows
            found, _ = ns.get(keys(range(300)), out=out, rows=dest, tier="hbm")
            assert found.all() and torch.equal(out[torch.as_tensor(dest, device="cuda")], src)
            host = np.empty((300, BB), np.uint8)
            assert ns.get(keys(range(300)), out=host)[0].all()       # written through
            assert (host == src.cpu().numpy()).all()
            new = blocks(10, BB, 4)
            ns.put(keys(range(10)), new)                              # host rewrite: v2
            found, _ = ns.get(keys(range(10)), out=out[:10], tier="hbm")
            assert found.all() and (out[:10].cpu().numpy() == new).all()
            c.ping()
            assert c.stats()["leases"] == 0
    finally:
        transfer.set_policy(None)
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


def test_one_hbm_pool_per_device_shares_one_slot_numbering(tmp_path: Path):
    # Two pools (both on GPU 0 here: the two-GPU host is a separate run): 64 slots each; a
    # batch larger than one pool spans both, reads and writes go to the right allocation, the
    # worker's device is preferred, and each pool is exported by its own IPC handle.
    from kvtier.tiers.hbm import on_device
    pool = HbmPool("two", BB, 64, devices=(0, 0))
    assert pool.n_slots == 128 and pool.free_count == 128
    info = pool.ipc_info()
    assert [p["first"] for p in info["pools"]] == [0, 64] and len(info["pools"]) == 2
    slots = pool.alloc(100)
    assert sorted(slots.tolist()) == list(range(100))
    data = blocks(100, BB, 9)
    pool.write(slots, data)
    assert (pool.read(slots) == data).all()
    pool.free(slots[:70])
    got = on_device(0, pool.alloc, 10)
    assert got is not None and len(set(got.tolist())) == 10
    pool.close()
    eng = Engine(make_settings({"data_dir": str(tmp_path / "d"), "host_capacity": "8MiB",
                                "hbm_capacity": f"{64 * BB}", "nvme_capacity": "0"}),
                 hbm_pool_factory=functools.partial(HbmPool, devices=(0, 0)))
    eng.create_namespace("m", BB)
    data = blocks(120, BB, 2)
    eng.put("m", keys(range(120)), data, tier=Tier.HBM)       # more than one device's pool
    eng.evict(Tier.HOST, 120)
    found, out = eng.read("m", keys(range(120)))              # back up from both pools
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
