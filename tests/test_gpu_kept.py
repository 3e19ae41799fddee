"""What the GPU path keeps between transfers (session 40): each page table's words on the device
with its launches' vector widths (device.on_device), and the device slabs of index uploads
(staging._slabs). CPU tests of the bookkeeping, against a stand-in for cupy that records
allocations and copies into host memory (no GPU here); tests/test_gpu.py runs the real one:
moved bytes checked with the cache warm, emptied mid-flight, and the slabs reused.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
import types
import weakref

import numpy as np
import pytest

from kvtier.gpu import device, staging
from kvtier.gpu.plan import PageTable, TransferPolicy


class _Array:
    """cupy.empty's stand-in: device memory as a host buffer (its address is the pointer)."""

    def __init__(self, words: int) -> None:
        self.buf = ctypes.create_string_buffer(8 * words)
        self.nbytes = 8 * words
        self.data = types.SimpleNamespace(ptr=ctypes.addressof(self.buf))

    def words(self) -> np.ndarray:
        return np.frombuffer(self.buf, dtype=np.int64)


class _Cupy:
    """The parts of cupy these paths call, recording what they did."""

    def __init__(self) -> None:
        self.current = 0
        self.allocs: list[_Array] = []
        self.copies: list[tuple[int, int, int]] = []     # (dst, nbytes, stream)
        self.hosts: list[ctypes.Array] = []
        self.int64 = np.int64
        rt = types.SimpleNamespace(memcpyAsync=self._copy, getDevice=lambda: self.current,
                                   hostAlloc=self._host_alloc)
        self.cuda = types.SimpleNamespace(Device=self._device, runtime=rt)

    @contextlib.contextmanager
    def _device(self, dev: int):
        saved, self.current = self.current, dev
        try:
            yield
        finally:
            self.current = saved

    def empty(self, words: int, dtype=None) -> _Array:
        a = _Array(words)
        self.allocs.append(a)
        return a

    def _copy(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        ctypes.memmove(dst, src, nbytes)
        self.copies.append((dst, nbytes, stream))

    def _host_alloc(self, nbytes: int, flags: int) -> int:
        buf = ctypes.create_string_buffer(nbytes)
        self.hosts.append(buf)
        return ctypes.addressof(buf)


class _Stream:
    def __init__(self, ptr: int, log: list[str]) -> None:
        self.ptr, self.log = ptr, log

    @property
    @contextlib.contextmanager
    def cupy(self):
        """cupy's current stream while entered (an allocation's pool order)."""
        self.log.append(f"enter {self.ptr}")
        yield

    def event(self):
        log = self.log
        return types.SimpleNamespace(synchronize=lambda: log.append(f"sync {self.ptr}"))


@pytest.fixture
def cupy(monkeypatch):
    fake = _Cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(device, "_on_device", {})
    monkeypatch.setattr(staging, "_slabs", {})
    monkeypatch.setattr(staging, "ARENA", staging._Arena())
    log: list[str] = []
    streams: dict[tuple[int, str], _Stream] = {}

    def own(dev, role, high_priority=False):
        return streams.setdefault((dev, role), _Stream(1000 + 10 * dev + len(streams), log))
    monkeypatch.setattr(device, "own", own)
    fake.log, fake.own = log, own
    return fake


def _rows(block: int = 16384, device_id: int = 0, base: int = 1 << 30) -> PageTable:
    return PageTable.make([base], [block], [block], 4096, device_id)


def _mover(table: PageTable, kept: list):
    slots = types.SimpleNamespace(block_bytes=int(table.size.sum()), device_to_device=False,
                                  ranges=())
    return device.Mover(slots, table, _Stream(1, []), TransferPolicy(),
                        types.SimpleNamespace(keep=kept.append))


def test_a_table_goes_to_the_device_once_and_complete(cupy):
    t = _rows()
    kept: list = []
    a = _mover(t, kept)._table_address()
    # Allocated in the tables stream's order, complete on return: the host waited for that
    # stream after its one copy.
    tables = cupy.copies[0][2]
    assert len(cupy.copies) == 1 and cupy.log == [f"enter {tables}", f"sync {tables}"]
    assert cupy.copies[0][2] == cupy.own(0, "tables").ptr
    assert (cupy.allocs[0].words() == t.staged()).all() and a == cupy.allocs[0].data.ptr
    # Another transfer on the same table, and one on a table rebuilt from the same tensors
    # (split_rows makes a new one per call): no upload.
    assert _mover(t, kept)._table_address() == a
    layered = _rows(65536).split_rows(4)
    b = _mover(layered, kept)._table_address()
    assert _mover(_rows(65536).split_rows(4), kept)._table_address() == b != a
    assert len(cupy.copies) == 2 and (cupy.allocs[1].words() == layered.staged()).all()
    # Each transfer keeps what it reads until it is released.
    assert len(kept) == 4 and kept[0] is kept[1] and kept[2] is kept[3]


def test_tables_that_differ_in_any_word_or_device_get_copies_of_their_own(cupy):
    kept: list = []
    addrs = {_mover(t, kept)._table_address() for t in (
        _rows(), _rows(device_id=1), _rows(base=(1 << 30) + 4096), _rows(8192))}
    assert len(addrs) == 4 and len(cupy.copies) == 4
    # The device-1 table was allocated and copied with device 1 current.
    assert cupy.copies[1][2] == cupy.own(1, "tables").ptr


def test_the_cache_starts_over_past_its_size_and_a_transfer_keeps_its_table(cupy, monkeypatch):
    monkeypatch.setattr(device, "ON_DEVICE_MAX", 4)
    kept: list = []
    first = _mover(_rows(), kept)
    first._table_address()
    held = weakref.ref(kept[0].array)
    for i in range(1, 6):
        _mover(_rows(base=(1 << 30) + 4096 * i), [])._table_address()
    assert len(device._on_device) <= 4
    gc.collect()
    assert held() is not None                 # the in-flight transfer's table is alive
    again = _mover(_rows(), [])._table_address()
    assert again != first._kept.address and len(cupy.copies) == 7    # gone: uploaded again
    kept.clear()
    del first
    cupy.allocs.clear()                       # the stand-in's own record of it
    gc.collect()
    assert held() is None                     # released: nothing holds the old copy


def test_vector_widths_are_worked_out_once_per_table(cupy, monkeypatch):
    calls: list[tuple] = []
    real = device.vector_bytes

    def counted(*a):
        calls.append(a[:2] + a[3:])
        return real(*a)
    monkeypatch.setattr(device, "vector_bytes", counted)
    t = _rows()
    for _ in range(3):
        assert _mover(t, [])._vector(1 << 32, 16384, 0, 1) == 16
    assert _mover(t, [])._vector((1 << 32) + 8, 16384, 0, 1) == 8     # another base
    assert calls == [(1 << 32, 16384, 0, 1), ((1 << 32) + 8, 16384, 0, 1)]
    # Staging buffers come at new addresses every transfer: kept by what the width depends
    # on (addresses modulo 16), so they do not grow the cache.
    for k in range(50):
        assert _mover(t, [])._vector((2 << 32) + 4096 * k, 16384, 0, 1) == 16
    assert len(calls) == 2 and len(device._on_device[(0, t.staged().tobytes())].vectors) == 2
    # A misaligned table is still refused, every time (nothing cached for it).
    bad = PageTable.make([(1 << 30) + 4], [16384], [16384], 4096, 0)
    for _ in range(2):
        with pytest.raises(Exception, match="aligned to 8 bytes"):
            _mover(bad, [])._vector(1 << 32, 16384, 0, 1)


def _upload(s: staging.Staging, n: int) -> int:
    return s.upload(np.arange(n, dtype=np.int64))


def test_a_released_staging_hands_its_slab_to_the_next_transfer_and_no_earlier(cupy):
    st = _Stream(7, [])
    a = staging.Staging(st)
    addr_a = _upload(a, 100)
    b = staging.Staging(st)                     # a in flight: b gets a slab of its own
    addr_b = _upload(b, 100)
    assert len(cupy.allocs) == 2 and addr_a != addr_b
    # The uploads landed where their addresses say.
    assert (np.frombuffer(cupy.allocs[0].buf, np.int64)[:100] == np.arange(100)).all()
    a.release()
    c = staging.Staging(st)
    assert _upload(c, 50) == addr_a and len(cupy.allocs) == 2     # a's slab, reused
    assert _upload(c, 50) == addr_a + 512                          # cut from it, aligned
    b.release()
    c.release()
    assert len(staging._slabs[0]) == 2


def test_threads_staging_at_once_never_share_a_buffer_or_a_slab(cupy):
    # The vLLM connector's background loads and the engine's stores stage from two threads.
    import threading
    st = _Stream(7, [])
    seen: list[tuple[int, int]] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(200):
                s = staging.Staging(st)
                addr = _upload(s, 64)
                seen.append((addr, s._bufs[0][0]))
                s.release()
        except BaseException as exc:      # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(seen) == 800
    # Every pooled buffer and slab went back whole: nothing was lost or handed out twice.
    assert len(staging.ARENA._free) == len({b for b in staging.ARENA._free})
    assert len(staging._slabs[0]) == len({id(d) for d in staging._slabs[0]}) <= 8


def test_slabs_past_their_size_or_count_are_not_kept(cupy, monkeypatch):
    monkeypatch.setattr(staging, "SLABS_KEPT", 2)
    st = _Stream(7, [])
    big = staging.Staging(st)
    _upload(big, staging.SLAB_BYTES // 8 + 1)   # more than a slab: a larger one of its own
    big.release()
    assert staging._slabs.get(0, []) == []
    many = [staging.Staging(st) for _ in range(3)]
    for s in many:
        _upload(s, 10)
    for s in many:
        s.release()
    assert len(staging._slabs[0]) == 2
    # Slabs go back to the device they came from.
    with cupy.cuda.Device(1):
        other = staging.Staging(st)
        _upload(other, 10)
    other.release()
    assert len(staging._slabs[1]) == 1 and len(staging._slabs[0]) == 2
