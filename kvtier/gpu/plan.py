"""How one GPU transfer is carried out, decided on the host with numpy alone (unit-tested on CPU).

A transfer moves n blocks between slots (the mapped host segment, or an HBM pool) and the
engine's tensors. The device side of a block is P pages (``PageTable``): page p of engine block
r lies at ``base[p] + r * stride[p]``, ``size[p]`` bytes, and is bytes ``offset[p]`` onwards of
the kvtier block. A plain tensor of rows (vLLM's BLHNC buffer) is P = 1, or P = L when a load
is to complete layer by layer (``split_rows``: each row cut into L equal pages).

Two methods, chosen by ``TransferPolicy.method`` (bench/gpu.py measured both on the H200):

- ``COPY_ENGINE``: one copy per page (or one cudaMemcpy2DAsync over a run of consecutive slots
  and blocks), handed to the driver ``batch_copies`` at a time through cuMemcpyBatchAsync where
  every copy is 1-D, else one cudaMemcpyAsync each. The copy engines leave every SM to the
  model (a bf16 matmul beside them kept 792 of 796 TFLOP/s) and reach the PCIe ceiling once a
  copy is ~1 MiB (batched: 0.98-1.00 of it for 2 MiB copies, 0.92 one call each); below that
  each copy's fixed cost dominates (16 KiB copies: 1.6 GB/s). Also used for tiny batches,
  where one copy is cheaper than a kernel launch plus its index upload.
- ``KERNEL``: one launch of a gather/scatter kernel over mapped pinned memory for all pages of a
  page group, bounded to ``kernel_blocks`` thread blocks (so to that many SMs) in a grid-stride
  loop. An unbounded launch (one block per row) took the matmul from 796 to 175 TFLOP/s.
  Device-to-device moves (the HBM tier over CUDA IPC) use ``device_kernel_blocks``: copy
  engines need a call per block there, and an HBM copy is over in about a millisecond.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from kvtier.errors import BadRequest

MAX_VECTORS = (1 << 31) - 1          # the kernel's index arithmetic is 32-bit
SORTED_GETS = ("auto", "on", "off")


class Method(enum.Enum):
    COPY_ENGINE = "copy_engine"
    KERNEL = "kernel"


@dataclass(frozen=True, slots=True)
class TransferPolicy:
    """Which method moves which pages (kvtier.config: gpu_copy_engine_bytes, gpu_kernel_blocks,
    gpu_device_kernel_blocks; the README's GPU section gives the measurements behind them)."""

    copy_engine_bytes: int = 1 << 20
    kernel_blocks: int = 16
    device_kernel_blocks: int = 0     # 0: two per SM
    small_batch_copies: int = 8
    kernel_priority: bool = True      # the kernel on a high-priority stream (streams.py)
    one_launch_layers: bool = True    # a per-layer get by one kernel launch (move_layers)
    staged: bool = True               # host->GPU kernel moves through device staging
    batch_copies: int = 128           # copies per cuMemcpyBatchAsync call; 0: one call each
    device_copy_engines: bool = False  # HBM-tier pages >= copy_engine_bytes by copy engines
    device_items_kernel: bool = True  # HBM-tier kernel: a thread block per page (move_items16)
    # Host->GPU pages of at least this many bytes in a get's move of whole page groups go by
    # copy engines too (0: copy_engine_bytes alone decides). The kernel's reads of mapped host
    # memory stop at ~0.83 of the link; batched 64 KiB copies read 0.884 alone and 0.894 beside
    # the matmul against the kernel's 0.828 / 0.581 (H200 run 16, variants_64k). Offloads keep
    # the kernel (copy engines 0.730 against 0.786), and so do the per-layer loads, whose one
    # launch or staged layers choose by copy_engine_bytes alone.
    onboard_copy_engine_bytes: int = 64 << 10
    # Sorted gets ("auto", "on", "off"): a get of more than 2 x sorted_piece_keys keys (fewer
    # are one piece, leased in key order: a chunk) and at most whole_onboard_keys (0: none)
    # whose pages are all under copy_engine_bytes is leased in the service's slot order,
    # piece by piece (kvtier.api.sortedgets; sorted_piece_keys below); where a piece's
    # slots are dense in one slot range (a batch put together, asked in any key order) it
    # moves by Mover.stage_sorted: the range piece by piece of stage_piece_bytes, one
    # copy-engine copy each into device staging and a placement kernel from there. Else, and
    # for the next transfer.SPARSE_RETRY gets of the namespace, in chunks. "auto": on for
    # rows of one page that the kernel would read from the mapped segment (under
    # onboard_copy_engine_bytes) where the device's SMs read mapped host memory below
    # mapped_read_floor of a copy engine's rate (kvtier.gpu.probe, measured once per device
    # by kvtier.gpu.warm(); a device not measured keeps chunks), else off. The rate is the
    # host's: on H100 hosts whose SMs read 44-49 GB/s the chunked 16 KiB get read 0.69-0.72 of
    # H2D against sorted 0.60-0.66; on hosts reading ~33 GB/s 0.51-0.54 against 0.60-0.68
    # (bench/gpu.py variants_16k, sessions 36-38); the H200 of session 32 chunked 0.62-0.65
    # against sorted 0.58 (docs/DESIGN-NOTES.md, "gets leased in slot order"). 64 KiB rows go
    # by copy engines chunked (0.89-0.93) and sorted read 0.79-0.87: "auto" leaves them.
    sorted_gets: str = "auto"
    whole_onboard_keys: int = 4096
    mapped_read_floor: float = 0.75
    # A whole get is leased in the service's slot order (kvtier.api.sortedgets), a first piece
    # of a quarter of this many keys and then pieces of this many (pipeline.chunks), each
    # moved by stage_sorted as its reply arrives: the control path of one piece, not of the
    # whole batch, before the first copy.
    sorted_piece_keys: int = 1024
    # A chunked get's first chunks (pipeline.chunks' ramp; empty: one of a quarter of a chunk):
    # smaller first requests come back sooner, and each next one's reply arrives while the GPU
    # moves the one before.
    get_ramp: tuple[int, ...] = ()
    stage_piece_bytes: int = 16 << 20
    # A staged placement (device staging to the engine's pages) by place_items16, a thread
    # group per page (False: move_pages16, two divisions and four table loads per vector).
    stage_items_kernel: bool = True
    # A put's chunk is committed as soon as its copies and the GPU hash have completed, also
    # while later reserve replies are still being read (False: only from done() or wait()).
    early_commits: bool = True
    # A host put's first chunk goes into a credit (kvtier.api.credits): slots reserved by count
    # during the namespace's previous put, so its copies start before any reply of this put.
    # Off: on an H100, three runs of bench/gpu.py in one call each, the offload ratio with
    # credits / without in the same process, 64 KiB 0.792 / 0.766, 0.824 / 0.837, 0.813 /
    # 0.830; 16 KiB 0.450 / 0.552, 0.427 / 0.513, 0.588 / 0.575 (bench/results/s35-h100/):
    # no gain at 64 KiB, a loss at 16 KiB (docs/DESIGN-NOTES.md, "put credits").
    put_credits: bool = False
    # A chunked get prepares its first kernel launch (the page table's upload, the kernel
    # stream's fork) while the service answers the first chunk (Mover.prepare; False: at the
    # first launch, after that reply). bench/gpu.py's onboard_timeline_16k, round 5: the first
    # chunk's reply-to-launch took 0.22-0.35 ms against 0.10-0.16 for the later chunks;
    # prepared 0.17 against 0.28, the get 2.15 against 2.25 ms, but end to end 0.498 against
    # 0.524 in the same process (bench/gpu.py variant "prepared"): no gain established, off.
    prepare_launch: bool = False
    # A GPU->host move goes through the staging ring (Mover._staged_out) from this many bytes
    # (None: over two pieces of OUT_STAGE_BYTES, the measured default).
    staged_out_bytes: int | None = None
    # A per-layer get through device staging (Mover.stage_layers): each layer's placement
    # kernel on the high-priority kernel stream, so that the next layers' copies run while it
    # runs (False: on the caller's stream, each copy after the placement before it), and how
    # many staging buffers (a layer's pages each) the copies may run ahead of the placements.
    # H100, bench/gpu.py's layers case, three processes (bench/results/s38-h100/): the 32
    # layers' load alone 40.1-40.2 ms against 46.6-46.8 inline (the copy engine idle 0.09 ms
    # between layers against 10.6-12.6); the overlap with per-layer compute 1.122 / 1.093 /
    # 1.159 of max(load, compute) against 1.096 / 1.082 / 1.135 inline: the same within the
    # spread (the compute runs 10-20% slower beside any of the loads, copy engines alone
    # included), the load 14% faster. Two buffers: 1.139 / 1.118 / 1.131; four 1.142 / 1.155
    # / 1.151 (docs/DESIGN-NOTES.md, session 38).
    layer_fork: bool = True
    layer_ring: int = 3
    # The thread blocks of a staged get's placements (device staging to the engine's pages,
    # device memory only; 0: one per multiprocessor). Such a kernel is short, and
    # the model's kernels wait for the SMs it holds while it runs, so it holds many of them
    # briefly rather than a few long: the layer-wise load beside a matmul chain per layer
    # (bench/gpu.py, H100, two processes, the variants in the same process) ran 1.132 / 1.138
    # of max(load, compute) with the placements in kernel_blocks' 16 (0.31 ms a layer's
    # placement), 1.086 / 1.094 in 33, 1.094 / 1.102 in 66, 1.091 / 1.082 in 132 (0.15 ms)
    # and 1.093 / 1.086 in 264 (docs/DESIGN-NOTES.md, session 42). A staged offload's gathers
    # (device to device too) keep kernel_blocks: no pair of them was measured.
    place_blocks: int = 0
    # A share of a copy-engine onboard's pages (a get's 64 KiB rows from the host tier) read
    # by the kernel from the mapped segment beside the copies, on the kernel stream (0: none).
    # Where the host enqueues batched copies slower than the copy engine runs them (0.8-1.3 us
    # a 64 KiB copy on some H100 hosts, sessions 39-41), the kernel's part needs no enqueue
    # per page. An experiment of session 43, off until measured (bench/gpu.py kernel_share_*).
    kernel_share: float = 0.0

    def __post_init__(self) -> None:
        if (self.copy_engine_bytes < 0 or self.kernel_blocks < 1 or self.device_kernel_blocks < 0
                or self.batch_copies < 0 or self.onboard_copy_engine_bytes < 0
                or self.place_blocks < 0
                or self.whole_onboard_keys < 0 or self.stage_piece_bytes < 1
                or self.sorted_piece_keys < 1 or any(k < 1 for k in self.get_ramp)
                or (self.staged_out_bytes is not None and self.staged_out_bytes < 0)
                or self.layer_ring < 2 or self.sorted_gets not in SORTED_GETS
                or not 0 <= self.mapped_read_floor <= 1 or not 0 <= self.kernel_share < 1):
            raise BadRequest("gpu_copy_engine_bytes >= 0, gpu_kernel_blocks >= 1, "
                             "gpu_device_kernel_blocks >= 0, gpu_place_blocks >= 0, "
                             "batch_copies >= 0 and "
                             "gpu_onboard_copy_engine_bytes >= 0, whole_onboard_keys >= 0, "
                             "sorted_piece_keys, get_ramp and stage_piece_bytes >= 1, "
                             "staged_out_bytes >= 0, layer_ring >= 2, gpu_sorted_gets one of "
                             f"{', '.join(SORTED_GETS)}, mapped_read_floor 0..1, "
                             "kernel_share 0 to below 1")

    @classmethod
    def from_settings(cls, settings: Any) -> "TransferPolicy":
        return cls(copy_engine_bytes=settings.gpu_copy_engine_bytes,
                   kernel_blocks=settings.gpu_kernel_blocks,
                   device_kernel_blocks=settings.gpu_device_kernel_blocks,
                   place_blocks=settings.gpu_place_blocks,
                   onboard_copy_engine_bytes=settings.gpu_onboard_copy_engine_bytes,
                   sorted_gets=settings.gpu_sorted_gets)

    def method(self, page_bytes: int, copies: int, device_to_device: bool,
               onboard: bool = False) -> Method:
        """The method for ``copies`` page copies of page_bytes each; onboard: host to GPU in a
        get's move of whole page groups (onboard_copy_engine_bytes applies)."""
        if copies <= self.small_batch_copies:
            return Method.COPY_ENGINE
        if device_to_device and not self.device_copy_engines:
            return Method.KERNEL
        if (onboard and not device_to_device and self.onboard_copy_engine_bytes
                and page_bytes >= self.onboard_copy_engine_bytes):
            return Method.COPY_ENGINE
        return Method.COPY_ENGINE if page_bytes >= self.copy_engine_bytes else Method.KERNEL

    def blocks(self, device_to_device: bool, sm_count: int) -> int:
        if device_to_device:
            return self.device_kernel_blocks or 2 * sm_count
        return self.kernel_blocks


@dataclass(frozen=True, slots=True)
class PageTable:
    """The device side of a batch's blocks: P pages of num_blocks blocks (module docstring)."""

    base: np.ndarray          # uint64 (P,), device addresses
    stride: np.ndarray        # int64 (P,), bytes from block r to r + 1
    size: np.ndarray          # int64 (P,), page bytes
    offset: np.ndarray        # int64 (P,), where the page starts in the kvtier block
    num_blocks: int
    device: int

    @property
    def pages(self) -> int:
        return int(self.base.size)

    @property
    def block_bytes(self) -> int:
        return int(self.size.sum())

    @classmethod
    def make(cls, base: list[int], stride: list[int], size: list[int], num_blocks: int,
             device: int) -> "PageTable":
        size_a = np.asarray(size, dtype=np.int64)
        offset = np.concatenate([[0], np.cumsum(size_a)[:-1]]).astype(np.int64)
        return cls(np.asarray(base, dtype=np.uint64), np.asarray(stride, dtype=np.int64),
                   size_a, offset, int(num_blocks), int(device))

    def split_rows(self, parts: int) -> "PageTable":
        """Each page cut into ``parts`` equal pages, in order (a BLHNC row into its layers)."""
        if parts <= 1:
            return self
        if (self.size % parts).any():
            raise BadRequest(f"pages of {self.size.tolist()} bytes do not split into {parts} "
                             "equal layers; pass layers that divide the page")
        sub = self.size // parts
        k = np.arange(parts, dtype=np.int64)
        base = (self.base[:, None] + (k[None, :] * sub[:, None]).astype(np.uint64)).reshape(-1)
        return PageTable.make(base.tolist(), np.repeat(self.stride, parts).tolist(),
                              np.repeat(sub, parts).tolist(), self.num_blocks, self.device)

    def staged(self) -> np.ndarray:
        """The table as one int64 array for the kernels: base, stride, offset, size."""
        return np.concatenate([self.base.view(np.int64), self.stride, self.offset, self.size])


def page_groups(pages: int, groups: int | None) -> list[tuple[int, int]]:
    """[lo, hi) page ranges, one per completion event: ``groups`` equal ranges (layers)."""
    if not groups or groups <= 1:
        return [(0, pages)]
    if pages % groups:
        raise BadRequest(f"{pages} pages do not split into {groups} layers of equal page "
                         "count; pass layers that divide the number of pages")
    per = pages // groups
    return [(g * per, (g + 1) * per) for g in range(groups)]


def uniform_runs(size: np.ndarray, lo: int, hi: int) -> list[tuple[int, int]]:
    """[lo, hi) cut into runs of equal page size (one kernel launch each)."""
    out, start = [], lo
    for p in range(lo + 1, hi + 1):
        if p == hi or size[p] != size[start]:
            out.append((start, p))
            start = p
    return out


def vector_bytes(seg_base: int, block_bytes: int, table: PageTable, lo: int, hi: int) -> int:
    """16 when every address of pages lo..hi is 16-byte aligned (page-aligned slots,
    allocator-aligned tensors: every real KV cache), else 8; BadRequest below that."""
    vals = np.concatenate([[seg_base, block_bytes], table.base[lo:hi].astype(np.int64),
                           table.stride[lo:hi], table.offset[lo:hi], table.size[lo:hi]])
    vals = vals.astype(np.int64)
    for width in (16, 8):
        if not (vals % width).any():
            return width
    raise BadRequest("the CUDA path needs pages, strides and tensors aligned to 8 bytes")


def sorted_pieces(local: np.ndarray, width: int, piece_bytes: int
                  ) -> tuple[np.ndarray, list[tuple[int, int]]] | None:
    """A batch's slots (one range) in slot order, cut into pieces of at most piece_bytes of
    the slot range (width bytes a slot): (the order, [lo, hi) positions in that order per
    piece), or None where the slots are not dense (their span over 1.25 x their count, as
    Mover._staged asks of a chunk), so that staging the range would read too much besides
    them. A piece may hold no slot (a gap of the range): the caller skips it."""
    n = local.size
    if n == 0:
        return None
    smin = int(local.min())
    span = int(local.max()) - smin + 1
    if span > n + n // 4 + 8:
        return None
    # Dense: the order by one scatter over the span (4,096 slots: a stable argsort took
    # ~0.1-0.3 ms of the get's lead before its first copy), unless a slot repeats (a key
    # asked twice), which the scatter would drop: then the sort.
    at = np.full(span, -1, np.int64)
    at[local - smin] = np.arange(n)
    order = at[at >= 0]
    if order.size != n:
        order = np.argsort(local, kind="stable")
    sl = local[order]
    per = max(1, piece_bytes // max(1, width))
    cuts = np.searchsorted(sl, smin + per * np.arange(1, -(-span // per)), "left").tolist()
    bounds = [0, *cuts, n]
    return order, [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


def kernel_launches(n: int, pages: int, vectors: int) -> list[tuple[int, int]]:
    """[lo, hi) block ranges whose launch stays within 32-bit vector indices."""
    per = max(1, MAX_VECTORS // max(1, pages * vectors))
    return [(lo, min(lo + per, n)) for lo in range(0, n, per)]


@dataclass(frozen=True, slots=True)
class Copy:
    """One copy-engine call: height rows of width bytes (a 2-D copy when height > 1)."""

    seg_off: int              # byte offset in the slot region
    dev_addr: int             # device address of the first row
    width: int
    height: int
    dev_pitch: int            # bytes between the rows on the device side
    seg_pitch: int            # bytes between the rows in the slot region

    @property
    def contiguous(self) -> bool:
        return self.height == 1 or (self.dev_pitch == self.width == self.seg_pitch)


def copy_runs(slots: np.ndarray, rows: np.ndarray, table: PageTable, block_bytes: int,
              lo: int, hi: int) -> Iterator[Copy]:
    """The copy-engine calls for pages lo..hi of the blocks (slots[i] <-> engine block rows[i]):
    one per page and run of consecutive slots and blocks, so that a batch put together (slots
    and blocks both consecutive) is one call per page. A generator: the caller enqueues each
    copy as it comes, so the copy engines start on the first while the rest are worked out
    (built as a list first, 1,024 copies of 2 MiB waited ~3 ms for their first)."""
    slots = np.asarray(slots, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    if slots.size == 0:
        return
    if slots.size == 1:                   # the latency case: no numpy passes
        starts, ends = np.zeros(1, np.int64), np.ones(1, np.int64)
    else:
        brk = np.flatnonzero((np.diff(slots) != 1) | (np.diff(rows) != 1)) + 1
        starts = np.concatenate([[0], brk])
        ends = np.concatenate([brk, [slots.size]])
    seg_off = (slots[starts] * block_bytes).tolist()
    dev_off = rows[starts].tolist()
    heights = (ends - starts).tolist()
    for p in range(lo, hi):
        base, stride = int(table.base[p]), int(table.stride[p])
        size, off = int(table.size[p]), int(table.offset[p])
        whole = stride == size == block_bytes          # rows of whole blocks: runs are 1-D
        for so, r, h in zip(seg_off, dev_off, heights):
            if whole or h == 1:
                yield Copy(so + off, base + r * stride, size * h, 1, stride, block_bytes)
            else:
                yield Copy(so + off, base + r * stride, size, h, stride, block_bytes)


def copy_arrays(slots: np.ndarray, rows: np.ndarray, table: PageTable, block_bytes: int,
                lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """copy_runs' calls as three arrays (slot-region offsets, device addresses, bytes), page
    after page, for a batched submission; None where one of them would be a 2-D copy (a run of
    consecutive blocks of a page narrower than its stride)."""
    slots = np.asarray(slots, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    empty = np.zeros(0, np.int64)
    if slots.size == 0:
        return empty.astype(np.uint64), empty.astype(np.uint64), empty
    if hi - lo == 1 and slots.size > 1:
        # One page a block, the chunked get's case (4,096 scattered 64 KiB rows): where no two
        # neighbours continue each other, every block is one copy, without the run arithmetic
        # (a third of the numpy calls: this runs on the host's critical path between a chunk's
        # reply and its copies, ~90 us a 1,024-key chunk on the dev VM before).
        step = slots[1:] - slots[:-1]
        step -= 1
        cont = rows[1:] - rows[:-1]
        cont -= 1
        np.bitwise_or(step, cont, out=step)
        if step.all():
            stride, size = int(table.stride[lo]), int(table.size[lo])
            seg = slots * block_bytes
            seg += int(table.offset[lo])
            dev = rows * stride
            dev += int(table.base[lo])
            return seg.view(np.uint64), dev.view(np.uint64), np.full(slots.size, size, np.int64)
    brk = np.flatnonzero((np.diff(slots) != 1) | (np.diff(rows) != 1)) + 1
    starts = np.concatenate([[0], brk]).astype(np.int64)
    heights = np.diff(np.concatenate([starts, [slots.size]]))
    segs, devs, sizes = [], [], []
    for p in range(lo, hi):
        stride, size = int(table.stride[p]), int(table.size[p])
        if not (stride == size == block_bytes) and (heights > 1).any():
            return None
        segs.append(slots[starts] * block_bytes + int(table.offset[p]))
        devs.append(rows[starts] * stride + int(table.base[p]))
        sizes.append(heights * size)
    return (np.concatenate(segs).astype(np.uint64), np.concatenate(devs).astype(np.uint64),
            np.concatenate(sizes))


def check_rows(rows: np.ndarray, n: int, num_blocks: int) -> np.ndarray:
    """rows as int64, one per key, each naming a block of the target."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if rows.size != n:
        raise BadRequest(f"rows names {rows.size} blocks for {n} keys; give one per key")
    if n and (rows.min() < 0 or rows.max() >= num_blocks):
        raise BadRequest(f"rows must name blocks 0..{num_blocks - 1} of the tensor, got "
                         f"{int(rows.min())}..{int(rows.max())}")
    return rows
