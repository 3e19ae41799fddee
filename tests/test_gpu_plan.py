"""The host-side planning of GPU transfers (kvtier.gpu.plan), the GPU checksum's numpy reference
(kvtier.gpu.xxh3) and the trusted commit it feeds: numpy only, so they run on every machine.
The CUDA side of the same code is tests/test_gpu.py (pytest -m gpu)."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvtier.errors import BadRequest
from kvtier.gpu import xxh3
from kvtier.gpu.plan import (Copy, Method, PageTable, TransferPolicy, check_rows, copy_arrays,
                             copy_runs, kernel_launches, page_groups, sorted_pieces,
                             uniform_runs, vector_bytes)
from kvtier.types import Tier
from tests.conftest import blocks, keys

BB = 65536


def _layers(n_layers: int, page: int, num_blocks: int) -> PageTable:
    """Per-layer tensors (num_blocks, page) at made-up 1 GiB-apart device addresses."""
    return PageTable.make([(l + 1) << 30 for l in range(n_layers)], [page] * n_layers,
                          [page] * n_layers, num_blocks, 0)


def test_policy_sends_large_pages_to_copy_engines_and_small_ones_to_the_bounded_kernel():
    p = TransferPolicy()
    assert p.method(2 << 20, 1024, device_to_device=False) is Method.COPY_ENGINE
    assert p.method(64 << 10, 4096, device_to_device=False) is Method.KERNEL
    assert p.method(16 << 10, 32768, device_to_device=False) is Method.KERNEL
    assert p.method(16 << 10, 1, device_to_device=False) is Method.COPY_ENGINE   # one block
    # The HBM tier: the kernel (copy engines device to device, batched, measured 0.20 of a
    # device copy for 2 MiB pages on the H200 against the kernel's 0.58), unless asked.
    assert p.method(2 << 20, 1024, device_to_device=True) is Method.KERNEL
    ce = TransferPolicy(device_copy_engines=True)
    assert ce.method(2 << 20, 1024, device_to_device=True) is Method.COPY_ENGINE
    assert ce.method(64 << 10, 4096, device_to_device=True) is Method.KERNEL
    assert p.blocks(False, 132) == 16 and p.blocks(True, 132) == 264
    assert TransferPolicy(copy_engine_bytes=0).method(4096, 100, False) is Method.COPY_ENGINE


def test_policy_onboards_64k_pages_by_copy_engines_and_keeps_the_kernel_elsewhere():
    p = TransferPolicy()
    # A get's move of 64 KiB pages host to GPU: copy engines; 16 KiB: the kernel.
    assert p.method(64 << 10, 4096, False, onboard=True) is Method.COPY_ENGINE
    assert p.method(32 << 10, 4096, False, onboard=True) is Method.KERNEL
    assert p.method(16 << 10, 4096, False, onboard=True) is Method.KERNEL
    # Offloads and the HBM tier keep the kernel at the same size.
    assert p.method(64 << 10, 4096, False, onboard=False) is Method.KERNEL
    assert p.method(64 << 10, 4096, True, onboard=True) is Method.KERNEL
    # 0 turns the onboard threshold off: copy_engine_bytes alone decides.
    off = TransferPolicy(onboard_copy_engine_bytes=0)
    assert off.method(64 << 10, 4096, False, onboard=True) is Method.KERNEL
    assert off.method(2 << 20, 1024, False, onboard=True) is Method.COPY_ENGINE
    with pytest.raises(BadRequest, match="onboard_copy_engine_bytes"):
        TransferPolicy(onboard_copy_engine_bytes=-1)


def test_a_share_of_small_copy_engine_onboards_goes_to_the_kernel():
    from kvtier.gpu.device import Mover
    m = Mover.__new__(Mover)
    m.policy = TransferPolicy(kernel_share=0.25)
    assert m._kernel_part(1024, 64 << 10, False, False) == 256
    assert m._kernel_part(1000, 64 << 10, False, False) == 250
    # Offloads, device-to-device moves, pages copy engines take anyway, small batches: none.
    assert m._kernel_part(1024, 64 << 10, False, True) == 0
    assert m._kernel_part(1024, 64 << 10, True, False) == 0
    assert m._kernel_part(1024, 2 << 20, False, False) == 0
    assert m._kernel_part(16, 64 << 10, False, False) == 0
    m.policy = TransferPolicy()                          # off by default
    assert m._kernel_part(1024, 64 << 10, False, False) == 0
    for bad in (-0.1, 1.0, 7):
        with pytest.raises(BadRequest, match="kernel_share 0 to below 1"):
            TransferPolicy(kernel_share=bad)


def test_policy_refuses_a_kernel_without_blocks():
    with pytest.raises(BadRequest, match="gpu_kernel_blocks"):
        TransferPolicy(kernel_blocks=0)


def test_policy_refuses_a_layer_ring_of_one_buffer():
    # One staging buffer would make every layer's copy wait for the placement before it.
    with pytest.raises(BadRequest, match="layer_ring >= 2"):
        TransferPolicy(layer_ring=1)
    assert TransferPolicy(layer_ring=4, layer_fork=True).layer_ring == 4


def test_policy_follows_the_settings_table():
    from kvtier.config import make_settings
    s = make_settings({"gpu_copy_engine_bytes": "256KiB", "gpu_kernel_blocks": 16})
    p = TransferPolicy.from_settings(s)
    assert (p.copy_engine_bytes, p.kernel_blocks, p.device_kernel_blocks) == (256 << 10, 16, 0)
    assert p.onboard_copy_engine_bytes == 64 << 10
    off = TransferPolicy.from_settings(make_settings({"gpu_onboard_copy_engine_bytes": "0"}))
    assert off.onboard_copy_engine_bytes == 0
    assert p.place_blocks == 0               # one thread block per SM, the device's count
    assert TransferPolicy.from_settings(make_settings({"gpu_place_blocks": "33"})).place_blocks == 33


@pytest.mark.parametrize("setting, field, refused, garbage", [
    *(("gpu_onboard_copy_engine_bytes", "onboard_copy_engine_bytes",
       "gpu_onboard_copy_engine_bytes", g) for g in ("lots", "-1", "", "1e9")),
    *(("gpu_place_blocks", "place_blocks", "gpu_place_blocks >= 0", g)
      for g in ("many", "-1", "", "2.5"))])
def test_a_garbage_gpu_setting_is_refused_by_name(setting, field, refused, garbage):
    from kvtier.config import make_settings
    from kvtier.errors import ConfigError
    with pytest.raises(ConfigError, match=setting):
        make_settings({setting: garbage})
    with pytest.raises(BadRequest, match=refused):
        TransferPolicy(**{field: -1})


def test_a_row_splits_into_equal_layer_pages():
    t = PageTable.make([1 << 30], [BB * 32], [BB * 32], 10, 0).split_rows(32)
    assert t.pages == 32 and t.block_bytes == 32 * BB
    assert t.base.tolist() == [(1 << 30) + l * BB for l in range(32)]
    assert set(t.stride.tolist()) == {32 * BB} and t.offset.tolist() == [l * BB for l in range(32)]
    with pytest.raises(BadRequest, match="equal layers"):
        PageTable.make([0], [96], [96], 1, 0).split_rows(5)


def test_page_groups_are_equal_and_cover_every_page():
    assert page_groups(64, None) == [(0, 64)]
    assert page_groups(64, 32) == [(2 * i, 2 * i + 2) for i in range(32)]     # K and V per layer
    with pytest.raises(BadRequest, match="do not split"):
        page_groups(64, 5)


def test_uniform_runs_cut_where_the_page_size_changes():
    size = np.array([16, 16, 32, 32, 32, 16])
    assert uniform_runs(size, 0, 6) == [(0, 2), (2, 5), (5, 6)]
    assert uniform_runs(size, 3, 5) == [(3, 5)]


def test_consecutive_slots_and_rows_become_one_copy():
    rows_table = PageTable.make([1 << 30], [BB], [BB], 100, 0)
    runs = list(copy_runs(np.arange(10, 20), np.arange(50, 60), rows_table, BB, 0, 1))
    assert runs == [Copy(10 * BB, (1 << 30) + 50 * BB, 10 * BB, 1, BB, BB)]
    # A break in either sequence starts a new copy.
    runs = list(copy_runs(np.array([3, 4, 9]), np.array([7, 8, 9]), rows_table, BB, 0, 1))
    assert [(c.seg_off, c.height, c.width) for c in runs] == [(3 * BB, 1, 2 * BB), (9 * BB, 1, BB)]


def test_copy_runs_of_per_layer_pages_are_two_dimensional():
    t = _layers(4, 4096, 64)
    runs = list(copy_runs(np.array([0, 1, 2]), np.array([5, 6, 7]), t, 4 * 4096, 1, 3))
    assert len(runs) == 2                       # pages 1 and 2, each one 2-D copy of 3 rows
    c = runs[0]
    assert (c.seg_off, c.dev_addr, c.width, c.height) == (4096, (2 << 30) + 5 * 4096, 4096, 3)
    assert (c.dev_pitch, c.seg_pitch) == (4096, 4 * 4096) and not c.contiguous


def test_vector_width_follows_alignment():
    t = _layers(2, 4096, 8)
    assert vector_bytes(1 << 20, 8192, t, 0, 2) == 16
    odd = PageTable.make([(1 << 30) + 8], [4096], [4096], 8, 0)
    assert vector_bytes(1 << 20, 4096, odd, 0, 1) == 8
    bad = PageTable.make([(1 << 30) + 4], [4096], [4096], 8, 0)
    with pytest.raises(BadRequest, match="aligned to 8"):
        vector_bytes(1 << 20, 4096, bad, 0, 1)


def test_kernel_launches_keep_32_bit_indices():
    assert kernel_launches(4096, 1, 4096) == [(0, 4096)]
    # 1,024 blocks of 32 pages of 2 MiB in 16-byte vectors: 2^32 vectors, so three launches.
    parts = kernel_launches(1024, 32, (2 << 20) // 16)
    assert parts[0] == (0, 511) and parts[-1][1] == 1024
    assert all(0 < (hi - lo) * 32 * ((2 << 20) // 16) < 2 ** 31 for lo, hi in parts)


def test_rows_are_checked_against_the_target():
    assert check_rows([3, 1], 2, 4).tolist() == [3, 1]
    with pytest.raises(BadRequest, match="one per key"):
        check_rows([0], 2, 4)
    with pytest.raises(BadRequest, match="0..3"):
        check_rows([0, 4], 2, 4)
    with pytest.raises(BadRequest, match="0..3"):
        check_rows([-1, 0], 2, 4)


@pytest.mark.parametrize("block_bytes, n, first, size", [
    (64 << 10, 4096, 256, 1024),    # 64 MiB chunks: each copy outlasts its reserve and commit
    (2 << 20, 4096, 256, 1024),     # never fewer than 1,024 keys a chunk
    (2 << 20, 1024, 1024, 1024),    # up to two chunks' worth: one request (H200 run 12: edge
                                    # chunks of 16-128 keys around it lost, 0.91 against 0.93)
    (16 << 10, 4096, 256, 1024),    # the service's reserves and commits inline: cut too
    (16 << 10, 2048, 2048, 2048),   # up to two chunks' worth: one request
    (16 << 10, 10000, 256, 1024),   # never more than CUDA_PUT_CHUNK keys
])
def test_cuda_puts_are_cut_by_bytes(block_bytes: int, n: int, first: int, size: int):
    from kvtier.api import pipeline
    parts = pipeline.cuda_put_chunks(n, block_bytes)
    assert parts[0] == (0, first)
    assert all(hi - lo == size for lo, hi in parts[1:-1])
    assert [lo for lo, _ in parts[1:]] == [hi for _, hi in parts[:-1]] and parts[-1][1] == n


@pytest.mark.parametrize("slots, rows, layers", [
    (np.arange(10, 20), np.arange(50, 60), 1),                  # one run: one copy
    (np.array([3, 4, 9, 2]), np.array([7, 8, 9, 0]), 1),        # runs of whole rows
    (np.random.default_rng(5).permutation(64), np.random.default_rng(6).permutation(64), 4),
    # one page a block, no two neighbours continuing each other (the fast path), and the same
    # with one pair that does (the run arithmetic again)
    (np.array([7, 3, 90, 41, 5]), np.array([1, 0, 9, 4, 2]), 1),
    (np.array([7, 3, 90, 91, 5]), np.array([1, 0, 9, 10, 2]), 1),
    (np.random.default_rng(7).permutation(64), np.random.default_rng(8).permutation(64), 1),
])
def test_batched_copies_are_the_copy_runs_as_arrays(slots, rows, layers):
    # A BLHNC row split into layers, scattered slots and rows: every 1-D copy of copy_runs,
    # in the same order, as (slot offset, device address, bytes).
    t = PageTable.make([1 << 30], [BB], [BB], 100, 0).split_rows(layers)
    seg, dev, size = copy_arrays(slots, rows, t, BB, 0, t.pages)
    runs = list(copy_runs(slots, rows, t, BB, 0, t.pages))
    assert all(c.height == 1 for c in runs)
    assert seg.tolist() == [c.seg_off for c in runs]
    assert dev.tolist() == [c.dev_addr for c in runs]
    assert size.tolist() == [c.width for c in runs]


def test_batched_copies_refuse_two_dimensional_runs():
    # Consecutive blocks of a per-layer page narrower than its stride are one 2-D copy, which
    # a batch cannot carry: the caller copies one call each.
    t = _layers(4, 4096, 16)
    assert copy_arrays(np.array([0, 1, 2]), np.array([5, 6, 7]), t, 4 * 4096, 0, 4) is None
    seg, dev, size = copy_arrays(np.array([0, 5]), np.array([5, 1]), t, 4 * 4096, 0, 4)
    assert size.tolist() == [4096] * 8 and dev[1] == ((1 << 30) + 4096)


def test_a_dense_batch_is_cut_in_slot_order_into_pieces_of_the_range():
    rng = np.random.default_rng(4)
    local = rng.permutation(1000) + 50                   # dense: slots 50..1049, any order
    order, pieces = sorted_pieces(local, 16384, 16 * 16384 * 10)   # 160 slots a piece
    sl = local[order]
    assert (np.diff(sl) > 0).all()
    assert pieces[0][0] == 0 and pieces[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    for k, (lo, hi) in enumerate(pieces):        # piece k: slots 50 + 160k .. 50 + 160(k+1)
        assert ((sl[lo:hi] >= 50 + 160 * k) & (sl[lo:hi] < 50 + 160 * (k + 1))).all()
    assert [hi - lo for lo, hi in pieces] == [160] * 6 + [40]
    # Gaps: the range is cut by slot numbers, so a piece may be short or empty.
    gappy = np.concatenate([np.arange(0, 100), np.arange(130, 150)])
    order, pieces = sorted_pieces(gappy[::-1].copy(), 1, 25)
    assert [hi - lo for lo, hi in pieces] == [25, 25, 25, 25, 0, 20]
    # Sparse (span over 1.25 x the count, beyond a small allowance), or empty: None.
    assert sorted_pieces(np.arange(0, 2000, 2), 16384, 1 << 20) is None
    assert sorted_pieces(np.zeros(0, np.int64), 16384, 1 << 20) is None
    assert sorted_pieces(np.array([7]), 16384, 1) is not None


def test_a_slot_asked_twice_keeps_both_places_in_the_slot_order():
    # The order comes from one scatter over the span; a key asked twice names its slot twice,
    # which the scatter alone would drop: both positions stay, in the stable sort's order.
    local = np.array([12, 10, 11, 10, 13])
    order, pieces = sorted_pieces(local, 1, 2)
    assert order.tolist() == [1, 3, 2, 0, 4]
    assert [hi - lo for lo, hi in pieces] == [3, 2]
    order, _pieces = sorted_pieces(np.array([3, 1, 2, 0]), 1, 8)
    assert order.tolist() == [3, 1, 2, 0]


def test_policy_refuses_garbage_whole_gets_and_pieces():
    with pytest.raises(BadRequest, match="whole_onboard_keys"):
        TransferPolicy(whole_onboard_keys=-1)
    with pytest.raises(BadRequest, match="stage_piece_bytes"):
        TransferPolicy(stage_piece_bytes=0)
    with pytest.raises(BadRequest, match="sorted_piece_keys"):
        TransferPolicy(sorted_piece_keys=0)
    with pytest.raises(BadRequest, match="get_ramp"):
        TransferPolicy(get_ramp=(64, 0))


def test_a_ramp_cuts_the_first_chunks_and_never_passes_the_batch():
    from kvtier.api.pipeline import chunks
    assert chunks(4096, 1024, (64, 256)) == [(0, 64), (64, 320), (320, 1344), (1344, 2368),
                                             (2368, 3392), (3392, 4096)]
    assert chunks(4096, 1024) == [(0, 256), (256, 1280), (1280, 2304), (2304, 3328),
                                  (3328, 4096)]
    for n in (2049, 2100, 3000, 5000):
        for ramp in ((), (64,), (64, 256), (3000,), (1, 1, 1)):
            parts = chunks(n, 1024, ramp)
            assert parts[0][0] == 0 and parts[-1][1] == n
            assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(parts, parts[1:]))
    assert chunks(2048, 1024, (64,)) == [(0, 2048)]       # up to two chunks: one request


def test_policy_refuses_a_negative_batch():
    with pytest.raises(BadRequest, match="batch_copies"):
        TransferPolicy(batch_copies=-1)


@pytest.mark.parametrize("length", [256, 320, 1024, 1088, 16384, 16384 + 64, 65536])
def test_the_gpu_checksum_reference_is_xxh3(length: int):
    data = blocks(7, length, seed=length)
    expect = np.array([xxhash.xxh3_64_intdigest(r.tobytes()) for r in data], dtype=np.uint64)
    assert (xxh3.reference(data) == expect).all()


def test_the_gpu_checksum_covers_only_whole_stripes():
    assert xxh3.supported(65536, (65536,)) and xxh3.supported(2 << 20, (65536,) * 32)
    assert not xxh3.supported(240, (240,))            # the short-input paths stay on the CPU
    assert not xxh3.supported(4096 + 8, (4096 + 8,))
    assert not xxh3.supported(8192, (4064, 4128))      # a page that would split a stripe
    assert xxh3.key_table().size == 160


def test_a_trusted_commit_records_the_given_checksums_without_hashing(make_engine):
    eng = make_engine(host_capacity="1MiB", nvme_capacity="4MiB")
    eng.create_namespace("m", 4096)
    data = blocks(4, 4096)
    res = eng.reserve("m", keys(range(4)))
    eng.namespace("m").slots[Tier.HOST].pool.write(res.slots, data)
    sums = xxh3.reference(data)
    eng.commit(res.rid, checksums=sums, trusted=True)
    found, out = eng.read("m", keys(range(4)))
    assert found.all() and (out == data).all()
    assert eng.entry("m", keys([2]))["checksum"] == f"{int(sums[2]):016x}"


def test_a_wrong_trusted_checksum_is_caught_when_the_block_comes_back_from_nvme(make_engine):
    # The promise of the GPU checksum: a block read back from NVMe is served only if it
    # matches. A worker that sent a wrong one loses that block (dropped, counted), never gets
    # other bytes.
    eng = make_engine(host_capacity="1MiB", nvme_capacity="4MiB")
    eng.create_namespace("m", 4096)
    data = blocks(4, 4096, seed=3)
    res = eng.reserve("m", keys(range(4)))
    eng.namespace("m").slots[Tier.HOST].pool.write(res.slots, data)
    sums = xxh3.reference(data)
    sums[1] ^= np.uint64(1)
    eng.commit(res.rid, checksums=sums, trusted=True)    # write_through: on NVMe now
    eng.evict(Tier.HOST, 4)
    found, out = eng.read("m", keys(range(4)))
    assert found.tolist() == [True, False, True, True]
    assert (out[[0, 2, 3]] == data[[0, 2, 3]]).all()
    assert eng.counters.checksum_failures == 1


def test_a_trusted_commit_without_checksums_is_refused_and_nothing_is_stored(make_engine):
    eng = make_engine(host_capacity="1MiB")
    eng.create_namespace("m", 4096)
    res = eng.reserve("m", keys(range(2)))
    with pytest.raises(BadRequest, match="one checksum per key"):
        eng.commit(res.rid, checksums=np.zeros(1, np.uint64), trusted=True)
    assert not eng.read("m", keys(range(2)))[0].any()
    assert eng.stats()["reservations"] == 0


def test_the_cuda_forms_refuse_host_memory_and_garbage_arguments(tmp_path):
    # No CUDA needed: each is refused before anything is leased or reserved.
    import kvtier
    from tests.service import Service
    svc = Service(tmp_path / "svc", admin=False, host_capacity="16MiB",
                  nvme_capacity="0").start()
    try:
        with kvtier.Client(svc.socket) as c:
            ns = c.namespace("cpu", block_bytes=4096)
            with pytest.raises(BadRequest, match="put_async reads CUDA memory"):
                ns.put_async(keys(range(2)), blocks(2, 4096))
            with pytest.raises(BadRequest, match="get_async fills CUDA memory"):
                ns.get_async(keys(range(2)), out=np.zeros((2, 4096), np.uint8))
            r = c._call("reserve", ns="cpu", keys=keys(range(2)))
            with pytest.raises(BadRequest):
                c._call("commit", rid=r["rid"], trusted="yes")
            with pytest.raises(BadRequest):
                c._call("reserve", ns="cpu", keys=keys(range(2)), device="gpu0")
            c._call("abort", rid=r["rid"])
            assert not ns.get(keys(range(2)))[0].any()
            st = c.stats()
            assert st["reservations"] == 0 and st["puts"] == 0
    finally:
        svc.stop()



def _server(engine):
    from kvtier.api.quota import ClientInfo
    from kvtier.api.server import Server
    return Server(engine, engine.settings), ClientInfo(1, 0, 0)


def _answer(out):
    """An op's reply and whether it came at once (inline); an awaitable is run on a loop."""
    import asyncio
    import inspect
    if not inspect.isawaitable(out):
        return out, True

    async def wait():
        return await out
    return asyncio.run(wait()), False


