"""One segment file of the NVMe tier: its 4 KiB header (formats 1 to 3), the Segment record
the log keeps of it, and the small file helpers the log uses (aligned buffers, truncation,
directory sync). tiers.nvme re-exports every name here."""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from kvtier.tiers.aio import buffer_address

MAGIC = b"KVTSEG03"
MAGIC_V2 = b"KVTSEG02"             # no batch headers; still read, never appended to
MAGIC_V1 = b"KVTSEG01"             # records at HEADER_BYTES; still read, never written
HEADER_BYTES = 4096
ALIGN = 4096
DATA_ALIGN_MAX = 1 << 20           # records align to their own size, up to this
_HEADER = struct.Struct("<8sIIIII")
_LIFE = struct.Struct("<QI")       # at byte 32 of a format 3 header: nonce, flags
_LIFE_AT = 32
FLAG_RECYCLED = 1
_HEADER_V1 = struct.Struct("<8sIIII")


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def data_start(record_bytes: int) -> int:
    """Where a new segment puts record 0: record_bytes rounded up from the header, at most
    DATA_ALIGN_MAX (tiers.nvme's docstring says why)."""
    return round_up(HEADER_BYTES, min(record_bytes, DATA_ALIGN_MAX))


@dataclass(slots=True)
class Segment:
    seg_id: int
    path: Path
    fd: int
    size: int          # bytes written so far, header included
    live: int = 0      # bytes of records that a page-table row points to
    direct: bool = False   # opened with O_DIRECT (the file system allowed it)
    start: int = HEADER_BYTES   # file offset of record 0
    born: int = 0      # creation order among all segments of this process (FIFO reclaim)
    readers: int = 0   # reads in flight (pinned by coherence); the file outlives them
    doomed: bool = False   # reclaimed: deleted when its last reader is done
    batched: bool = True   # format 3: appends carry batch headers (older: read-only)
    full: bool = False     # no more appends: restart found a torn or damaged tail in it
    nonce: int = 0         # random per life of the file, in every batch header (batchlog)
    recycled: bool = False  # a reclaimed segment's file: old bytes lie past ``size``
    file_bytes: int = 0    # the file's length on disk (above size in a recycled file)
    sync_failed: bool = False   # an fdatasync failed: what was written since may be lost

    def holds(self, offset: int, record_bytes: int) -> bool:
        """True when a whole record at file offset ``offset`` lies inside what was written."""
        return (offset >= self.start and (offset - self.start) % record_bytes == 0
                and offset + record_bytes <= self.size)


def _unpack_header(raw: bytes) -> tuple:
    """(magic, block_bytes, record_bytes, ns_id, seg_id, data start) of either format; magic is
    None when the file is not a kvtier segment, or its data start is not a record boundary."""
    if raw[:8] in (MAGIC, MAGIC_V2):
        fields = _HEADER.unpack(raw[: _HEADER.size])
        start = fields[5]
        if start < HEADER_BYTES or start % ALIGN:
            return (None,) + fields[1:]
        return fields
    if raw[:8] == MAGIC_V1:
        return _HEADER_V1.unpack(raw[: _HEADER_V1.size]) + (HEADER_BYTES,)
    return (None, 0, 0, 0, 0, HEADER_BYTES)


def _truncate(seg: Segment) -> None:
    try:
        os.ftruncate(seg.fd, seg.size)
        seg.file_bytes = seg.size
    except OSError:
        pass


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def _is_aligned(buf: memoryview) -> bool:
    """True when buf starts on a 4 KiB boundary (O_DIRECT needs it; slots of aligned blocks do).
    buffer_address: ctypes for a writable buffer, ~1 us against numpy's view's ~5 (a put's
    write checks each block; an NVMe read each slot)."""
    return buffer_address(buf) % ALIGN == 0


def _aligned(n: int) -> mmap.mmap:
    """A page-aligned, zero-filled buffer (anonymous mmap) usable with O_DIRECT."""
    return mmap.mmap(-1, round_up(max(n, 1)))
