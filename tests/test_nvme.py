"""The NVMe segment log: append, read back, roll-over, O_DIRECT alignment, damage, bad dirs."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import DataDirError
from kvtier.tiers.nvme import HEADER_BYTES, PosixBackend, SegmentLog


def _blocks(n: int, size: int) -> list[memoryview]:
    rng = np.random.default_rng(n)
    return [memoryview(rng.integers(0, 256, size, dtype=np.uint8).tobytes()) for _ in range(n)]


@pytest.mark.parametrize("block_bytes", [4096, 65536, 1000])
def test_append_then_read_back(tmp_path: Path, block_bytes: int):
    log = SegmentLog(tmp_path, 1, block_bytes, 1 << 20)
    data = _blocks(40, block_bytes)
    segs, offs = log.append(data)
    outs = [memoryview(bytearray(block_bytes)) for _ in data]
    ok = log.read(segs, offs, outs)
    assert ok.all()
    assert [bytes(o) for o in outs] == [bytes(d) for d in data]
    assert log.live_bytes() == 0      # liveness is the caller's bookkeeping
    log.close()


def test_segments_roll_over_and_survive_reopen(tmp_path: Path):
    log = SegmentLog(tmp_path, 1, 65536, 1 << 20)
    data = _blocks(40, 65536)
    segs, offs = log.append(data)
    assert len(set(segs.tolist())) == 3      # 15 records of 64 KiB per 1 MiB segment
    log.close()
    log = SegmentLog(tmp_path, 1, 65536, 1 << 20)
    outs = [memoryview(bytearray(65536)) for _ in data]
    assert log.read(segs, offs, outs).all()
    assert bytes(outs[-1]) == bytes(data[-1])
    log.close()


def test_truncated_segment_reads_fail_instead_of_returning_garbage(tmp_path: Path):
    log = SegmentLog(tmp_path, 1, 4096, 1 << 20)
    segs, offs = log.append(_blocks(4, 4096))
    log.close()
    path = next(tmp_path.glob("seg-*.kvt"))
    os.truncate(path, int(offs[2]) * 4096 + 100)      # inside the third record
    log = SegmentLog(tmp_path, 1, 4096, 1 << 20)
    ok = log.read(segs, offs, [memoryview(bytearray(4096)) for _ in range(4)])
    assert ok.tolist() == [True, True, False, False]
    log.close()


def test_foreign_file_in_the_segment_directory_is_a_clear_error(tmp_path: Path):
    (tmp_path / "seg-00000001.kvt").write_bytes(b"not a segment" * 1000)
    with pytest.raises(DataDirError, match="not a kvtier segment"):
        SegmentLog(tmp_path, 1, 4096, 1 << 20)


def test_unwritable_directory_is_a_clear_error(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DataDirError, match="cannot create NVMe directory"):
        SegmentLog(blocker / "nvme", 1, 4096, 1 << 20)


def test_compaction_candidates_follow_live_bytes(tmp_path: Path):
    log = SegmentLog(tmp_path, 1, 65536, 1 << 20)
    segs, _ = log.append(_blocks(30, 65536))
    log.add_live(segs)
    first = int(segs[0])
    log.add_live(segs[segs == first][:12], -1)
    assert log.compaction_candidates(0.5) == [first]
    assert log.remove(first) > 0 and first not in log.segments
    log.close()


@pytest.mark.parametrize("block_bytes, start", [(65536, 65536), (1 << 20, 1 << 20),
                                                 (4 << 20, 1 << 20), (20480, 20480)])
def test_records_start_on_their_own_alignment(tmp_path: Path, block_bytes: int, start: int):
    log = SegmentLog(tmp_path, 1, block_bytes, 32 << 20)
    segs, offs = log.append(_blocks(3, block_bytes))
    assert log.data_start == start
    # The batch header takes the first record slot; the records follow it, each aligned.
    rec = -(-block_bytes // 4096) * 4096
    assert (offs.astype(np.int64) * 4096).tolist() == [start + (i + 1) * rec for i in range(3)]
    log.close()


def test_format_1_segments_are_still_read(tmp_path: Path):
    """A segment written before aligned records: the v1 header, records right after 4 KiB."""
    from kvtier.tiers.nvme import _HEADER_V1, MAGIC_V1
    data = _blocks(3, 65536)
    raw = _HEADER_V1.pack(MAGIC_V1, 65536, 65536, 1, 1).ljust(HEADER_BYTES, b"\0")
    (tmp_path / "seg-00000001.kvt").write_bytes(raw + b"".join(bytes(d) for d in data))
    log = SegmentLog(tmp_path, 1, 65536, 1 << 20)
    offs = np.array([1, 17, 33], dtype=np.uint32)              # 4 KiB + i * 64 KiB, in 4 KiB
    segs = np.ones(3, dtype=np.int32)
    outs = [memoryview(bytearray(65536)) for _ in data]
    assert log.read(segs, offs, outs).all()
    assert [bytes(o) for o in outs] == [bytes(d) for d in data]
    assert log.in_bounds(segs, offs).tolist() == [True, True, True]
    # An old segment takes no appends (it has no batch headers to replay): they go to a new
    # format 3 segment, behind its header slot.
    s2, o2 = log.append(data[:1])
    assert s2.tolist() == [2] and int(o2[0]) * 4096 == 2 * 65536
    assert log.sealed()[0].seg_id == 1
    log.close()


def test_offsets_off_a_record_boundary_are_refused(tmp_path: Path):
    log = SegmentLog(tmp_path, 1, 65536, 1 << 20)
    segs, offs = log.append(_blocks(3, 65536))
    bad = offs + 1                                             # 4 KiB into a record
    out = [memoryview(bytearray(65536)) for _ in range(3)]
    assert log.read(segs, bad, out).tolist() == [False] * 3
    assert log.in_bounds(segs, bad).tolist() == [False] * 3
    assert log.in_bounds(segs + 7, offs).tolist() == [False] * 3      # no such segment
    assert log.in_bounds(segs, offs).tolist() == [True] * 3
    log.close()


def test_a_header_with_a_bad_data_start_is_not_a_segment(tmp_path: Path):
    from kvtier.tiers.nvme import _HEADER, MAGIC
    raw = _HEADER.pack(MAGIC, 65536, 65536, 1, 1, 100).ljust(HEADER_BYTES, b"\0")
    (tmp_path / "seg-00000001.kvt").write_bytes(raw)
    with pytest.raises(DataDirError, match="not a kvtier segment"):
        SegmentLog(tmp_path, 1, 65536, 1 << 20)


def test_reads_and_pins_do_not_wait_for_an_append_in_its_fdatasync(tmp_path: Path):
    """An append's writes and sync run outside the segment lock: a reader pins, reads and
    unpins while another thread's append is held inside its fdatasync (the test's gate; a
    slow disk's sync, made to last). Before, pin() waited for the whole append, and the engine
    holds its own lock around pin()."""
    import threading
    from kvtier.tiers.nvme import PosixBackend

    class SlowSync(PosixBackend):
        def __init__(self) -> None:
            self.syncing, self.gate = threading.Event(), threading.Event()

        def sync(self, fd: int) -> None:
            if not self.gate.is_set():
                self.syncing.set()
                self.gate.wait(10)
            super().sync(fd)

    disk = SlowSync()
    disk.gate.set()
    log = SegmentLog(tmp_path, 1, 4096, 1 << 20, backend=disk)
    first = np.full((2, 4096), 7, dtype=np.uint8)
    segs, offs = log.append([memoryview(b) for b in first])
    disk.gate.clear()
    writer = threading.Thread(target=log.append,
                              args=([memoryview(np.ones(4096, dtype=np.uint8))],))
    writer.start()
    assert disk.syncing.wait(10)                  # the second append is inside its sync
    held = log.pin(segs)
    out = np.zeros((2, 4096), dtype=np.uint8)
    assert log.read(segs, offs, [memoryview(o) for o in out]).all()
    log.unpin(held)
    assert writer.is_alive()                      # all of that while the sync was held
    assert (out == first).all()
    disk.gate.set()
    writer.join(10)
    log.close()


class _BufferedPosix(PosixBackend):
    """Files opened without O_DIRECT, as KvikioBackend opens them (kvikio needs CUDA)."""

    posix_reads = True

    def open(self, path, create, direct):
        return super().open(path, create, direct=False)


@pytest.mark.parametrize("backend", [None, _BufferedPosix], ids=["direct", "buffered"])
@pytest.mark.parametrize("block_bytes", [4096, 65536])
def test_read_rows_lands_records_in_their_rows_and_refuses_what_is_not_there(
        tmp_path: Path, block_bytes: int, backend):
    # The AIO path straight into a pool's rows (host slots), beside read(): the same bytes,
    # and a record past its segment's end, or of a segment that is gone, is refused.
    import mmap
    log = SegmentLog(tmp_path, 1, block_bytes, 1 << 20,
                     backend=backend() if backend else None)
    data = _blocks(30, block_bytes)
    segs, offs = log.append(data)
    mm = mmap.mmap(-1, 40 * block_bytes)                   # page-aligned, as a host pool's
    pool = np.frombuffer(mm, dtype=np.uint8).reshape(40, block_bytes)
    rows = np.random.default_rng(0).permutation(40)[:30]
    ok = log.read_rows(segs, offs, pool, rows)
    if ok is None:
        pytest.skip("no native AIO here: read_rows falls back to read()")
    assert ok.all()
    assert all(bytes(pool[r]) == bytes(d) for r, d in zip(rows.tolist(), data))
    bad_segs, bad_offs = segs[:3].copy(), offs[:3].copy()
    bad_segs[0] = 999                                      # no such segment
    bad_offs[1] = offs.max() + 64                          # past the end of the log
    assert log.read_rows(bad_segs, bad_offs, pool, rows[:3]).tolist() == [False, False, True]
    with pytest.raises(IndexError):
        log.read_rows(segs[:1], offs[:1], pool, np.array([40]))
    log.close()


def test_read_rows_leaves_unaligned_or_padded_reads_to_read(tmp_path: Path):
    log = SegmentLog(tmp_path, 1, 1000, 1 << 20)           # records padded to 4 KiB
    segs, offs = log.append(_blocks(2, 1000))
    assert log.read_rows(segs, offs, np.zeros((2, 1000), dtype=np.uint8),
                         np.arange(2)) is None
    log.close()


def test_a_process_killed_while_a_spare_becomes_a_segment_restarts(tmp_path: Path,
                                                                  monkeypatch):
    # A reclaimed file kept as a spare is renamed to the next segment's name. The rename
    # came before the new header: killed in between, seg-N held the spare's old header
    # (another segment's id) and the restart refused the data directory (bench/fio_crash.py).
    import kvtier.tiers.nvme as nvme
    from kvtier.checksums import block_checksums
    from kvtier.coherence.journal import entries_of
    from kvtier.pagetable.store import record_dtype

    bb = 4096

    def append(lg: SegmentLog, ids: list[int]):
        data = np.stack([np.full(bb, i % 251, np.uint8) for i in ids])
        r = np.zeros(len(ids), dtype=record_dtype(16))
        r["size"], r["version"], r["checksum"] = bb, 1, block_checksums(data)
        k = np.frombuffer(b"".join((i + 1).to_bytes(16, "big") for i in ids), dtype="V16")
        return lg.append([memoryview(d) for d in data], entries_of(k, r))

    def log() -> SegmentLog:
        return SegmentLog(tmp_path, 1, bb, 64 << 10, index_bytes=16 + record_dtype(16).itemsize)

    lg = log()
    for gen in range(3):                          # seg 1: three batches of 4 (15 slots)
        append(lg, list(range(gen * 4, gen * 4 + 4)))
    segs, offs = append(lg, [90, 91])             # seg 2
    assert set(segs.tolist()) == {2}
    lg.remove(1)
    assert [p.name for p in tmp_path.glob("spare-*.kvt")] == ["spare-00000001.kvt"]

    real = os.rename

    def killed(src, dst, *a, **kw):               # the process dies right after the rename
        real(src, dst, *a, **kw)
        if "seg-" in str(dst):
            raise KeyboardInterrupt("killed")

    assert nvme.os is os
    monkeypatch.setattr(os, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        while lg.active_id == 2:                  # fill seg 2 so that seg 3 is opened
            append(lg, [95])
    monkeypatch.undo()
    assert (tmp_path / "seg-00000003.kvt").exists()
    again = log()                                 # the restart opens the directory
    assert 3 in again.segments
    out = [memoryview(bytearray(bb)) for _ in range(2)]
    assert again.read(segs, offs, out).all() and bytes(out[1]) == bytes([91]) * bb
    again.close()


def test_a_short_header_after_a_long_one_is_zero_past_its_entries(tmp_path: Path):
    # write() keeps one header buffer per log (fio6): a chunk's header must not carry the
    # bytes of a longer header written before it, and both must scan back with their entries.
    from kvtier.tiers.batchlog import FIXED_BYTES, scan
    from kvtier.tiers.segfile import _aligned
    log = SegmentLog(tmp_path, 1, 65536, 4 << 20)
    long_e = np.full((8, 32), 0xAB, dtype=np.uint8)
    short_e = np.full((1, 32), 0xCD, dtype=np.uint8)
    segs1, offs1 = log.append(_blocks(8, 65536), long_e)
    segs2, offs2 = log.append(_blocks(1, 65536), short_e)
    seg = log.segments[int(segs2[0])]
    head_off = int(offs2[0]) * 4096 - 65536          # the header slot right before the record
    raw = os.pread(seg.fd, 65536, head_off) if not seg.direct else None
    if raw is None:
        buf = _aligned(65536)
        os.preadv(seg.fd, [buf], head_off)
        raw = bytes(buf)
    assert raw[FIXED_BYTES: FIXED_BYTES + 32] == bytes([0xCD]) * 32
    assert raw[FIXED_BYTES + 32:] == bytes(len(raw) - FIXED_BYTES - 32)
    buf = _aligned(65536)
    found = scan(seg.fd, 1, seg.seg_id, seg.nonce, seg.start, seg.size, 65536, memoryview(buf))
    assert found.problem is None
    assert [b.count for b in found.batches] == [8, 1]
    assert (found.batches[0].entries == 0xAB).all() and (found.batches[1].entries == 0xCD).all()
    log.close()


def test_a_spare_whose_rename_is_refused_stays_a_spare(tmp_path: Path, monkeypatch):
    # The rename of a spare to the next segment's name sat outside the block that puts the
    # spare back: refused, the spare was lost (its fd open and its file unused until a
    # restart), and the next segment was a new file.
    from kvtier.errors import StorageError
    bb = 4096
    lg, append, segs, offs = _spare_log(tmp_path)
    spare = lg.spares[0]
    real = os.rename

    def refused(src, dst, *a, **kw):
        if "spare-" in str(src):
            raise OSError(errno.EIO, "refused")
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", refused)
    with pytest.raises(StorageError):
        while lg.active_id == 2:                  # fill seg 2 so that a segment is opened
            append([95])
    monkeypatch.undo()
    assert lg.spares == [spare] and (tmp_path / "spare-00000001.kvt").exists()
    while lg.active_id in (None, 2):
        append([96])
    assert not lg.spares and not list(tmp_path.glob("spare-*.kvt"))
    assert lg.segments[lg.active_id].recycled
    out = [memoryview(bytearray(bb)) for _ in range(2)]
    assert lg.read(segs, offs, out).all() and bytes(out[1]) == bytes([91]) * bb
    lg.close()


def _spare_log(tmp_path: Path):
    """A log of 64 KiB segments whose seg 1 was reclaimed as a spare (seg 2 active), with
    its append(ids) and the (segs, offs) of keys 90 and 91 in seg 2."""
    from kvtier.checksums import block_checksums
    from kvtier.coherence.journal import entries_of
    from kvtier.pagetable.store import record_dtype

    bb = 4096
    lg = SegmentLog(tmp_path, 1, bb, 64 << 10, index_bytes=16 + record_dtype(16).itemsize)

    def append(ids: list[int]):
        data = np.stack([np.full(bb, i % 251, np.uint8) for i in ids])
        r = np.zeros(len(ids), dtype=record_dtype(16))
        r["size"], r["version"], r["checksum"] = bb, 1, block_checksums(data)
        k = np.frombuffer(b"".join((i + 1).to_bytes(16, "big") for i in ids), dtype="V16")
        return lg.append([memoryview(d) for d in data], entries_of(k, r))

    for gen in range(3):                          # seg 1: three batches of 4
        append(list(range(gen * 4, gen * 4 + 4)))
    segs, offs = append([90, 91])                 # seg 2
    lg.remove(1)
    return lg, append, segs, offs


def _files(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.glob("*.kvt"))


def test_a_failed_directory_sync_after_the_spares_rename_names_it_back(tmp_path: Path,
                                                                        monkeypatch):
    # Injected OS errors (a directory fsync that fails cannot be made for real here). The
    # sync after the rename failed and seg-3 stayed on disk, untracked, its fd open until a
    # restart; now the file is named back and stays the spare.
    import kvtier.tiers.nvme as nvme
    from kvtier.errors import StorageError
    lg, append, segs, offs = _spare_log(tmp_path)
    spare = lg.spares[0]
    calls = []
    real = nvme._sync_dir

    def fails_after_the_rename(path):
        calls.append(path)
        if (tmp_path / "seg-00000003.kvt").exists():
            raise OSError(errno.EIO, "injected")
        real(path)
    monkeypatch.setattr(nvme, "_sync_dir", fails_after_the_rename)
    with pytest.raises(StorageError):
        while lg.active_id == 2:
            append([95])
    monkeypatch.undo()
    assert _files(tmp_path) == ["seg-00000002.kvt", "spare-00000001.kvt"]
    assert lg.spares == [spare] and 3 not in lg.segments
    assert len(calls) == 2                        # before the header write, after the rename
    while lg.active_id in (None, 2):
        append([96])
    assert lg.segments[lg.active_id].recycled and not lg.spares
    lg.close()
    again = SegmentLog(tmp_path, 1, 4096, 64 << 10, index_bytes=lg.index_bytes)
    out = [memoryview(bytearray(4096)) for _ in range(2)]
    assert again.read(segs, offs, out).all() and bytes(out[1]) == bytes([91]) * 4096
    again.close()


def test_a_failed_header_write_of_a_new_segment_leaves_no_file(tmp_path: Path, monkeypatch):
    # Injected: the header write of a new file fails (ENOSPC). seg-3 stayed on disk,
    # untracked, its fd open until a restart; now it is closed and deleted.
    from kvtier.errors import StorageError
    lg, append, segs, offs = _spare_log(tmp_path)
    lg.drop_spares()                              # so that the next segment is a new file
    real = lg.backend.pwritev

    def full(fd, bufs, offset):
        if offset == 0:
            raise OSError(errno.ENOSPC, "injected")
        return real(fd, bufs, offset)
    monkeypatch.setattr(lg.backend, "pwritev", full)
    with pytest.raises(StorageError):
        while lg.active_id == 2:
            append([95])
    monkeypatch.undo()
    assert _files(tmp_path) == ["seg-00000002.kvt"] and 3 not in lg.segments
    while lg.active_id == 2:
        append([96])
    assert lg.active_id == 4
    lg.close()


def test_a_reclaimed_files_spare_name_is_durable_before_its_header_changes(tmp_path: Path,
                                                                           monkeypatch):
    # remove() renames seg-1 to spare-1 without a directory sync; the spare's next use
    # rewrote its header (seg-3's) and synced the file before any directory sync. A crash
    # then could bring back the name seg-1 over seg-3's header: a restart refused the
    # directory. The order is recorded (a crash's lost rename cannot be made for real).
    import kvtier.tiers.nvme as nvme
    lg, append, _, _ = _spare_log(tmp_path)
    spare_fd = lg.spares[0].fd
    order = []
    real_sync, real_write = nvme._sync_dir, lg.backend.pwritev

    def sync_dir(path):
        order.append("dir")
        real_sync(path)

    def pwritev(fd, bufs, offset):
        if fd == spare_fd and offset == 0:
            order.append("header")
        return real_write(fd, bufs, offset)
    monkeypatch.setattr(nvme, "_sync_dir", sync_dir)
    monkeypatch.setattr(lg.backend, "pwritev", pwritev)
    while lg.active_id == 2:
        append([95])
    assert order[:2] == ["dir", "header"]
    lg.close()


def test_a_segment_file_of_a_zero_header_and_no_record_is_deleted_at_start(tmp_path: Path):
    # A crash after a new file's header write, before any record was synced, may leave the
    # file's length without its bytes: the restart refused the directory (bad header).
    (tmp_path / "seg-00000007.kvt").write_bytes(bytes(HEADER_BYTES))
    log = SegmentLog(tmp_path, 1, 4096, 1 << 20)
    assert not log.segments and not (tmp_path / "seg-00000007.kvt").exists()
    log.close()
    (tmp_path / "seg-00000007.kvt").write_bytes(bytes(2 * HEADER_BYTES))   # more: refused
    with pytest.raises(DataDirError):
        SegmentLog(tmp_path, 1, 4096, 1 << 20)


def test_a_new_segment_files_name_is_synced_before_its_records(tmp_path: Path, monkeypatch):
    # A new file's directory entry was never synced: a record's fdatasync does not make it
    # durable (POSIX), so a crash could lose a flushed version's whole file. The order is
    # recorded (a lost directory entry cannot be made for real here).
    import kvtier.tiers.nvme as nvme
    order = []
    real_sync, real_write = nvme._sync_dir, nvme.SegmentLog._write_all

    def sync_dir(path):
        order.append("dir")
        real_sync(path)

    def write_all(self, fd, bufs, offset, path):
        order.append("header" if offset == 0 else "record")
        return real_write(self, fd, bufs, offset, path)
    monkeypatch.setattr(nvme, "_sync_dir", sync_dir)
    monkeypatch.setattr(nvme.SegmentLog, "_write_all", write_all)
    log = SegmentLog(tmp_path, 1, 4096, 1 << 20)
    log.append(_blocks(2, 4096))
    assert order[:2] == ["header", "dir"]
    log.close()