def _sums(data: np.ndarray) -> np.ndarray:
    return np.array([xxhash.xxh3_64_intdigest(b.tobytes()) for b in data], "<u8")


def test_a_gpu_puts_reserve_and_trusted_commit_run_inline_when_they_touch_no_disk(make_engine):
    # 16 host slots of 4 KiB, no NVMe. A reserve with room and a trusted commit are answered
    # inline (no thread, no task); what they store is what the thread path stores.
    eng = make_engine(nvme_capacity="0", max_client_share=1.0)
    eng.create_namespace("g", 4096)
    srv, client = _server(eng)
    try:
        data = blocks(4, 4096, seed=3)
        res, inline = _answer(srv.op_reserve(client, {"ns": "g", "keys": keys(range(4))}))
        assert inline and list(client.pins.by_id) == [res["rid"]]
        slots = np.frombuffer(res["slots"], "<i4").astype(np.int64)
        eng.namespace("g").slots[Tier.HOST].pool.write(slots, data)
        out, inline = _answer(srv.op_commit(client, {"rid": res["rid"], "trusted": True,
                                                      "checksums": _sums(data).tobytes()}))
        assert inline and (np.frombuffer(out["versions"], "<u8") > 0).all()
        assert not client.pins.by_id and not eng.reservations
        got = eng.get("g", keys(range(4)))
        assert (got.checksums == _sums(data)).all() and got.found.all()
        eng.release(got.lease_id)
        # An untrusted commit hashes every byte on the service: on a thread, never the loop.
        res, _ = _answer(srv.op_reserve(client, {"ns": "g", "keys": keys(range(4, 6))}))
        _out, inline = _answer(srv.op_commit(client, {"rid": res["rid"]}))
        assert not inline
        # No room without eviction (6 of 16 slots used): the reserve goes to a thread, and works.
        res, inline = _answer(srv.op_reserve(client, {"ns": "g", "keys": keys(range(6, 18))}))
        assert not inline and np.frombuffer(res["slots"], "<i4").size == 12
        assert not eng.put_in_memory("g", 1)            # every slot is taken now
        assert eng.put_in_memory("", rid=res["rid"])    # its commit would be memory-only
        _answer(srv.op_abort(client, {"rid": res["rid"]}))
        free = eng.namespace("g").slots[Tier.HOST].pool.free_count    # two were evicted
        assert free == 12 and eng.put_in_memory("g", free)
        assert not eng.put_in_memory("g", free + 1)
        assert not eng.put_in_memory("nope", 1) and not eng.put_in_memory("", rid=12345)
    finally:
        srv._pool.shutdown()
        srv._mem_pool.shutdown()


