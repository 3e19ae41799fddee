"""An NVMe get's read in one C call: the records into their host slots by native AIO, each
block's XXH3 compared with the one its row names, a verdict per record (kvtier/tiers/_reads.c).

Why (issue 17, bench/stall.py). SegmentLog.read_rows and the verify were three GIL-free C
calls joined by Python on an I/O thread, which took the GIL back three times per read (after
its wake-up, after the AIO, after the checksums); while the event loop ran a get's locked step,
each of those waited for CPython's switch interval to force the loop off the GIL mid-step
(bench/stall_trace.py, H200 host, 8 readers: 74% of the decides blocked). record_batch builds
the read once (a few microseconds: the checks and the request list are made in C), and then
either run_batch reads it on the calling thread in one call (Engine.get's driver), or the
socket server's StepRunner hands it to C threads that never take the GIL and signal an eventfd
its loop watches (kvtier.api.steps).

Rules kept: the same records as read_rows (a record whose segment is not held open, or that
does not lie whole on a record boundary inside what was written, is not read: a bad record),
the same verdict (read whole and its XXH3 equal to the row's checksum), and a read that fails
mid-way raises with nothing in flight any more (the AIO context is destroyed, which waits for
its requests), so its caller installs nothing and frees slots no request still writes.
Where this does not apply (the C module or libxxhash missing, no AIO, records padded beyond
the block, slots not on 4 KiB boundaries, a destination that is not a host numpy array) record_batch returns None and the caller reads by
read_rows or read(), as before.

Thread-safety: a Batch is read by one thread at a time (run_batch, or one Reader thread); the
segments in its table must stay pinned until it is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import xxhash

from kvtier import checksums
from kvtier.tiers.segfile import ALIGN

try:
    from kvtier.tiers import _reads as native
except ImportError:            # not built (no C compiler at install): the Python read
    native = None

if TYPE_CHECKING:
    from kvtier.tiers.nvme import SegmentLog
    from kvtier.tiers.segfile import Segment


def _dispatching_xxh3() -> int | None:
    """The address of libxxhash's XXH3_64bits_dispatch, which picks the CPU's widest vector
    code (AVX2, AVX-512) at run time, where it hashes probes as python-xxhash does; else None.

    Why (issue 17, fio10): kvtier.checksums takes XXH3_64bits, which in Debian's libxxhash is
    its baseline SSE2 build: 16 x 64 KiB took 0.105-0.109 ms of CPU on the dev VM (AMD EPYC,
    AVX-512), the dispatching entry 0.059-0.065, python-xxhash's own 0.069-0.078. The result
    is the same function whatever the vector code (XXH3's output is fixed since 0.8.0); probes
    across the size classes XXH3 treats apart (short, mid, long, stripes, blocks, a tail)
    check it here before it is used."""
    if checksums._fn is None:
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("xxhash") or "").XXH3_64bits_dispatch
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_uint64, (ctypes.c_void_p, ctypes.c_size_t)
    probe = np.random.default_rng(17).integers(0, 256, 65536 + 61, dtype=np.uint8).tobytes()
    for size in (0, 3, 16, 128, 240, 1024, 4096, 65536, len(probe)):
        if fn(probe[:size], size) != xxhash.xxh3_64_intdigest(probe[:size]):
            return None
    return ctypes.cast(fn, ctypes.c_void_p).value


# The XXH3 the C read verifies records with (Batch.run's xxh3): the dispatching one where it
# agrees, else the checked one kvtier.checksums hashes with.
XXH3_READ: int | None = _dispatching_xxh3() or checksums._fn


def available() -> bool:
    """True where the C read can run at all (module built, libxxhash checked)."""
    return native is not None and checksums._fn is not None


def record_batch(log: SegmentLog, into: np.ndarray, rows: np.ndarray, segs: np.ndarray,
                 offs: np.ndarray, sums: np.ndarray, held: Sequence[Segment]) -> Any | None:
    """A _reads.Batch of records (segment id, offset in 4 KiB units) into rows of ``into``
    (the host pool's 2-D array), each checked against sums; None where the C read does not
    apply. held: the segments pinned for this read (the only ones it reads from)."""
    if native is None or checksums._fn is None or log._aio_reads is None:
        return None
    rb = log.record_bytes
    if not isinstance(into, np.ndarray):
        return None                 # an HBM pool's device array: never an address for AIO
    if (rb != log.block_bytes or into.ndim != 2 or into.shape[1] != rb or into.strides[1] != 1
            or into.strides[0] % ALIGN):
        return None
    tab = np.array([(s.seg_id, s.fd, s.start, s.size) for s in held],
                   dtype=np.int64).reshape(-1, 4)
    try:
        # (the array's own alignment is checked in C, from its buffer)
        return native.Batch(tab, np.ascontiguousarray(segs, dtype=np.int64),
                            np.ascontiguousarray(offs, dtype=np.int64),
                            np.ascontiguousarray(rows, dtype=np.int64), into, rb,
                            np.ascontiguousarray(sums, dtype=np.uint64))
    except BufferError:
        return None                 # rows not on 4 KiB boundaries: read_rows' fallback


def run_batch(log: SegmentLog, batch: Any) -> None:
    """Read batch on this thread, the GIL released for the whole read, on one of the log's
    AIO contexts. OSError when the read failed mid-way (that context is gone then)."""
    log._aio_reads.run_native(lambda ctx, depth: batch.run(ctx, depth, XXH3_READ))


def verdicts(log: SegmentLog, batch: Any) -> np.ndarray:
    """A batch's verdicts once read (by run_batch or a Reader): True where the record was read
    whole and verified. Counts the bytes it read in the log's bytes_read, as read_rows does."""
    log.bytes_read += log.record_bytes * batch.requests
    return np.frombuffer(batch.ok(), dtype=np.bool_)
