"""What a GPU transfer enqueues: the device side of its blocks (target_table) and the copies of
each page group by the method plan.py chooses (Mover), over the slots of kvtier.gpu.slots and
the streams of kvtier.gpu.streams; its indices go up through kvtier.gpu.staging, its
copy-engine calls through kvtier.gpu.copies.

Needs cupy and a CUDA device; torch tensors are read through their data pointers, no copies.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.errors import BadRequest, KvtierError
from kvtier.gpu import kernels
from kvtier.gpu.copies import _D2H, _DEFAULT, _H2D, batch_available, copy_batch, copy_one
from kvtier.gpu.plan import (MAX_VECTORS, Method, PageTable, TransferPolicy, copy_arrays,
                             copy_runs, kernel_launches, sorted_pieces, uniform_runs,
                             vector_bytes)
from kvtier.gpu.slots import DeviceSlots, SlotRange
from kvtier.gpu.staging import Staging
from kvtier.gpu.streams import Lanes, Stream, can_wait_value, own, settle, wait_value

THREADS = 1024
STAGE_BYTES = 256 << 20       # the largest staging buffer of a host->GPU move (two in turn)
OUT_STAGE_BYTES = 64 << 20    # the pieces of a staged GPU->host move (two buffers in turn)
# stage_sorted's staging: its first pieces' copies are enqueued ahead of their placements,
# this many bytes of buffers (a 64 KiB get of 4,096 keys: four pieces of 16 MiB ahead).
SORTED_RING_BYTES = 64 << 20
_sm_counts: dict[int, int] = {}


def is_cuda_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and getattr(x, "is_cuda", False)


def is_cuda_target(x: Any) -> bool:
    """A CUDA tensor of rows, or a kvtier.api.layouts.Pages over CUDA tensors."""
    if is_cuda_tensor(x):
        return True
    from kvtier.api.layouts import Pages
    return isinstance(x, Pages) and x.is_cuda


_key_tables: dict[int, Any] = {}


def _key_table(device: int) -> int:
    """Device address of xxh3's key table on device, uploaded once (read-only, kept)."""
    t = _key_tables.get(device)
    if t is None:
        import cupy
        from kvtier.gpu.xxh3 import key_table
        host = np.ascontiguousarray(key_table().view(np.int64))
        with cupy.cuda.Device(device):
            t = cupy.empty(host.size, dtype=cupy.int64)
            # A synchronous copy: complete before any stream reads it.
            cupy.cuda.runtime.memcpy(t.data.ptr, host.ctypes.data, host.nbytes, _H2D)
        _key_tables[device] = t
    return int(t.data.ptr)


def sm_count(device: int) -> int:
    n = _sm_counts.get(device)
    if n is None:
        import cupy
        n = _sm_counts[device] = int(
            cupy.cuda.Device(device).attributes["MultiProcessorCount"])
    return n


_tables: dict[tuple, PageTable] = {}


class _OnDevice:
    """A page table's words (PageTable.staged) in device memory, and the vector width of each
    launch over it (vector_bytes), kept across transfers: an engine moves to and from the same
    KV cache every step, and session 40's H100 timeline spent 28-40 us of a small-page get's
    first chunk uploading its table, and vector_bytes ran again for every Mover. Found by the
    words themselves (plus the device), so a table rebuilt from the same tensors (split_rows
    makes one per call) finds its copy and no two tables can share one."""

    __slots__ = ("array", "address", "vectors")

    def __init__(self, array: Any) -> None:
        self.array = array
        self.address = int(array.data.ptr)
        self.vectors: dict[tuple[int, int, int, int], int] = {}


_on_device: dict[tuple[int, bytes], _OnDevice] = {}
ON_DEVICE_MAX = 256       # tables kept; past it the cache starts over (transfers keep theirs)


def on_device(table: PageTable) -> _OnDevice:
    """The device copy of table's words, uploaded the first time and complete on return (the
    host waits for that small copy on a stream of kvtier's own, never for the caller's), so
    that every stream may read it from then on."""
    import cupy
    words = np.ascontiguousarray(table.staged())
    key = (table.device, words.tobytes())
    kept = _on_device.get(key)
    if kept is None:
        with cupy.cuda.Device(table.device):
            st = own(table.device, "tables")
            with st.cupy:       # cupy's pool then reuses memory in that stream's order
                array = cupy.empty(max(1, words.size), dtype=cupy.int64)
            cupy.cuda.runtime.memcpyAsync(int(array.data.ptr), words.ctypes.data,
                                          words.nbytes, _H2D, st.ptr)
            st.event().synchronize()
        if len(_on_device) >= ON_DEVICE_MAX:
            _on_device.clear()
        kept = _on_device[key] = _OnDevice(array)
    return kept