def test_a_put_goes_to_a_thread_when_the_lock_is_taken_or_the_commit_writes_through(
        make_engine):
    import threading
    eng = make_engine(write_policy="write_through")
    eng.create_namespace("w", 4096)
    srv, client = _server(eng)
    try:
        taken, go = threading.Event(), threading.Event()

        def hold():
            with eng.lock:
                taken.set()
                go.wait(10)
        t = threading.Thread(target=hold)
        t.start()
        taken.wait(10)
        out = srv.op_reserve(client, {"ns": "w", "keys": keys(range(2))})
        go.set()
        t.join()
        res, inline = _answer(out)
        assert not inline
        data = blocks(2, 4096, seed=4)
        eng.namespace("w").slots[Tier.HOST].pool.write(
            np.frombuffer(res["slots"], "<i4").astype(np.int64), data)
        assert not eng.put_in_memory("", rid=res["rid"])    # written through to NVMe first
        out, inline = _answer(srv.op_commit(client, {"rid": res["rid"], "trusted": True,
                                                      "checksums": _sums(data).tobytes()}))
        assert not inline and np.frombuffer(out["versions"], "<u8").size == 2
    finally:
        srv._pool.shutdown()
        srv._mem_pool.shutdown()



def test_the_loops_reserve_and_commit_take_nothing_where_they_would_touch_the_disk(make_engine):
    # Puts.reserve_inline / commit_inline (the server's inline forms) answer None, with no slot,
    # pin or reservation taken, wherever put_in_memory says no; the thread path then works.
    eng = make_engine(write_policy="write_through")      # 16 host slots of 4 KiB, NVMe below
    eng.create_namespace("w", 4096)
    puts, pool = eng.puts, eng.namespace("w").slots[Tier.HOST].pool
    with eng.lock:
        assert puts.reserve_inline("w", keys(range(17)), None, 1) is None     # no room free
        assert puts.reserve_inline("nope", keys(range(1)), None, 1) is None   # no namespace
        assert pool.free_count == 16 and not eng.reservations
        res = puts.reserve_inline("w", keys(range(2)), None, 1)
    assert res is not None and pool.free_count == 14 and list(eng.reservations) == [res.rid]
    data = blocks(2, 4096, seed=5)
    pool.write(res.slots, data)
    with eng.lock:              # written through to NVMe: a thread's work, not the loop's
        assert puts.commit_inline(res.rid, 1, _sums(data)) is None
        assert puts.commit_inline(12345, 1, _sums(data)) is None
    assert list(eng.reservations) == [res.rid]
    assert (eng.commit(res.rid, 1, _sums(data), True) > 0).all()
    got = eng.get("w", keys(range(2)))
    assert got.found.all() and (got.checksums == _sums(data)).all()
    eng.release(got.lease_id)


