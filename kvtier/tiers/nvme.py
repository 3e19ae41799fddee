"""The NVMe tier: an append-only log of segment files, one directory per namespace.

On disk::

    <data_dir>/nvme/ns-<id>/seg-00000001.kvt
        [4 KiB header: magic, block_bytes, record_bytes, namespace id, segment id, data start]
        [unused up to data start]
        [batch header][record][record]...[batch header][record]...
                                         each slot record_bytes = block_bytes rounded up to 4 KiB

Records begin at ``data start``: record_bytes rounded up from the header, at most 1 MiB, so a
64 KiB record sits on a 64 KiB boundary and a 1 MiB one on a 1 MiB boundary, as fio's blocks do.
On the development VM's disk the 4 KiB offset cost fio 5-8% and kvtier's sequential reads 1.28x
(docs/DESIGN-NOTES.md, "NVMe: aligned records and extending writes"). Format 1 segments (magic
KVTSEG01, written before 2026-12) have no such field and start their records right after the
4 KiB header. Format 3 (KVTSEG03) puts a batch header (tiers.batchlog: the keys, versions and
checksums of the records that follow) in the slot(s) before every append; formats 1 and 2 have
none: they are read as before, never appended to again.

A record is a block's bytes and nothing else; the batch header before it says which key and
version it holds, so that one fdatasync makes bytes and index durable and LMDB, which the
service reads at start, can be brought up to date later (coherence.journal). The xxh3-64
checksum is checked on every read. Records start on 4 KiB boundaries, and when block_bytes is
a multiple of 4 KiB the segment is opened with O_DIRECT and host slots (page-aligned, see
tiers.host) go to the device with no bounce copy. Other block sizes go through an aligned
staging buffer and the page cache.

Appends are batched: one pwritev per run of up to IOV_MAX records (header included), one
fdatasync per segment touched, and only then is the caller's batch durable. A reclaimed
segment's file is kept as a spare that the next segment takes over (see remove()). Reads merge
records that are adjacent on disk into one preadv and spread runs over ``io_threads`` threads.

The tier keeps per-segment live byte counts so that coherence can choose segments to compact. It
holds no policy: what is live, and when to compact, is decided by coherence.

Back-ends: ``PosixBackend`` (pread/pwrite) everywhere, and ``KvikioBackend`` (GDS, or its POSIX
compat mode) when CUDA and kvikio are present; ``make_backend`` chooses.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np

from kvtier.errors import DataDirError, StorageError
from kvtier.tiers.aio import (IOCB_CMD_PREADV, IOCB_CMD_PWRITEV, acquire_shared,
                              buffer_address, release_shared)
from kvtier.tiers.backend import Backend, PosixBackend, make_backend  # noqa: F401 (re-exported)
from kvtier.tiers.batchlog import fit, header_slots, pack
from kvtier.tiers.segfile import (  # noqa: F401 (re-exported: callers import them from here)
    _HEADER, _HEADER_V1, _LIFE, _LIFE_AT, ALIGN, DATA_ALIGN_MAX, FLAG_RECYCLED, HEADER_BYTES,
    MAGIC, MAGIC_V1, MAGIC_V2, Segment, _aligned, _is_aligned, _is_direct, _sync_dir,
    _truncate, _unpack_header, data_start, round_up)

IOV_MAX = 1024
# Reclaimed files kept per namespace for the next segments (remove()). A compaction empties
# several segments at once, and each one past the spares was unlinked inside the put that ran
# it: ~11 ms a 64 MiB file on the dev VM's ext4 (mounted with discard), 7-8 ms of a reclaim's
# ~30 in the randrw fio jobs (issue 17, fio10). Kept, it is a rename, and the next segments'
# appends overwrite written blocks. Their bytes count as used (total_bytes), as room for the
# next segments (bytes_for); compaction's fill test leaves them out (coherence.space).
SPARES = 4
_BORN = itertools.count(1)         # creation order of segments, all namespaces (oldest first)


class SegmentLog:
    """The segment files of one namespace. Not thread-safe for appends; reads may run beside."""

    def __init__(self, directory: Path, ns_id: int, block_bytes: int, segment_bytes: int,
                 io_threads: int = 4, backend: Backend | None = None,
                 readonly: bool = False, aio_depth: int = 256, index_bytes: int = 0) -> None:
        self.dir = Path(directory)
        self.readonly = readonly
        self.foreign: list[Path] = []     # files skipped in readonly mode (kvtier check)
        self.ns_id = ns_id
        self.block_bytes = block_bytes
        self.record_bytes = round_up(block_bytes)
        # Where new segments put record 0 (see the module docstring).
        self.data_start = data_start(self.record_bytes)
        # Room for a batch header and one record at least.
        self.segment_bytes = max(segment_bytes, self.data_start + 2 * self.record_bytes)
        self.index_bytes = index_bytes     # bytes of one batch-header entry (capacity sums)
        self.direct = block_bytes % ALIGN == 0
        self.backend = backend or PosixBackend()
        self.segments: dict[int, Segment] = {}
        self.doomed: dict[int, Segment] = {}     # reclaimed, waiting for their readers
        # Files unlinked or renamed away (to spares) so far, and how many of those a synced
        # directory covers (marks()).
        self._removals = self._removals_synced = 0
        # Segments taken out of segments or doomed whose file _delete has not unlinked yet:
        # they keep their mark (marks()) until the unlink is counted in _removals.
        self._going: dict[int, Segment] = {}
        self.spares: list[Segment] = []          # reclaimed files the next segments reuse
        self._last_id = 0
        self.bytes_written = 0       # device bytes, padding and compaction included
        self.bytes_read = 0
        self._lock = threading.Lock()              # segments, sizes and readers (short holds)
        self._append_lock = threading.Lock()       # one append at a time (writes and syncs)
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvtier-io")
        self._io_threads = io_threads
        self._staging: mmap.mmap | None = None
        self._head: mmap.mmap | None = None          # write()'s header buffer (_header)
        self._zeros = bytes(1 << 16)
        # Native AIO keeps a whole batch in flight from one thread (see tiers/aio.py); only for
        # O_DIRECT files of the POSIX back-end, where it is truly asynchronous.
        self._aio = None
        if self.direct and type(self.backend) is PosixBackend:
            self._aio = acquire_shared(aio_depth)  # one per process, or None: threads
        # Reads into host memory (read_rows) use native AIO whatever the back-end: kvikio's
        # compat mode is POSIX reads too, one Python future per block (issue 17, H200: most
        # of an NVMe get's GIL time). On files without O_DIRECT, io_submit reads synchronously,
        # in C with the GIL released.
        self._aio_reads = self._aio
        if (self._aio_reads is None and self.direct and not readonly
                and getattr(self.backend, "posix_reads", False)):
            self._aio_reads = acquire_shared(aio_depth)
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise DataDirError(f"cannot create NVMe directory {self.dir}: {exc.strerror}; "
                               "check that data_dir exists and is writable") from None
        self._open_existing()

    # ------------------------------------------------------------------ segments

    def _open_existing(self) -> None:
        if not self.readonly:
            for path in self.dir.glob("spare-*.kvt"):   # kept for reuse by a run now gone
                path.unlink()
        for path in sorted(self.dir.glob("seg-*.kvt")):
            try:
                seg_id = int(path.stem.split("-", 1)[1])
            except ValueError:
                continue
            try:
                fd = self.backend.open(path, create=False, direct=self.direct)
            except OSError as exc:
                if self.readonly:
                    self.foreign.append(path)
                    continue
                raise DataDirError(f"cannot open segment {path}: {exc.strerror} (a symbolic "
                                   "link, or wrong permissions?)") from None
            buf = _aligned(HEADER_BYTES)
            got = os.preadv(fd, [memoryview(buf)], 0)   # aligned, so O_DIRECT accepts it
            if got < _HEADER_V1.size or (not any(bytes(buf[:_HEADER_V1.size]))
                                         and os.fstat(fd).st_size <= HEADER_BYTES):
                # A segment whose header never reached the disk holds nothing LMDB points to
                # (nor does a header's length of zeros: a crash after a new file's header
                # write, before any record's sync, may leave its length and not its bytes).
                self.backend.close(fd)
                if not self.readonly:
                    path.unlink()
                continue
            magic, block_bytes, record_bytes, ns_id, sid, start = _unpack_header(bytes(buf))
            if (magic is None or block_bytes != self.block_bytes or sid != seg_id
                    or record_bytes != self.record_bytes):
                self.backend.close(fd)
                if self.readonly:
                    self.foreign.append(path)
                    continue
                raise DataDirError(
                    f"{path} is not a kvtier segment of this namespace (bad header); move it out "
                    "of the data directory or run `kvtier check --repair`")
            length = os.fstat(fd).st_size
            size = start + max(0, length - start) // self.record_bytes * self.record_bytes
            nonce, flags = _LIFE.unpack_from(bytes(buf), _LIFE_AT)
            # A recycled file's size is where its batch headers end: the replay's walk finds
            # it (coherence.journal); until then the file's length stands in.
            self.segments[seg_id] = Segment(seg_id, path, fd, size, direct=_is_direct(fd),
                                            start=start, born=next(_BORN),
                                            batched=bytes(buf[:8]) == MAGIC, nonce=nonce,
                                            recycled=bool(flags & FLAG_RECYCLED),
                                            file_bytes=length)

    def _new_segment(self) -> Segment:
        # Never an id used before in this run: a reclaimed segment's file may still be open
        # for its readers (doomed), and LMDB may still name it until the next commit.
        seg_id = max(max(self.segments, default=0), max(self.doomed, default=0),
                     self._last_id) + 1
        self._last_id = seg_id
        path = self.dir / f"seg-{seg_id:08d}.kvt"
        spare = self.spares.pop() if self.spares else None
        nonce = int.from_bytes(os.urandom(8), "little")
        header = _aligned(HEADER_BYTES)
        header[: _HEADER.size] = _HEADER.pack(MAGIC, self.block_bytes, self.record_bytes,
                                              self.ns_id, seg_id, self.data_start)
        _LIFE.pack_into(header, _LIFE_AT, nonce, FLAG_RECYCLED if spare else 0)
        try:
            if spare is None:
                fd, length = self.backend.open(path, create=True, direct=self.direct), 0
                try:
                    self._write_all(fd, [memoryview(header)], 0, path)
                    # Its name durable before its records (a record's fdatasync does not
                    # make a new file's directory entry durable: POSIX asks the directory's
                    # fsync, which no path made for a new file before rev8).
                    _sync_dir(self.dir)
                except BaseException:
                    # Not a segment: closed and gone (it was left untracked, its fd open
                    # until a restart: rev8). Killed here instead, the file holds no record
                    # and a short or all-zero header, which the start deletes.
                    self.backend.close(fd)
                    path.unlink(missing_ok=True)
                    raise
            else:
                # The new header first, durable, then the name: a process killed between
                # the rename and the header write left seg-N holding the spare's old header
                # (another segment's id), and the restart refused the data directory (fio5,
                # bench/fio_crash.py). Killed before the rename, the spare-*.kvt is deleted
                # at the next start.
                fd, length = spare.fd, spare.file_bytes
                renamed = False
                try:
                    # remove()'s rename to spare-M durable before the file's header changes:
                    # otherwise a crash could bring back seg-M's name over seg-N's header,
                    # and the restart refused the directory (rev8).
                    _sync_dir(self.dir)
                    self._write_all(fd, [memoryview(header)], 0, spare.path)
                    self.backend.sync(fd)
                    os.rename(spare.path, path)   # (a refused rename left the spare lost:
                    renamed = True                # its fd open, its file unused: rev7)
                    _sync_dir(self.dir)   # the file's new name is durable before its records
                except BaseException:
                    # Still a spare: its next use writes again. A failed sync after the
                    # rename names it back (seg-N was left untracked, its fd open: rev8);
                    # either name is sound after a crash (seg-N's own header, no record;
                    # a spare-*.kvt is deleted at start).
                    if renamed:
                        try:
                            os.rename(path, spare.path)
                        except OSError:
                            self.backend.close(fd)
                            path.unlink(missing_ok=True)
                            raise
                    self.spares.append(spare)
                    raise
        except OSError as exc:
            raise StorageError(f"cannot create segment {path}: {exc.strerror}") from None
        seg = Segment(seg_id, path, fd, self.data_start, direct=_is_direct(fd),
                      start=self.data_start, born=next(_BORN), nonce=nonce,
                      recycled=spare is not None, file_bytes=max(length, self.data_start))
        self.segments[seg_id] = seg
        return seg

    def _open_for_append(self, seg: Segment | None) -> bool:
        """True when an append may go to seg: format 3, room for a header and a record."""
        return (seg is not None and seg.batched and not seg.full
                and seg.size + 2 * self.record_bytes <= self.segment_bytes)

    def _active(self) -> Segment:
        if self.segments:
            seg = self.segments[max(self.segments)]
            if self._open_for_append(seg):
                return seg
        return self._new_segment()

    @property
    def active_id(self) -> int:
        return max(self.segments, default=0)

    def total_bytes(self) -> int:
        """Bytes of the segment files, as on disk (no space is allocated beyond their length),
        reclaimed segments that readers still hold and spare files included."""
        # _going first: a segment enters it only after leaving segments or doomed (both
        # under _lock, read here without it), so it is never counted twice; counted until
        # _delete's unlink, as the disk holds it until then (space.capacity_now, rev10).
        return sum(max(s.size, s.file_bytes) for s in
                   (*self._going.values(), *self.doomed.values(), *self.segments.values(),
                    *self.spares))

    def spare_bytes(self) -> int:
        """The spare files' bytes (in total_bytes): room the next segments take over."""
        return sum(s.file_bytes for s in self.spares)

    def bytes_for(self, n: int) -> int:
        """Disk bytes that appending n records would add: the records, and the header of
        every segment they open."""
        rec, eb = self.record_bytes, self.index_bytes
        seg = self.segments.get(self.active_id)
        spares = [s.file_bytes for s in self.spares]
        if self._open_for_append(seg):
            size, counted = seg.size, max(seg.size, seg.file_bytes)
        else:
            size = counted = self.segment_bytes         # no room: the next chunk opens one
        total = 0
        while n > 0:                  # as append() cuts it: chunks, each behind its header
            take = fit((self.segment_bytes - size) // rec, min(n, IOV_MAX), eb, rec)
            if take == 0:             # a new segment: a spare file's bytes are counted already
                total += max(0, size - counted)
                size, counted = self.data_start, (spares.pop() if spares else 0)
                continue
            size += (take + header_slots(take, eb, rec)) * rec
            n -= take
        return total + max(0, size - counted)

    def sealed(self) -> list[Segment]:
        """Segments no append goes to any more (every one but the newest, unless it is full)."""
        active = self.active_id
        if not self._open_for_append(self.segments.get(active)):
            active = -1
        return [s for sid, s in self.segments.items() if sid != active]

    def live_bytes(self) -> int:
        return sum(s.live for s in self.segments.values())

    # ------------------------------------------------------------------ append

    def append(self, blocks: Sequence[memoryview], entries: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """Write blocks at the end of the log, fdatasync, return (segment ids, offsets in 4 KiB).

        Every block is exactly block_bytes. ``entries`` (one row of index_bytes per block, or
        None) go into the batch header written before each chunk (tiers.batchlog); when this
        returns, the bytes and their headers are durable. Raises StorageError (disk full, I/O).
        """
        segs, offs, touched = self.write(blocks, entries)
        self.sync(touched)
        return segs, offs

    def write(self, blocks: Sequence[memoryview], entries: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray, list[Segment]]:
        """append() without its fdatasync: the records are written (not yet durable) and the
        segments they went to are returned for sync(). Appends are one at a time; a sync may
        run beside the next append's writes (issue 17: two write_through puts' flushes
        overlap their fdatasync with the next one's writes, coherence.persist)."""
        if entries is not None:
            entries = np.ascontiguousarray(entries).view(np.uint8).reshape(len(blocks), -1)
        n = len(blocks)
        segs = np.empty(n, dtype=np.int32)
        offs = np.empty(n, dtype=np.uint32)
        touched: dict[int, Segment] = {}
        i = 0
        # _lock guards the segment table and sizes only; the writes and the fdatasync run
        # outside it. Readers pin segments under it (with the engine lock held), so an append
        # that held it across its syncs stalled every NVMe get, and through the engine lock
        # every other get, for the length of a flush (issue 17: py-spy of a randrw job, 21% of
        # the read thread's time in unpin and 10% in pin). No row points at the records being
        # written until this returns, and reclaims, like appends, run only under the flush
        # writer (coherence.persist), so no segment being written can be removed meanwhile.
        with self._append_lock:
            while i < n:
                with self._lock:
                    seg = self._active()
                rec = self.record_bytes
                eb = 0 if entries is None else entries.shape[1]
                take = fit((self.segment_bytes - seg.size) // rec, min(n - i, IOV_MAX), eb, rec)
                chunk = blocks[i: i + take]
                head = self._header(header_slots(take, eb, rec) * rec)
                slots = pack(memoryview(head), self.ns_id, seg.seg_id, seg.nonce, seg.size,
                             take, None if entries is None else entries[i: i + take], rec)
                # Each block's address once: checked for O_DIRECT here, and the AIO's iocbs
                # point at them (issue 17, fio6: they were taken twice per block).
                at = [buffer_address(b) for b in chunk]
                direct_ok = (self.record_bytes == self.block_bytes
                             and all(a % ALIGN == 0 for a in at))
                bufs = [head[k * rec:(k + 1) * rec] for k in range(slots)]
                h0 = buffer_address(head)
                addrs = [h0 + k * rec for k in range(slots)] + at if direct_ok else None
                # extend, not +=: with blocks a 2-D array, list += array is numpy's
                # elementwise add (the headers added into the blocks), and the writes failed.
                bufs.extend(chunk if direct_ok else self._stage(chunk))
                try:
                    if self._aio is not None and seg.direct and len(bufs) > 1:
                        self._write_aio(seg, bufs, addrs)
                    else:
                        self._write_all(seg.fd, bufs, seg.size, seg.path)
                except StorageError:
                    _truncate(seg)     # give a full disk back what the failed write took
                    raise
                segs[i: i + take] = seg.seg_id
                offs[i: i + take] = (seg.size + (slots + np.arange(take)) * rec) // ALIGN
                with self._lock:
                    seg.size += (slots + take) * rec
                    seg.file_bytes = max(seg.file_bytes, seg.size)
                    self.bytes_written += (slots + take) * rec
                touched[seg.seg_id] = seg
                i += take
        return segs, offs, list(touched.values())

    def _header(self, n: int) -> memoryview:
        """A zeroed, page-aligned buffer of n bytes for a chunk's header (_append_lock held).
        One kept per log: a fresh anonymous mmap per write cost its mmap and munmap and, as
        the O_DIRECT write pins every page of it, a page fault per 4 KiB (issue 17, fio6)."""
        if self._head is None or len(self._head) < n:
            self._head = _aligned(n)
        view = memoryview(self._head)[:n]
        view[:] = bytes(n) if n > len(self._zeros) else memoryview(self._zeros)[:n]
        return view

    def sync(self, touched: Sequence[Segment]) -> None:
        """fdatasync the segments a write() went to: its records (and every record written
        to them before this call) are then durable. Raises StorageError."""
        for seg in touched:
            # After a failed fdatasync the kernel does not write those pages again: a later
            # sync's success covers only later pages, and a replay stops at the hole (rev10).
            if seg.sync_failed:
                raise StorageError(f"an earlier fdatasync of {seg.path} failed: the batches "
                                   "after it are not durable")
            try:
                self.backend.sync(seg.fd)
            except OSError as exc:
                seg.sync_failed = seg.full = True
                raise StorageError(f"fdatasync of {seg.path} failed: {exc.strerror}") from None

    def _write_aio(self, seg: Segment, bufs: Sequence[memoryview],
                   addrs: Sequence[int] | None = None) -> None:
        """The chunk as up to 16 concurrent PWRITEVs of consecutive records (addrs: the
        buffers' addresses, where the caller has them)."""
        per = max(1, -(-len(bufs) // 16))
        # Extend the file over the chunk first. ext4 runs an O_DIRECT write that extends i_size
        # synchronously inside io_submit (it must update the size on completion), so appends
        # past the end went one at a time: io_submit took 9.8 ms per 16 MiB and io_getevents
        # found them done (strace -w, bench/nvme.py). Inside i_size they are truly in flight.
        # The size reaches the disk with the fdatasync that follows, before LMDB points at any
        # of these records; after a crash in between, the tail is records no row refers to.
        try:
            if seg.size + len(bufs) * self.record_bytes > seg.file_bytes:   # not inside a
                os.ftruncate(seg.fd, seg.size + len(bufs) * self.record_bytes)  # recycled file
        except OSError as exc:
            raise StorageError(f"cannot extend {seg.path}: {exc.strerror}") from None
        rec = self.record_bytes
        if addrs is not None and all(len(b) == rec for b in bufs):
            # The iocbs and iovecs built in C (tiers/_aio.c write_run): None where not built.
            res = self._aio.write_run(seg.fd, seg.size, np.asarray(addrs, dtype=np.int64),
                                      rec, per)
            if res is not None:
                want = np.full(res.size, per * rec, dtype=np.int64)
                want[-1] = (len(bufs) - per * (res.size - 1)) * rec
                bad = np.flatnonzero(res != want)
                if bad.size:
                    self._write_failed(seg, int(res[bad[0]]))
                return
        reqs = [(seg.fd, bufs[i: i + per], seg.size + i * rec) for i in range(0, len(bufs), per)]
        res = self._aio.run(IOCB_CMD_PWRITEV, reqs, addrs=addrs)
        for (_fd, b, _off), got in zip(reqs, res.tolist()):
            if got != sum(len(x) for x in b):
                self._write_failed(seg, got)

    @staticmethod
    def _write_failed(seg: Segment, got: int) -> None:
        """A request of an append wrote got bytes (or -errno), not all it had: StorageError."""
        hint = "; free space or raise nvme_capacity" if got == -errno.ENOSPC else ""
        raise StorageError(f"write to {seg.path} failed "
                           f"({os.strerror(-got) if got < 0 else 'short write'}){hint}")

    def _stage(self, chunk: Sequence[memoryview]) -> list[memoryview]:
        need = len(chunk) * self.record_bytes
        if self._staging is None or len(self._staging) < need:
            self._staging = mmap.mmap(-1, max(need, 1 << 20))
        out = []
        view = memoryview(self._staging)
        for k, block in enumerate(chunk):
            rec = view[k * self.record_bytes: (k + 1) * self.record_bytes]
            rec[: self.block_bytes] = block
            out.append(rec)
        return out

    def _write_all(self, fd: int, bufs: Sequence[memoryview], offset: int, path: Path) -> None:
        want = sum(len(b) for b in bufs)
        try:
            done = self.backend.pwritev(fd, bufs, offset)
        except OSError as exc:
            hint = "; free space or raise nvme_capacity" if exc.errno == errno.ENOSPC else ""
            raise StorageError(f"write to {path} failed: {exc.strerror}{hint}") from None
        if done != want:
            raise StorageError(f"short write to {path} ({done} of {want} bytes); disk full?")

    # ------------------------------------------------------------------ read

    def read(self, segs: np.ndarray, offs: np.ndarray, outs: Sequence[memoryview]) -> np.ndarray:
        """Read records into outs (block_bytes each). Returns a bool array: False where the record
        lies past the end of its segment or its segment is gone (a truncated or deleted file).
        Checksums are the caller's to verify."""
        n = len(outs)
        ok = np.ones(n, dtype=bool)
        if n == 0:
            return ok
        order = np.lexsort((offs, segs))
        runs: list[tuple[Segment, int, list[int]]] = []
        prev_seg, prev_off = -1, -1
        for k in order.tolist():
            sid, off = int(segs[k]), int(offs[k]) * ALIGN
            seg = self.segments.get(sid) or self.doomed.get(sid)   # doomed: pinned readers
            if seg is None or not seg.holds(off, self.record_bytes):
                ok[k] = False
                continue
            if sid == prev_seg and off == prev_off + self.record_bytes and len(runs[-1][2]) < IOV_MAX:
                runs[-1][2].append(k)
            else:
                runs.append((seg, off, [k]))
            prev_seg, prev_off = sid, off
        bad = self._run_reads(runs, outs)
        ok[bad] = False
        return ok

    def read_rows(self, segs: np.ndarray, offs: np.ndarray, into: np.ndarray,
                  rows: np.ndarray) -> np.ndarray | None:
        """read() straight into rows of ``into`` (a 2-D uint8 array of block_bytes columns, a
        host pool's slots): record i to into[rows[i]]. Returns read()'s mask, or None where
        this path does not apply (no AIO, records padded beyond block_bytes, rows not on 4 KiB
        boundaries) and the caller uses read().

        The requests are built by numpy and the batch is read by the C AIO loop with the GIL
        released: a few tens of microseconds of the GIL per batch, against tens of Python
        calls per record in read() (issue 17: other clients' gets of resident blocks waited
        for that GIL)."""
        aio = self._aio_reads
        rb = self.record_bytes
        base, stride = into.ctypes.data, into.strides[0]
        if (aio is None or rb != self.block_bytes or into.shape[1] != rb
                or into.strides[1] != 1 or base % ALIGN or stride % ALIGN):
            return None
        n = len(rows)
        ok = np.zeros(n, dtype=bool)
        if n == 0:
            return ok
        if np.min(rows) < 0 or np.max(rows) >= into.shape[0]:
            raise IndexError(f"read_rows: a row outside the {into.shape[0]} of the array")
        ids, inv = np.unique(np.asarray(segs, dtype=np.int64), return_inverse=True)
        meta = np.full((ids.size, 3), -1, dtype=np.int64)     # fd, start, size per segment
        for j, sid in enumerate(ids.tolist()):
            seg = self.segments.get(sid) or self.doomed.get(sid)   # doomed: pinned readers
            if seg is not None:
                meta[j] = seg.fd, seg.start, seg.size
        fd, start, size = meta[inv.reshape(-1)].T
        off = np.asarray(offs, dtype=np.int64) * ALIGN
        good = (fd >= 0) & (off >= start) & ((off - start) % rb == 0) & (off + rb <= size)
        idx = np.flatnonzero(good)
        idx = idx[np.lexsort((off[idx], fd[idx]))]      # the log's order, for the device
        addrs = base + np.asarray(rows, dtype=np.int64)[idx] * stride
        self.bytes_read += rb * idx.size
        got = aio.run_flat(IOCB_CMD_PREADV, fd[idx], off[idx], addrs, rb)
        ok[idx] = got == rb
        return ok

    def _run_reads(self, runs: list[tuple[Segment, int, list[int]]],
                   outs: Sequence[memoryview]) -> list[int]:
        padded = self.record_bytes != self.block_bytes

        def one(run: tuple[Segment, int, list[int]]) -> list[int]:
            seg, off, ks = run
            staged = padded or not all(_is_aligned(outs[k]) for k in ks)
            if staged:
                tmp = _aligned(self.record_bytes * len(ks))
                bufs = [memoryview(tmp)]
            else:
                bufs = [outs[k] for k in ks]
            want = self.record_bytes * len(ks)
            try:
                got = self.backend.preadv(seg.fd, bufs, off)
            except OSError:
                return ks
            if got != want:
                return ks
            if staged:
                for j, k in enumerate(ks):
                    outs[k][:] = tmp[j * self.record_bytes: j * self.record_bytes + self.block_bytes]
            return []

        if not runs:                # every record was refused by read()'s bounds check
            return []
        self.bytes_read += self.record_bytes * sum(len(r[2]) for r in runs)
        if self._aio is not None and all(r[0].direct for r in runs) and (
                len(runs) > 1 or len(runs[0][2]) * self.record_bytes > (1 << 20)):
            return self._read_aio(runs, outs)
        if len(runs) <= 2 or self._io_threads == 1:
            return [k for run in runs for k in one(run)]
        return [k for bad in self._pool.map(one, runs) for k in bad]

    def _read_aio(self, runs: list[tuple[Segment, int, list[int]]],
                  outs: Sequence[memoryview]) -> list[int]:
        """All runs in flight at once; a long run goes as several requests of about 1 MiB, so
        the device sees a queue of them rather than one large request at a time."""
        padded = self.record_bytes != self.block_bytes
        per = max(1, (1 << 20) // self.record_bytes)
        pieces: list[tuple[Segment, int, list[int]]] = []
        for seg, off, ks in runs:
            for j in range(0, len(ks), per):
                pieces.append((seg, off + j * self.record_bytes, ks[j:j + per]))
        reqs, staged = [], []
        for seg, off, ks in pieces:
            if padded or not all(_is_aligned(outs[k]) for k in ks):
                tmp = _aligned(self.record_bytes * len(ks))
                staged.append(tmp)
                reqs.append((seg.fd, [memoryview(tmp)], off))
            else:
                staged.append(None)
                reqs.append((seg.fd, [outs[k] for k in ks], off))
        res = self._aio.run(IOCB_CMD_PREADV, reqs)
        bad: list[int] = []
        for (seg, off, ks), tmp, got in zip(pieces, staged, res.tolist()):
            if got != self.record_bytes * len(ks):
                bad.extend(ks)
                continue
            if tmp is not None:
                for j, k in enumerate(ks):
                    outs[k][:] = tmp[j * self.record_bytes: j * self.record_bytes
                                     + self.block_bytes]
        return bad

    def in_bounds(self, segs: np.ndarray, offs: np.ndarray) -> np.ndarray:
        """Per record (segment id, offset in 4 KiB units): True when its segment is open and a
        whole record at that offset, on a record boundary, lies inside what was written. The
        vectorised form of Segment.holds, for restart and `kvtier check`."""
        segs = np.asarray(segs, dtype=np.int64)
        off = np.asarray(offs, dtype=np.int64) * ALIGN
        ids, inv = np.unique(segs, return_inverse=True)
        known = [self.segments.get(int(i)) for i in ids.tolist()]
        size = np.array([s.size if s else -1 for s in known], dtype=np.int64)[inv]
        start = np.array([s.start if s else 0 for s in known], dtype=np.int64)[inv]
        rec = self.record_bytes
        return (size >= 0) & (off >= start) & ((off - start) % rec == 0) & (off + rec <= size)

    # ------------------------------------------------------------------ accounting

    def add_live(self, segs: np.ndarray, sign: int = 1) -> None:
        """Count records as live (sign=1) or dead (sign=-1)."""
        if len(segs) == 0:
            return
        segs = np.asarray(segs)
        first = segs[0]
        if (segs == first).all():       # one segment (a put's batch, as a rule): no np.unique
            seg = self.segments.get(int(first))
            if seg is not None:
                seg.live += sign * len(segs) * self.record_bytes
            return
        if len(segs) <= 64:             # a put's old copies: a dict, not np.unique's sort
            pairs = Counter(segs.tolist()).items()      # (~20 us a put, issue 17, fio7)
        else:
            ids, counts = np.unique(segs, return_counts=True)
            pairs = zip(ids.tolist(), counts.tolist())
        for sid, cnt in pairs:
            seg = self.segments.get(sid)
            if seg is not None:
                seg.live += sign * cnt * self.record_bytes

    def compaction_candidates(self, threshold: float) -> list[int]:
        """Sealed segments whose live fraction is below threshold, emptiest first."""
        active = self.active_id
        out = []
        for seg in self.segments.values():
            body = seg.size - seg.start
            if seg.seg_id != active and body > 0 and seg.live < threshold * body:
                out.append((seg.live / body, seg.seg_id))
        return [sid for _, sid in sorted(out)]

    def pin(self, segs: np.ndarray, distinct: bool = False) -> list[Segment]:
        """Hold segments open for reads that run without the engine lock: one hold per
        segment named (the caller runs it under the engine lock, so once per segment, not
        per record). distinct: segs names each segment once already (plan_read's C gather
        says so), and np.unique (~7-12 us, dev VM) is skipped."""
        out = []
        ids = (np.asarray(segs) if distinct else np.unique(np.asarray(segs))).tolist()
        with self._lock:
            for sid in ids:
                seg = self.segments.get(sid)
                if seg is not None:
                    seg.readers += 1
                    out.append(seg)
        return out

    def unpin(self, held: list[Segment]) -> None:
        """End pin()'s holds; a reclaimed segment whose last reader this was is deleted."""
        gone = []
        with self._lock:
            for seg in held:
                seg.readers -= 1
                if seg.doomed and seg.readers == 0 and self.doomed.pop(seg.seg_id, None):
                    self._going[seg.seg_id] = seg
                    gone.append(seg)
        for seg in gone:
            self._delete(seg)

    def remove(self, seg_id: int) -> int:
        """Delete a segment file, or once its pinned readers are done; or keep it as a spare
        for the next segment (up to SPARES, format 3 files of a writable log). Returns the
        bytes it held.

        Why spares: a new segment's appends extend its file, and on the dev VM's ext4 each
        fdatasync that follows an extending write commits the journal (3.0-3.4 ms for 17 x 64
        KiB, against 0.06-0.14 ms for the same writes over written blocks; fio overwrites the
        file it laid out). A spare's blocks are written, so appends over them sync cheaply.
        Its old bytes stay past the new size; a new nonce keeps them from passing for batch
        headers (tiers.batchlog)."""
        with self._lock:
            seg = self.segments.pop(seg_id, None)
            if seg is None:
                return 0
            if seg.readers:
                seg.doomed = True
                self.doomed[seg_id] = seg
                return seg.size
            keep = (not self.readonly and seg.batched and len(self.spares) < SPARES
                    and seg.file_bytes >= self.segment_bytes // 2)
            if keep:
                spare = self.dir / f"spare-{seg_id:08d}.kvt"
                try:
                    os.rename(seg.path, spare)
                except OSError:
                    keep = False
                else:
                    seg.path, seg.size = spare, 0
                    self.spares.append(seg)
                    self._removals += 1           # seg-N is gone once the directory syncs
            if not keep:
                self._going[seg_id] = seg
        if not keep:
            self._delete(seg)
        return seg.file_bytes

    def drop_spares(self) -> int:
        """Delete the spare files (their room is wanted now). Returns their bytes."""
        with self._lock:
            gone, self.spares = self.spares, []
        for seg in gone:
            self._delete(seg)
        return sum(seg.file_bytes for seg in gone)

    def _delete(self, seg: Segment) -> None:
        self.backend.close(seg.fd)
        try:
            seg.path.unlink()
        except FileNotFoundError:
            pass
        with self._lock:
            if self._going.get(seg.seg_id) is seg:       # not a spare's
                del self._going[seg.seg_id]
            self._removals += 1

    def marks(self) -> dict[int, int]:
        """What a checkpoint may record as complete, per segment id: the size of every segment
        and of every reclaimed one still on disk for its readers (doomed), after the removals
        so far are durable (the directory synced). A file that a restart finds without a mark
        is replayed from its start: a reclaimed one would bring back every record it ever
        held, deleted and evicted keys with their oldest bytes. So a mark goes only once its
        file cannot come back: not while doomed (a crash before its reader ends leaves it),
        nor before its unlink or rename reached the disk (on file systems where another
        file's fsync does not carry it). Raises StorageError when the directory's sync fails
        (the checkpoint then fails and its operations wait)."""
        with self._lock:
            out = {sid: seg.size for sid, seg in self.segments.items()}
            out.update((sid, seg.size) for sid, seg in self.doomed.items())
            # Taken out, not yet unlinked (a reader's unpin, a remove, on another thread than
            # this checkpoint's): without its mark a crash before the unlink would leave the
            # file for the restart to replay from its start.
            out.update((sid, seg.size) for sid, seg in self._going.items())
            removals = self._removals
        if removals != self._removals_synced:
            try:
                _sync_dir(self.dir)
            except OSError as exc:
                raise StorageError(f"cannot sync NVMe directory {self.dir}: "
                                   f"{exc.strerror}") from None
            self._removals_synced = removals
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._aio is not None:
            release_shared(self._aio)
        if self._aio_reads is not None and self._aio_reads is not self._aio:
            release_shared(self._aio_reads)
        with self._lock:
            for seg in [*self.segments.values(), *self.doomed.values(), *self.spares]:
                self.backend.close(seg.fd)
            for seg in [*self.doomed.values(), *self.spares]:
                seg.path.unlink(missing_ok=True)
            self.segments.clear()
            self.doomed.clear()
            self.spares.clear()
