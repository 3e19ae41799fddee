"""Batch headers: the index that each append writes into its own segment (format 3).

A format 3 segment (magic KVTSEG03) begins every append, and every IOV_MAX-record chunk of one,
with a header of one or more record slots, written in the same pwritev as the records it
describes and made durable by the same fdatasync::

    0   8s   b"KVTBATCH"
    8   u32  header format (1)
    12  u32  namespace id
    16  u32  segment id
    20  u32  count: data records that follow the header, back to back
    24  u32  entry_bytes: bytes of each index entry (0: records without an index)
    28  u32  slots: record slots the header takes; its first record starts slots x record_bytes on
    32  u64  the header's own file offset (a header copied elsewhere does not validate)
    40  u64  the segment's nonce (random, from its file header: a recycled file's old bytes,
             a client's block among them, cannot pass for a header of its new life)
    48  u64  xxh3-64 of the entries
    56  u64  xxh3-64 of bytes 0..64 with this field zero
    64       count x entry_bytes entries, opaque to the tier (coherence.journal: key + record)

So the log describes itself: one fdatasync makes a batch's bytes and its index durable, and
LMDB can be brought up to date later (coherence.journal). A header is trusted only when its
magic, both checksums, its namespace, segment, nonce and offset all match and its records lie
inside the file; anything else ends the walk of that segment (``scan``). The records' own checksums
(in the entries) are checked by whoever replays them, so a header that reached the disk ahead
of its records (a torn tail) never makes a record current. Appends of one log are serialised
and each is synced before the next begins, so only the tail of a segment can be torn.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

BATCH_MAGIC = b"KVTBATCH"
FORMAT = 1
FIXED_BYTES = 64                        # the fixed part; entries follow at this offset
_FIXED = struct.Struct("<8sIIIIIIQQQQ")  # 64 bytes: magic .. head checksum


def header_slots(count: int, entry_bytes: int, record_bytes: int) -> int:
    """Record slots a header of count entries takes (at least one)."""
    return -(-(FIXED_BYTES + count * entry_bytes) // record_bytes)


def fit(room: int, want: int, entry_bytes: int, record_bytes: int) -> int:
    """The most records (at most want) that fit, with their header, in room record slots."""
    if room < 2 or want <= 0:
        return 0
    t = min(want, (room * record_bytes - FIXED_BYTES) // (record_bytes + entry_bytes))
    while t < want and t + 1 + header_slots(t + 1, entry_bytes, record_bytes) <= room:
        t += 1
    while t > 0 and t + header_slots(t, entry_bytes, record_bytes) > room:
        t -= 1
    return t


def pack(out: memoryview, ns_id: int, seg_id: int, nonce: int, offset: int, count: int,
         entries: np.ndarray | None, record_bytes: int) -> int:
    """Write the header of count records at file offset ``offset`` into out (zeroed, at
    least header_slots() x record_bytes). Returns its slots."""
    body = b"" if entries is None else np.ascontiguousarray(entries).view(np.uint8).tobytes()
    entry_bytes = len(body) // count if count and body else 0
    if entry_bytes * count != len(body):
        raise ValueError(f"{len(body)} bytes of entries for {count} records")
    slots = header_slots(count, entry_bytes, record_bytes)
    fixed = _FIXED.pack(BATCH_MAGIC, FORMAT, ns_id, seg_id, count, entry_bytes, slots, offset,
                        nonce, xxhash.xxh3_64_intdigest(body), 0)
    head = xxhash.xxh3_64_intdigest(fixed)
    out[:_FIXED.size] = fixed[:56] + head.to_bytes(8, "little")
    out[FIXED_BYTES:FIXED_BYTES + len(body)] = body
    return slots


@dataclass(slots=True)
class Batch:
    """One valid header: where its records are, and its entries (count x entry_bytes)."""

    offset: int              # the header's file offset
    data: int                # file offset of its first record
    count: int
    entry_bytes: int
    entries: np.ndarray      # uint8, (count, entry_bytes)


@dataclass(slots=True)
class Scan:
    """What a walk of one segment from a start offset found."""

    batches: list[Batch]
    end: int                 # where the walk stopped
    problem: str | None      # why it stopped before the file's end (None: at the end)
    garbage: bool            # the slot it stopped at holds non-zero bytes (damage, not a tail)


def scan(fd: int, ns_id: int, seg_id: int, nonce: int, start: int, size: int,
         record_bytes: int, buf: memoryview) -> Scan:
    """Walk the headers of one segment from ``start`` (a record boundary) to ``size``.

    ``buf`` is a page-aligned buffer of at least one record slot (O_DIRECT reads need one).
    The walk stops at the first slot that is not a valid header of this segment: at the end
    of what was written, or at a torn or damaged header (``problem`` says which)."""
    out: list[Batch] = []
    off = start
    while off + record_bytes <= size:
        slot = buf[:record_bytes]
        got = os.preadv(fd, [slot], off)
        if got != record_bytes:
            return Scan(out, off, f"short read at {off}", False)
        raw = bytes(slot[:_FIXED.size])
        why = _check_fixed(raw, ns_id, seg_id, nonce, off)
        if why is not None:
            return Scan(out, off, why, _nonzero(slot))
        (_m, _f, _ns, _sid, count, entry_bytes, slots, _o, _n, body_sum, _h) = _FIXED.unpack(raw)
        body_len = count * entry_bytes
        if slots != header_slots(count, entry_bytes, record_bytes) or count == 0:
            return Scan(out, off, f"header at {off}: {slots} slots for {count} entries", True)
        data = off + slots * record_bytes
        if data + count * record_bytes > size:
            return Scan(out, off, f"header at {off}: its {count} records run past the end "
                                  f"of the file ({size} bytes): a torn tail", False)
        body = bytearray(body_len)
        have = min(body_len, record_bytes - FIXED_BYTES)
        body[:have] = slot[FIXED_BYTES:FIXED_BYTES + have]
        if have < body_len:
            rest = bytearray((slots - 1) * record_bytes)
            # the rest of the header slots, read through the same aligned buffer
            pos = 0
            while pos < len(rest):
                n = min(len(buf), len(rest) - pos)
                if os.preadv(fd, [buf[:n]], off + record_bytes + pos) != n:
                    return Scan(out, off, f"short read of the header at {off}", False)
                rest[pos:pos + n] = buf[:n]
                pos += n
            body[have:] = rest[:body_len - have]
        if xxhash.xxh3_64_intdigest(bytes(body)) != body_sum:
            return Scan(out, off, f"header at {off}: its entries fail their checksum", True)
        ent = np.frombuffer(bytes(body), dtype=np.uint8).reshape(count, entry_bytes) \
            if entry_bytes else np.empty((count, 0), dtype=np.uint8)
        out.append(Batch(off, data, count, entry_bytes, ent))
        off = data + count * record_bytes
    return Scan(out, off, None, False)


def _check_fixed(raw: bytes, ns_id: int, seg_id: int, nonce: int, off: int) -> str | None:
    if raw[:8] != BATCH_MAGIC:
        return f"no batch header at {off}"
    fields = _FIXED.unpack(raw)
    want = xxhash.xxh3_64_intdigest(raw[:56] + bytes(8))
    if fields[10] != want:
        return f"header at {off} fails its checksum"
    if fields[1] != FORMAT:
        return f"header at {off} is of format {fields[1]}, this kvtier reads {FORMAT}"
    if fields[2] != ns_id or fields[3] != seg_id or fields[7] != off or fields[8] != nonce:
        return (f"header at {off} names namespace {fields[2]}, segment {fields[3]}, offset "
                f"{fields[7]}: not this one's (an earlier life of a recycled file?)")
    return None


def _nonzero(slot: memoryview) -> bool:
    return bool(np.frombuffer(slot, dtype=np.uint8).any())