class _FakeStream:
    ptr = 1


def _mover(policy: TransferPolicy, page: int, monkeypatch):
    """A Mover over a fake table and staging; uploads lists the sizes of the table's words
    each time the Mover fetched its device copy (device.on_device, faked: no GPU here), and
    the staging keeps what it was given."""
    from types import SimpleNamespace
    from kvtier.gpu import device
    t = PageTable.make([1 << 30], [page], [page], 4096, -1)
    slots = SimpleNamespace(block_bytes=page, device_to_device=False, ranges=())
    uploads: list[int] = []

    def on_device(table):
        uploads.append(table.staged().size)
        return SimpleNamespace(address=4096, vectors={})
    monkeypatch.setattr(device, "on_device", on_device)
    kept: list[object] = []
    staging = SimpleNamespace(keep=kept.append)
    return device.Mover(slots, t, _FakeStream(), policy, staging), uploads


@pytest.mark.parametrize("page, n, policy, prepared", [
    (16384, 4096, TransferPolicy(prepare_launch=True), True),    # the kernel's pages: set up
    (16384, 4096, TransferPolicy(), False),                      # off by default
    (16384, 4, TransferPolicy(prepare_launch=True), False),      # a few copies, no kernel
    (65536, 4096, TransferPolicy(prepare_launch=True), False),   # copy engines onboard
    (16384, 4096, TransferPolicy(prepare_launch=True, kernel_priority=False), True),  # no fork
])
def test_a_chunked_get_prepares_its_first_kernel_launch_while_the_service_answers(
        monkeypatch, page, n, policy, prepared):
    # The page table is uploaded and the kernel stream forked from the caller's once, before
    # the first reply: the chunks' launches then neither upload it nor fork again.
    from kvtier.gpu import device
    forks: list[tuple[object, list[object]]] = []
    side = object()
    monkeypatch.setattr(device, "own", lambda dev, role, high_priority=False: side)
    monkeypatch.setattr(device, "Lanes", lambda caller, sides: forks.append((caller, sides)))
    m, uploads = _mover(policy, page, monkeypatch)
    m.prepare(0, 1, n)
    assert (m._tab != 0) == prepared and len(uploads) == (1 if prepared else 0)
    forked = prepared and policy.kernel_priority
    assert forks == ([(m.stream, [side])] if forked else []) and m._pending == (
        [side] if forked else [])
    m.prepare(0, 1, n)                                   # again: nothing more
    assert len(uploads) == (1 if prepared else 0) and len(forks) == (1 if forked else 0)