def target_table(target: Any, block_bytes: int) -> PageTable:
    """The PageTable of a CUDA tensor of whole rows, or of CUDA Pages (plan.py). Remembered by
    addresses and sizes (an engine passes the same cache every step; the table is a pure
    function of them)."""
    key: tuple = ()
    if is_cuda_tensor(target):            # first: a single-block get asks every call
        if target.is_contiguous():
            key = (block_bytes, target.data_ptr(), target.numel() * target.element_size(),
                   target.get_device())
    else:
        from kvtier.api.layouts import Pages
        if isinstance(target, Pages) and all(is_cuda_tensor(v) for v in target.views):
            key = (block_bytes, target.num_blocks,
                   *((v.data_ptr(), v.stride(0), v.shape[1]) for v in target.views))
    table = _tables.get(key) if key else None
    if table is None:
        table = _table(target, block_bytes)
        if key:
            if len(_tables) > 256:
                _tables.clear()
            _tables[key] = table
    return table


def _table(target: Any, block_bytes: int) -> PageTable:
    from kvtier.api.layouts import Pages
    if isinstance(target, Pages):
        views = target.views
        if not all(is_cuda_tensor(v) for v in views):
            raise BadRequest("a CUDA transfer needs every page view on the GPU (torch tensors)")
        devices = {v.device.index for v in views}
        if len(devices) != 1:
            raise BadRequest(f"the page views are on devices {sorted(devices)}; one transfer "
                             "moves the pages of one GPU")
        if target.block_bytes != block_bytes:
            raise BadRequest(f"the pages hold {target.block_bytes} bytes per block, the "
                             f"namespace's blocks are {block_bytes}")
        return PageTable.make([v.data_ptr() for v in views], [v.stride(0) * v.element_size()
                                                            for v in views],
                              [v.shape[1] * v.element_size() for v in views],
                              target.num_blocks, devices.pop())
    if not target.is_contiguous():
        raise BadRequest("the CUDA tensor must be contiguous rows of whole blocks (or pass "
                         "kvtier.api.layouts.Pages for per-layer tensors)")
    nbytes = target.numel() * target.element_size()
    if nbytes % block_bytes:
        raise BadRequest(f"a CUDA tensor of {nbytes} bytes is not whole blocks of {block_bytes}")
    return PageTable.make([target.data_ptr()], [block_bytes], [block_bytes],
                          nbytes // block_bytes, target.device.index)


def _timed(stream: Stream) -> Any:
    """A timing event recorded on stream now (bench/gpu.py's per-piece timeline only)."""
    import cupy
    ev = cupy.cuda.Event()
    ev.record(stream.cupy)
    return ev


class Mover:
    """Enqueues the copies of one transfer, ordered on its stream (plan.py's methods; the side
    streams of kvtier.gpu.streams are forked from it and joined back)."""

    # bench/gpu.py's layer-wise timeline: where a list, every Mover made traces into it.
    trace_all: list[list[Any]] | None = None

    def __init__(self, slots: DeviceSlots | None, table: PageTable, stream: Stream,
                 policy: TransferPolicy, staging: Staging) -> None:
        self.slots, self.table, self.stream = slots, table, stream
        self.policy, self.staging = policy, staging
        self._tab = 0
        self.methods: set[Method] = set()
        self.one_launch = False         # move_layers moved every layer in one launch
        self.staged = False             # a host->GPU move went through the staging ring
        self.batched = False            # copies went through cuMemcpyBatchAsync
        self._pending: list[Stream] = []    # side streams to join before the next event
        self._kernel_stream = stream        # where the last kernel ran
        self._ring: list[list[Any]] = []    # staging buffers: [address, bytes, last reader]
        self._turn = 0
        self._last = 0                      # the buffer _buffer gave last
        self._out_ring: list[list[Any]] = []    # the same for GPU->host: [.., last copy out]
        self._out_turn = 0
        self._sorted_ring: list[list[Any]] = []   # stage_sorted's: [address, bytes, last placement]
        self._sorted_turn = 0
        self._gather: Stream | None = None      # the stream of offload gathers (_staged_out)
        self._kept: _OnDevice | None = None     # the table on the device (on_device)
        # bench/gpu.py's timeline: where a list, each staged piece appends its timing events
        # [copy start, copy end, placement start, placement end] (cupy Events).
        self.trace: list[list[Any]] | None = Mover.trace_all
        # stage_sorted uploads every piece's indices, then enqueues its first copies ahead of
        # the placements (False: round 3's order, each piece's copy, then its indices uploaded
        # on the kernel stream and its placement: bench/gpu.py's diagnosis).
        self.upload_ahead = True
        self._work = stream                 # the stream of the last copies or kernel (mark())

    def _place_blocks(self) -> int:
        """The thread blocks of a placement from device staging (policy.place_blocks)."""
        return self.policy.place_blocks or sm_count(self.table.device)

    def _table_address(self) -> int:
        """The device address of the table's words, kept alive by this transfer's staging
        until the transfer has completed (the cache may start over meanwhile)."""
        if self._kept is None:
            self._kept = on_device(self.table)
            self.staging.keep(self._kept)
        return self._kept.address

    def _vector(self, base: int, bb: int, a: int, b: int) -> int:
        """vector_bytes over pages a..b from base, kept with the table: by base and bb modulo
        16, all the width depends on, so staging buffers (new addresses every transfer) do
        not grow the cache."""
        self._table_address()
        vectors, k = self._kept.vectors, (base % 16, bb % 16, a, b)
        vec = vectors.get(k)
        if vec is None:
            vec = vectors[k] = vector_bytes(base, bb, self.table, a, b)
        return vec

    def mark(self) -> tuple[Any, list[float]]:
        """bench/gpu.py's chunk timeline: a timing event on the stream of the last copies or
        kernel, after what was enqueued so far, and [the host's perf_counter then]."""
        import time
        import cupy
        ev = cupy.cuda.Event()
        ev.record(self._work.cupy)
        return ev, [time.perf_counter()]

    def prepare(self, lo: int, hi: int, n: int) -> None:
        """Before a chunked get's first reply (policy.prepare_launch): what its first kernel
        launch of pages lo..hi of n blocks would set up, done while the service answers: the
        page table uploaded and the kernel stream forked after it (a direct kernel reads only
        the slots, the engine's rows, its indices uploaded on that stream, and the table, so
        one fork serves every chunk until the next event()). Nothing where those pages go by
        copy engines or device to device."""
        if (not self.policy.prepare_launch or self.slots is None
                or self.slots.device_to_device
                or len(uniform_runs(self.table.size, lo, hi)) != 1
                or self.policy.method(int(self.table.size[lo]), n * (hi - lo), False,
                                      onboard=True) is not Method.KERNEL):
            return
        if not self._tab:
            self._tab = self._table_address()
        if self.policy.kernel_priority:
            st = own(self.table.device, "kernel-0", high_priority=True)
            if st not in self._pending:
                Lanes(self.stream, [st])
                self._pending.append(st)

    def event(self) -> Any:
        """An event of the transfer's stream covering everything enqueued so far (the side
        streams joined first)."""
        for side in self._pending:
            self.stream.wait(side.event())
        self._pending = []
        return self.stream.event()

    def settle(self) -> None:
        """The host waits until everything enqueued so far has run (or the stream failed)."""
        for side in self._pending:
            settle(side)
        settle(self.stream)

    def move(self, slots: np.ndarray, rows: np.ndarray, lo: int, hi: int, to_seg: bool) -> None:
        """Pages lo..hi of blocks: slots[i] <-> engine block rows[i], to the slots or from."""
        if (slots.size == 1 and len(self.slots.ranges) == 1
                and hi - lo <= self.policy.small_batch_copies):
            self._one(int(slots[0]), int(rows[0]), lo, hi, to_seg)
            return
        d2d = self.slots.device_to_device
        for rng, pos, local in self.slots.split(slots):
            r = rows[pos]
            for a, b in uniform_runs(self.table.size, lo, hi):
                size = int(self.table.size[a])
                if self.policy.method(size, local.size * (b - a), d2d,
                                      onboard=not to_seg) is Method.COPY_ENGINE:
                    k = self._kernel_part(local.size, size, d2d, to_seg)
                    if k:       # launched first: it runs while the copies are enqueued
                        self._launch(rng.base, self.slots.block_bytes, local[:k], r[:k], a, b,
                                     to_seg, d2d, refork=False)
                    self._copy(rng, local[k:], r[k:], a, b, to_seg)
                elif d2d or not (self._staged_out if to_seg else self._staged)(
                        rng, local, r, a, b):
                    self._launch(rng.base, self.slots.block_bytes, local, r, a, b, to_seg, d2d,
                                 refork=False)

    def _kernel_part(self, n: int, size: int, d2d: bool, to_seg: bool) -> int:
        """How many of n copy-engine onboard blocks (pages of size bytes) the kernel reads
        instead: the policy's kernel_share of pages under copy_engine_bytes, which go by copy
        engines only for onboard_copy_engine_bytes; none of an offload, a device-to-device
        move or a batch too small to split."""
        share = self.policy.kernel_share
        if (not share or d2d or to_seg or size >= self.policy.copy_engine_bytes
                or n <= 2 * self.policy.small_batch_copies):
            return 0
        return int(n * share)

    def _one(self, slot: int, row: int, lo: int, hi: int, to_seg: bool) -> None:
        self.methods.add(Method.COPY_ENGINE)
        copy_one(self.slots, self.table, self.stream, slot, row, lo, hi, to_seg)

    def _staged(self, rng: SlotRange, local: np.ndarray, rows: np.ndarray, a: int,
                b: int, fork: bool = True, idx: int = 0, place: bool = False,
                ring: int = 2) -> bool:
        """Host to GPU through device memory: one copy-engine copy of the slot range holding
        the blocks (dense: a batch put together is consecutive slots) into a staging buffer,
        then the kernel from there, device to device. SM-issued reads over PCIe stop at ~0.8 of
        the link alone and ~0.6 beside a matmul; one large copy reaches it. ``ring`` staging
        buffers in turn: a copy into one waits only for the kernel that last read it. idx: the
        kernel's indices (local - min, then rows), uploaded by the caller before; place: by
        place_items16 (stage_sorted's pieces). False (nothing enqueued) for a sparse or too
        large range."""
        import cupy
        if not self.policy.staged or local.size == 0:
            return False
        smin = int(local.min())
        span = int(local.max()) - smin + 1
        off = int(self.table.offset[a])
        width = int(self.table.offset[b - 1] + self.table.size[b - 1]) - off
        if span > local.size + local.size // 4 + 8 or span * width > STAGE_BYTES:
            return False
        self.staged = True
        self.methods.add(Method.COPY_ENGINE)
        buf = self._buffer(span * width, ring)
        bb = self.slots.block_bytes
        src = rng.base + smin * bb + off
        marks = None if self.trace is None else [_timed(self.stream)]
        if width == bb:
            cupy.cuda.runtime.memcpyAsync(buf[0], src, span * bb, _DEFAULT, self.stream.ptr)
        else:
            cupy.cuda.runtime.memcpy2DAsync(buf[0], width, src, bb, width, span, _DEFAULT,
                                            self.stream.ptr)
        if marks is not None:
            marks.append(_timed(self.stream))
        # The kernel's slot i at buffer + (slot - smin) * width + (page offset - off).
        self._launch(buf[0] - off, width, local - smin, rows, a, b, False, False, fork,
                     idx=idx, place=place, marks=marks, blocks=self._place_blocks())
        buf[2] = self._kernel_stream.event()
        if marks is not None:
            self.trace.append(marks)
        return True

    def stage_sorted(self, slots: np.ndarray, rows: np.ndarray, lo: int, hi: int) -> bool:
        """Pages lo..hi (one page size) of a whole batch host to GPU in slot order: where its
        slots are dense in one slot range (plan.sorted_pieces; a batch put together, asked in
        any key order), piece by piece of the range, each one copy-engine copy into a staging
        buffer and a placement kernel from there (place_items16), so that the copies run back
        to back while the kernel places the pieces already in. One copy per piece instead of
        one per block (64 KiB copies stop at ~0.86 of H2D on their per-copy cost) or the
        kernel's reads of host memory (~0.83). False (nothing enqueued) where the slots are
        not dense in one range.

        Order (docs/DESIGN-NOTES.md, round 4, measured by per-piece events on the H200):
        every piece's indices in one upload on the transfer's stream, then the first pieces'
        copies (SORTED_RING_BYTES of staging), then each placement on the kernel stream
        waiting for its own copy's event, and the next copy into the buffer it freed. Round
        3 uploaded each piece's indices on the kernel stream after its copy: that small copy
        queued behind the next piece's 16 MiB one, so placement k ran only after copy k + 1
        (0.38 ms a piece) and the pieces added up instead of hiding under the copies."""
        if (not self.policy.staged or self.slots.device_to_device or slots.size == 0
                or len(uniform_runs(self.table.size, lo, hi)) != 1):
            return False
        parts = self.slots.split(slots)
        if len(parts) != 1:
            return False
        rng, pos, local = parts[0]
        width = int(self.table.offset[hi - 1] + self.table.size[hi - 1] - self.table.offset[lo])
        cut = sorted_pieces(local, width, self.policy.stage_piece_bytes)
        if cut is None:
            return False
        order, pieces = cut
        sl, r = local[order], rows[pos][order]
        pieces = [(p0, p1) for p0, p1 in pieces if p1 > p0]
        if not self.upload_ahead:                  # round 3's order (bench/gpu.py)
            for p0, p1 in pieces:
                if not self._staged(rng, sl[p0:p1], r[p0:p1], lo, hi, place=True):
                    self._launch(rng.base, self.slots.block_bytes, sl[p0:p1], r[p0:p1], lo,
                                 hi, False, False)
            return True
        self._sorted(rng, sl, r, lo, hi, width, pieces)
        return True

    def _sorted(self, rng: SlotRange, sl: np.ndarray, r: np.ndarray, lo: int, hi: int,
                width: int, pieces: list[tuple[int, int]]) -> None:
        """stage_sorted's pieces (positions in the sorted slots sl, rows r), copies first.

        The staging ring (SORTED_RING_BYTES in buffers of stage_piece_bytes) is the Mover's,
        kept across calls: a get leased in slot order (kvtier.api.sortedgets) calls this once
        a reply, and each copy into a buffer waits for the placement that last read it,
        whichever call enqueued that one."""
        import cupy
        self.staged = True
        self.methods.update((Method.COPY_ENGINE, Method.KERNEL))
        firsts = sl[[p0 for p0, _p1 in pieces]]
        spans = [int(sl[p1 - 1]) - int(sl[p0]) + 1 for p0, p1 in pieces]
        need = max(max(spans) * width, self.policy.stage_piece_bytes)
        ring = self._sorted_ring
        if ring and ring[0][1] < need:
            ring = []                    # wider pieces than the ring's buffers: a ring apart
        size = ring[0][1] if ring else need
        depth = max(2, SORTED_RING_BYTES // size)             # copies ahead
        start = self._sorted_turn if ring is self._sorted_ring else 0
        off, bb = int(self.table.offset[lo]), self.slots.block_bytes
        st = own(self.table.device, "kernel-0", high_priority=True) if (
            self.policy.kernel_priority) else own(self.table.device, "place")
        if st not in self._pending:
            self._pending.append(st)
        copied: list[Any] = []
        marks: list[list[Any]] = []

        def copy(k: int) -> None:
            b = (start + k) % depth
            if b == len(ring):
                ring.append([self.staging.device(-(-size // 8)), size, None])
            elif ring[b][2] is not None:
                self.stream.wait(ring[b][2])     # its buffer's last placement
            m = [] if self.trace is None else [_timed(self.stream)]
            src = rng.base + int(firsts[k]) * bb + off
            if width == bb:
                cupy.cuda.runtime.memcpyAsync(ring[b][0], src, spans[k] * bb,
                                              _DEFAULT, self.stream.ptr)
            else:
                cupy.cuda.runtime.memcpy2DAsync(ring[b][0], width, src, bb, width,
                                                spans[k], _DEFAULT, self.stream.ptr)
            if self.trace is not None:
                m.append(_timed(self.stream))
            marks.append(m)
            copied.append(self.stream.event())
        copy(0)                # first: the copy engine starts before the host's index work
        if not self._tab:
            self._tab = self._table_address()
        # Piece by piece: its slots less its first (the copy's start), then its rows; on the
        # transfer's stream behind copy 0, ahead of every later copy.
        rel = sl - np.repeat(firsts, [p1 - p0 for p0, p1 in pieces])
        idx = self.staging.upload(np.concatenate(
            [part for p0, p1 in pieces for part in (rel[p0:p1], r[p0:p1])]))
        st.wait(self.stream.event())
        ahead = min(len(pieces), depth)
        for k in range(1, ahead):
            copy(k)
        for k, (p0, p1) in enumerate(pieces):
            st.wait(copied[k])
            m = marks[k] if self.trace is not None else None
            b = (start + k) % depth
            # The kernel's slot i at buffer + rel[i] * width + (page offset - off).
            self._launch(ring[b][0] - off, width, rel[p0:p1], r[p0:p1], lo, hi,
                         False, False, on=st, idx=idx + 16 * p0, place=True, marks=m,
                         blocks=self._place_blocks())
            ring[b][2] = st.event()
            if m is not None:
                self.trace.append(m)
            if k + ahead < len(pieces):
                copy(k + ahead)
        if ring is self._sorted_ring:
            self._sorted_turn = (start + len(pieces)) % depth

    def _staged_out(self, rng: SlotRange, local: np.ndarray, rows: np.ndarray, a: int,
                    b: int) -> bool:
        """GPU to host through device memory, the reverse of _staged: per piece of at most
        OUT_STAGE_BYTES of consecutive slots, the kernel gathers the blocks' pages a..b into a
        staging buffer laid out as those slots (device to device, on the gather stream), then
        one copy-engine copy (2-D where the pages are part of a block) moves the buffer into
        the slots. Two buffers in turn: the gather of one piece runs while the copy of the
        one before moves. Only slots of this transfer are written: pieces never span a gap.
        False (nothing enqueued) where the slots are not a few runs of consecutive ones, or
        the move is under three pieces: one piece is a gather and then its copy, one after
        the other, where the kernel writing host memory directly starts at once (H200, one
        run: 1,024 blocks of 32 per-layer 64 KiB pages 0.916 of D2H staged against 0.845
        direct; 64 MiB chunks of 64 and 16 KiB rows 0.646 and 0.249 staged against 0.665 and
        0.278 direct)."""
        import cupy
        off = int(self.table.offset[a])
        width = int(self.table.offset[b - 1] + self.table.size[b - 1]) - off
        least = self.policy.staged_out_bytes
        if not self.policy.staged or local.size * width <= (
                2 * OUT_STAGE_BYTES if least is None else least - 1):
            return False
        order = np.argsort(local, kind="stable")
        sl = local[order]
        brk = np.flatnonzero(np.diff(sl) != 1) + 1
        if brk.size > max(8, local.size // 32):
            return False
        self.staged = True
        self.methods.update((Method.COPY_ENGINE, Method.KERNEL))
        bb = self.slots.block_bytes
        per = max(1, OUT_STAGE_BYTES // width)
        starts = np.concatenate([[0], brk, [sl.size]]).tolist()
        pieces = [(p0, min(r1, p0 + per)) for r0, r1 in zip(starts[:-1], starts[1:])
                  for p0 in range(r0, r1, per)]
        gather = self._gather_stream()
        # Every piece's indices in one upload, on the gather stream: the gathers then wait
        # for their buffers only, never for copies out already on the transfer's stream.
        rel = sl - np.repeat(sl[[p0 for p0, _p1 in pieces]], [p1 - p0 for p0, p1 in pieces])
        src = rows[order]
        idx = self.staging.upload(np.concatenate(
            [part for p0, p1 in pieces for part in (rel[p0:p1], src[p0:p1])]), gather)
        for p0, p1 in pieces:
            buf = self._out_buffer((p1 - p0) * width, gather)
            s0 = int(sl[p0])
            self._launch(buf[0] - off, width, rel[p0:p1], src[p0:p1], a, b, True, False,
                         on=gather, idx=idx + 16 * p0)
            self.stream.wait(gather.event())
            dst = rng.base + s0 * bb + off
            if width == bb:
                cupy.cuda.runtime.memcpyAsync(dst, buf[0], (p1 - p0) * bb, _DEFAULT,
                                              self.stream.ptr)
            else:
                cupy.cuda.runtime.memcpy2DAsync(dst, bb, buf[0], width, width, p1 - p0,
                                                _DEFAULT, self.stream.ptr)
            buf[2] = self.stream.event()
        return True

    def _gather_stream(self) -> Stream:
        """The stream of this transfer's offload gathers: forked from the transfer's stream
        once, at the first (after the sources were written and the page table uploaded)."""
        if self._gather is None:
            if not self._tab:
                self._tab = self._table_address()
            self._gather = own(self.table.device, "gather-1",
                               high_priority=self.policy.kernel_priority)
            Lanes(self.stream, [self._gather])
        if self._gather not in self._pending:
            self._pending.append(self._gather)
        return self._gather

    def _out_buffer(self, nbytes: int, gather: Stream) -> list[Any]:
        """The next buffer of the offload ring; gather waits until its last copy has run."""
        if len(self._out_ring) < 2:
            self._out_ring.append([0, 0, None])
        buf = self._out_ring[self._out_turn % 2]
        self._out_turn += 1
        if buf[2] is not None:
            gather.wait(buf[2])
        if buf[1] < nbytes:
            buf[0], buf[1] = self.staging.device(-(-nbytes // 8)), nbytes
        return buf

    def _buffer(self, nbytes: int, ring: int = 2) -> list[Any]:
        """The next staging buffer of a ring of ``ring``, once its last reader has run (the
        last one taken: self._ring[self._last])."""
        while len(self._ring) < ring:
            self._ring.append([0, 0, None])
        self._last = self._turn % ring
        buf = self._ring[self._last]
        self._turn += 1
        if buf[2] is not None:
            self.stream.wait(buf[2])
        if buf[1] < nbytes:
            buf[0], buf[1] = self.staging.device(-(-nbytes // 8)), nbytes
        return buf

    def _copy(self, rng: SlotRange, local: np.ndarray, rows: np.ndarray, a: int, b: int,
              to_seg: bool) -> None:
        """One copy-engine call per page run, on the transfer's stream. (Spreading them over
        two or four streams was measured slower on the H200: 2 MiB onboard 0.849 of H2D on one
        stream, 0.815 on two, 0.799 on four.)"""
        self.methods.add(Method.COPY_ENGINE)
        if (self.policy.batch_copies and local.size > self.policy.small_batch_copies
                and batch_available()):
            arrays = copy_arrays(local, rows, self.table, self.slots.block_bytes, a, b)
            if arrays is not None:
                seg, dev, sizes = arrays
                seg = seg + np.uint64(rng.base)
                src, dst = (dev, seg) if to_seg else (seg, dev)
                st = self.stream
                if st.ptr == 0:
                    # The driver refuses batches on the legacy default stream (torch's unless
                    # the engine runs on a stream of its own): forked onto kvtier's, joined
                    # back at the next event().
                    st = own(self.table.device, "copies")
                    Lanes(self.stream, [st])
                    if st not in self._pending:
                        self._pending.append(st)
                copy_batch(dst, src, sizes, st, self.policy.batch_copies)
                self.batched = True
                self._work = st
                return
        import cupy
        st = self.stream.ptr
        for c in copy_runs(local, rows, self.table, self.slots.block_bytes, a, b):
            seg = rng.base + c.seg_off
            src, dst = (c.dev_addr, seg) if to_seg else (seg, c.dev_addr)
            sp, dp = (c.dev_pitch, c.seg_pitch) if to_seg else (c.seg_pitch, c.dev_pitch)
            if c.height == 1:
                cupy.cuda.runtime.memcpyAsync(dst, src, c.width, _DEFAULT, st)
            else:
                cupy.cuda.runtime.memcpy2DAsync(dst, dp, src, sp, c.width, c.height, _DEFAULT,
                                                st)

    def stage_layers(self, slots: np.ndarray, rows: np.ndarray,
                     groups: list[tuple[int, int]]) -> list[Any] | None:
        """A per-layer get through the staging ring (_staged, layer by layer): per layer one
        2-D copy-engine copy of that layer's pages of the slot range and a short kernel from
        device memory; layer l's event follows its kernel (policy.layer_fork: on the kernel
        stream, the copies of the next layers running meanwhile). None (nothing enqueued)
        where _staged would refuse."""
        d2d = self.slots.device_to_device
        parts = self.slots.split(slots)
        if not self.policy.staged or d2d or len(parts) != 1 or slots.size == 0:
            return None
        rng, pos, local = parts[0]
        r = rows[pos]
        lo, hi = groups[0][0], groups[-1][1]
        if (len(uniform_runs(self.table.size, lo, hi)) != 1 or self.policy.method(
                int(self.table.size[lo]), local.size * (groups[0][1] - groups[0][0]), d2d)
                is not Method.KERNEL):
            return None
        span = int(local.max()) - int(local.min()) + 1
        widest = max(int(self.table.size[a:b].sum()) for a, b in groups)
        if span > local.size + local.size // 4 + 8 or span * widest > STAGE_BYTES:
            return None
        # policy.layer_fork: each placement on the kernel stream, the copies ahead of them by
        # up to layer_ring - 1 buffers (the measurements are plan.py's); else on the caller's
        # stream, layer l's kernel then its event, each layer's copy after the kernel before
        # it. The indices are the same for every layer: uploaded once, before any fork.
        pol = self.policy
        idx = self.staging.upload(np.concatenate([local - int(local.min()), r]))
        events = []
        for g_lo, g_hi in groups:
            if not self._staged(rng, local, r, g_lo, g_hi, fork=pol.layer_fork, idx=idx,
                                ring=pol.layer_ring):
                raise KvtierError("a staged layer was refused after its checks passed")
            events.append(self._ring[self._last][2])
        events[-1] = self.event()                       # the last: everything, on the caller's
        return events

    def move_layers(self, slots: np.ndarray, rows: np.ndarray, groups: list[tuple[int, int]],
                    to_seg: bool) -> list[Any] | None:
        """Every page group (layer) of the blocks by one kernel launch, returning one event per
        layer (kernels.move_layers; each completes when its layer has moved). None, with
        nothing enqueued, where that does not apply: copy engines chosen, groups of unequal
        pages, several slot ranges, more than 2^31 vectors, no stream memory operations."""
        import cupy
        table, d2d = self.table, self.slots.device_to_device
        lo, hi = groups[0][0], groups[-1][1]
        np_ = groups[0][1] - groups[0][0]
        parts = self.slots.split(slots)
        size = int(table.size[lo])
        if (not self.policy.one_launch_layers or len(parts) != 1
                or len(uniform_runs(table.size, lo, hi)) != 1
                or any(b - a != np_ for a, b in groups)
                or self.policy.method(size, slots.size * np_, d2d) is not Method.KERNEL):
            return None
        rng, pos, local = parts[0]
        vec = self._vector(rng.base, self.slots.block_bytes, lo, hi)
        vecs = size // vec
        if local.size * (hi - lo) * vecs > MAX_VECTORS or not can_wait_value(table.device):
            return None
        self.methods.add(Method.KERNEL)
        self.one_launch = True
        if not self._tab:
            self._tab = self._table_address()
        n, layers = local.size, len(groups)
        idx = self.staging.upload(np.concatenate([local, rows[pos]]))
        counters = self.staging.device(-(-layers // 2))
        cupy.cuda.runtime.memsetAsync(counters, 0, 4 * layers, self.stream.ptr)
        cap = self.policy.blocks(d2d, sm_count(table.device))
        grid = max(1, min(cap, -(-n * np_ * vecs // (4 * THREADS))))
        marker = own(table.device, f"layers-{int(to_seg)}")
        Lanes(self.stream, [marker])                    # forked once the counters are zeroed
        lanes, st = None, self.stream
        if self.policy.kernel_priority:
            lanes = Lanes(self.stream, [own(table.device, f"kernel-{int(to_seg)}",
                                            high_priority=True)])
            st = lanes.sides[0]
        with st.cupy:
            kernels.get("move_layers16" if vec == 16 else "move_layers8")(
                (grid,), (THREADS,),
                (np.uint64(rng.base), np.int64(self.slots.block_bytes), np.uint64(self._tab),
                 np.int32(table.pages), np.uint64(idx), np.uint64(idx + 8 * n), np.int32(n),
                 np.int32(lo), np.int32(np_), np.uint32(vecs), np.int32(1 if to_seg else 0),
                 np.int32(layers), np.uint64(counters)))
        if lanes is not None:
            lanes.join()
        events = []
        for layer in range(layers - 1):
            if not wait_value(marker, counters + 4 * layer, grid):
                raise KvtierError("cuStreamWaitValue32 failed after its probe succeeded; "
                                  "set layers=None to load without per-layer events")
            events.append(marker.event())
        events.append(self.stream.event())              # the last: everything, on the caller's
        return events

    def _launch(self, base: int, bb: int, local: np.ndarray, rows: np.ndarray, a: int, b: int,
                to_seg: bool, d2d: bool, fork: bool = True, on: Stream | None = None,
                idx: int = 0, refork: bool = True, place: bool = False,
                marks: list[Any] | None = None, blocks: int = 0) -> None:
        """The kernel over pages a..b: slot i at base + local[i] * bb + offset, on the
        high-priority kernel stream (forked now, joined at the next event(): the next chunk's
        copy runs meanwhile; refork=False: forked already where it was since the last
        event()), fork=False: the caller's, or on: that stream, ordered by the caller. idx:
        local and rows uploaded by the caller (n slots, n rows), else uploaded here on the
        kernel's stream. place: a staged placement from device staging (place_items16 where
        the policy's stage_items_kernel allows). marks: timing events appended around it.
        blocks: the thread blocks it may take (0: the policy's for its direction)."""
        n = local.size
        if n == 0:
            return
        self.methods.add(Method.KERNEL)
        table = self.table
        if not self._tab:
            self._tab = self._table_address()
        vec = self._vector(base, bb, a, b)
        vecs = int(table.size[a]) // vec
        # Pages of at least a vector per thread of each of four passes (64 KiB): below that
        # most of a block's threads would idle on every page.
        items = (d2d and vec == 16 and self.policy.device_items_kernel
                 and int(table.size[a]) >= 4 * THREADS * 16)
        placing = place and vec == 16 and self.policy.stage_items_kernel
        k = kernels.get("move_pages8" if vec == 8 else "place_items16" if placing else
                        "move_items16" if items else
                        "move_pages16_deep" if d2d else "move_pages16")
        cap = blocks or self.policy.blocks(d2d, sm_count(table.device))
        st = on or self.stream
        if on is None and self.policy.kernel_priority and fork:
            st = own(table.device, f"kernel-{int(to_seg)}", high_priority=True)
            # Forked after what it reads on the transfer's stream (a staged copy: refork). A
            # direct kernel reads only the slots, the engine's rows and its indices, uploaded
            # on st itself, so the chunks of a get fork once until the next event().
            if refork or st not in self._pending:
                Lanes(self.stream, [st])
                if st not in self._pending:
                    self._pending.append(st)
        if not idx:
            idx = self.staging.upload(np.concatenate([local, rows]), st)
        self._kernel_stream = self._work = st
        if marks is not None:
            marks.append(_timed(st))
        if placing:
            self._place(k, base, bb, n, idx, a, b, vecs, cap, st)
            if marks is not None:
                marks.append(_timed(st))
            return
        with st.cupy:
            for l0, l1 in kernel_launches(n, b - a, vecs):
                total = (l1 - l0) * (b - a) * vecs
                grid = max(1, min(cap, (l1 - l0) * (b - a) if items else
                                  -(-total // (8 * THREADS))))
                k((grid,), (THREADS,),
                  (np.uint64(base % (1 << 64)), np.int64(bb), np.uint64(self._tab),
                   np.int32(table.pages), np.uint64(idx + 8 * l0),
                   np.uint64(idx + 8 * (n + l0)), np.int32(l1 - l0), np.int32(a),
                   np.int32(b - a), np.uint32(vecs), np.int32(1 if to_seg else 0)))
        if marks is not None:
            marks.append(_timed(st))

    def _place(self, k: Any, base: int, bb: int, n: int, idx: int, a: int, b: int, vecs: int,
               cap: int, st: Stream) -> None:
        """place_items16 over pages a..b of n staged blocks (device staging to the engine's
        pages), within cap thread blocks: a group of threads per page, vecs / 4 of them (a
        warp at least, THREADS at most), so four vectors are in flight per thread, and
        THREADS / that many pages a thread block at once."""
        width = min(THREADS, max(32, -(-vecs // 128) * 32))
        group = THREADS // width
        with st.cupy:
            for l0, l1 in kernel_launches(n, b - a, vecs):
                grid = max(1, min(cap, -(-(l1 - l0) * (b - a) // group)))
                k((grid,), (group * width,),
                  (np.uint64(base % (1 << 64)), np.int64(bb), np.uint64(self._tab),
                   np.int32(self.table.pages), np.uint64(idx + 8 * l0),
                   np.uint64(idx + 8 * (n + l0)), np.int32(l1 - l0), np.int32(a),
                   np.int32(b - a), np.uint32(vecs), np.int32(0), np.uint32(group)))

    def checksums(self, rows: np.ndarray, side: Stream) -> int:
        """xxh3-64 of engine blocks rows of the table, computed on the GPU on stream side
        (forked from the transfer's stream after the uploads it needs): the address of n uint64
        in pinned host memory, filled once side has run."""
        import cupy
        n = rows.size
        if not self._tab:
            self._tab = self._table_address()
        keys = _key_table(self.table.device)
        ridx = self.staging.upload(rows)
        side.wait(self.stream.event())
        out = self.staging.device(n)
        threads = 128
        with side.cupy:
            kernels.get("xxh3_pages")((-(-4 * n // threads),), (threads,),
                                      (np.uint64(self._tab), np.int32(self.table.pages),
                                       np.uint64(ridx), np.int32(n),
                                       np.int64(self.table.block_bytes), np.uint64(keys),
                                       np.uint64(out)))
        host = self.staging.pinned(8 * n)
        cupy.cuda.runtime.memcpyAsync(host, out, 8 * n, _D2H, side.ptr)
        return host