class _Client:
    """Replies to gets of the keys it was sent, recording what happened in which order."""

    def __init__(self, log: list[str]) -> None:
        self.log, self.sent = log, {}

    def _send(self, op, args, piggyback=False):
        rid = len(self.sent) + 1
        self.sent[rid] = len(args["keys"]) // 16
        self.log.append(f"send {rid}")
        return rid

    def _reply(self, rid):
        self.log.append(f"reply {rid}")
        k = self.sent[rid]
        return {"found": np.ones(k, np.uint8).tobytes(),
                "slots": np.arange(k, dtype="<i4").tobytes(),
                "versions": np.ones(k, "<u8").tobytes(), "checksums": np.zeros(k, "<u8").tobytes(),
                "lease": rid}


def test_lease_prepares_after_every_request_is_sent_and_before_the_first_reply_is_read():
    from types import SimpleNamespace
    from kvtier.api import pipeline
    log: list[str] = []
    ns = SimpleNamespace(_client=_Client(log), key_width=16, name="n")
    n = 3000
    found, leases, error, moved = pipeline.lease(
        ns, bytes(16 * n), n, lambda rep, lo: log.append(f"move {lo}"), None, None,
        lambda: log.append("prepare"))
    assert error is None and moved and found.all() and leases == [1, 2, 3, 4]
    assert log == ["send 1", "send 2", "send 3", "send 4", "prepare", "reply 1", "move 0",
                   "reply 2", "move 256", "reply 3", "move 1280", "reply 4", "move 2304"]


def test_a_failed_preparation_fails_the_get_after_every_reply_is_read():
    # Its leases are all known (the caller ends them), and nothing is moved.
    from types import SimpleNamespace
    from kvtier.api import pipeline
    log: list[str] = []
    ns = SimpleNamespace(_client=_Client(log), key_width=16, name="n")

    def fail() -> None:
        raise RuntimeError("no device")
    found, leases, error, moved = pipeline.lease(ns, bytes(16 * 3000), 3000,
                                                 lambda rep, lo: log.append("move"), None,
                                                 None, fail)
    assert isinstance(error, RuntimeError) and not moved and leases == [1, 2, 3, 4]
    assert "move" not in log


def test_a_negative_staged_offload_threshold_is_refused_by_name():
    with pytest.raises(BadRequest, match="staged_out_bytes"):
        TransferPolicy(staged_out_bytes=-1)


class _Ns:
    _whole_skip = 0


@pytest.fixture
def probed(monkeypatch):
    """kvtier.gpu.probe's per-device results, set by the test (the probe itself needs a GPU:
    tests/test_gpu.py runs it)."""
    from kvtier.gpu import probe
    monkeypatch.setattr(probe, "_results", {})
    return probe._results


def test_auto_sorted_gets_follow_each_devices_mapped_read_probe(probed):
    # Device 0's SMs read mapped memory at 0.6 of a copy engine (a slow host: sorted gets),
    # device 1's at 0.85 (chunks); the floor is the policy's.
    from kvtier.gpu import probe
    from kvtier.gpu.transfer import _chunked_first, _whole
    pol = TransferPolicy()
    assert pol.sorted_gets == "auto" and not probe.any_sorted(pol)
    small = [PageTable.make([1 << 30], [16384], [16384], 4096, d) for d in (0, 1)]
    # Nothing measured (no warm()): chunks, requests first, as before "auto"; no probe runs
    # inside a get.
    assert _chunked_first(pol, "host", 4096, None)
    assert not _whole(_Ns(), pol, small[0], [(0, 1)], 4096, "host") and not probed
    probed[0] = {"kernel_gbps": 33.0, "copy_gbps": 55.0, "ratio": 0.6}
    probed[1] = {"kernel_gbps": 47.0, "copy_gbps": 55.0, "ratio": 0.85}
    assert _whole(_Ns(), pol, small[0], [(0, 1)], 4096, "host")
    assert not _whole(_Ns(), pol, small[1], [(0, 1)], 4096, "host")
    assert not _whole(_Ns(), TransferPolicy(mapped_read_floor=0.5), small[0], [(0, 1)],
                      4096, "host")
    # 64 KiB pages go by copy engines chunked whatever the probe says, and so do tables of
    # several pages (Pages over per-layer tensors: not what was measured); "on" sorts them.
    big = PageTable.make([1 << 30], [BB], [BB], 4096, 0)
    assert not _whole(_Ns(), pol, big, [(0, 1)], 4096, "host")
    assert _whole(_Ns(), TransferPolicy(sorted_gets="on"), big, [(0, 1)], 4096, "host")
    per_layer = _layers(4, 16384, 4096)
    assert not _whole(_Ns(), pol, per_layer, [(0, 4)], 4096, "host")
    assert _whole(_Ns(), TransferPolicy(sorted_gets="on"), per_layer, [(0, 4)], 4096, "host")
    assert _whole(_Ns(), TransferPolicy(sorted_gets="on"), small[1], [(0, 1)], 4096, "host")
    assert not _whole(_Ns(), TransferPolicy(sorted_gets="off"), small[0], [(0, 1)], 4096,
                      "host")
    # One piece (up to 2 x sorted_piece_keys) is leased in key order: no different from a
    # chunk, so chunked; too many keys, per layer, from HBM, or after a sparse one: chunks.
    assert not _whole(_Ns(), pol, small[0], [(0, 1)], 2048, "host")
    assert _whole(_Ns(), pol, small[0], [(0, 1)], 2049, "host")
    assert _whole(_Ns(), TransferPolicy(sorted_piece_keys=64), small[0], [(0, 1)], 200, "host")
    assert not _whole(_Ns(), pol, small[0], [(0, 1)], 8192, "host")
    assert not _whole(_Ns(), pol, per_layer, [(0, 2), (2, 4)], 4096, "host")
    assert not _whole(_Ns(), pol, small[0], [(0, 1)], 4096, "hbm")
    skip = _Ns()
    skip._whole_skip = 2
    assert not _whole(skip, pol, small[0], [(0, 1)], 4096, "host") and skip._whole_skip == 1
    # One device prefers sorted: gets in range build their side first; none does: chunks first.
    assert probe.any_sorted(pol) and not _chunked_first(pol, "host", 4096, None)
    assert _chunked_first(pol, "host", 4096, 32)                  # per layer
    assert _chunked_first(pol, "host", 8192, None) and _chunked_first(pol, "host", 2048, None)
    probed[0]["ratio"] = 0.9
    assert not probe.any_sorted(pol) and _chunked_first(pol, "host", 4096, None)
    assert _chunked_first(TransferPolicy(sorted_gets="off"), "host", 4096, None)
    assert not _chunked_first(TransferPolicy(sorted_gets="on"), "host", 4096, None)
    assert not _chunked_first(pol, "hbm", 4096, None)


def test_a_failed_probe_is_recorded_once_and_leaves_chunked_gets(probed, monkeypatch):
    from kvtier.gpu import probe
    calls = []

    def broken(device, policy):
        calls.append(device)
        raise RuntimeError("no device")
    monkeypatch.setattr(probe, "_measure", broken)
    r = probe.measure(0)
    assert r == {"error": "RuntimeError: no device"} and probe.measure(0) is r
    assert calls == [0]
    assert not probe.prefers_sorted(0, TransferPolicy()) and not probe.any_sorted(TransferPolicy())
    assert probe.results() == {0: r}


@pytest.mark.parametrize("garbage", ["yes", "", "AUTO", "1"])
def test_a_garbage_sorted_gets_setting_is_refused_by_name(garbage):
    from kvtier.config import make_settings
    from kvtier.errors import ConfigError
    with pytest.raises(ConfigError, match="gpu_sorted_gets"):
        make_settings({"gpu_sorted_gets": garbage})
    with pytest.raises(BadRequest, match="gpu_sorted_gets"):
        TransferPolicy(sorted_gets=garbage)
    with pytest.raises(BadRequest, match="mapped_read_floor"):
        TransferPolicy(mapped_read_floor=1.5)
    s = make_settings({"gpu_sorted_gets": "off"})
    assert TransferPolicy.from_settings(s).sorted_gets == "off"
