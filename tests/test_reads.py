"""kvtier.tiers.reads (and _reads.c): an NVMe get's read in one C call and on C threads that
signal an eventfd: the same records and verdicts as read_rows + the verify, a torn record
refused by its checksum, and a read that fails mid-way installs nothing."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import select
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kvtier.checksums import block_checksums
from kvtier.tiers import reads
from kvtier.tiers.nvme import SegmentLog

pytestmark = pytest.mark.skipif(not reads.available(), reason="kvtier.tiers._reads not built "
                                "or no libxxhash: the Python read runs")

BB = 65536


def _log_with(tmp_path: Path, n: int) -> tuple[SegmentLog, np.ndarray, np.ndarray, np.ndarray,
                                               np.ndarray]:
    log = SegmentLog(tmp_path, 1, BB, 1 << 20)
    if log._aio_reads is None:
        pytest.skip("no native AIO on this file system")
    data = np.random.default_rng(1).integers(0, 256, (n, BB), dtype=np.uint8)
    segs, offs = log.append(data)
    return log, data, np.asarray(segs), np.asarray(offs), block_checksums(data)


def _pool(rows: int) -> np.ndarray:
    mm = mmap.mmap(-1, rows * BB)                   # page-aligned, as a host pool's
    return np.frombuffer(mm, dtype=np.uint8).reshape(rows, BB)


def _held(log: SegmentLog, segs: np.ndarray) -> list:
    return log.pin(segs)


def test_a_batch_lands_its_records_in_their_rows_and_verifies_them(tmp_path: Path):
    log, data, segs, offs, sums = _log_with(tmp_path, 20)
    pool = _pool(32)
    rows = np.random.default_rng(0).permutation(32)[:20]
    held = _held(log, segs)
    batch = reads.record_batch(log, pool, rows, segs, offs, sums, held)
    assert batch is not None and batch.requests == 20
    before = log.bytes_read
    reads.run_batch(log, batch)
    assert reads.verdicts(log, batch).all()
    assert log.bytes_read - before == 20 * BB
    assert all((pool[r] == d).all() for r, d in zip(rows.tolist(), data))
    log.unpin(held)
    log.close()


def test_a_torn_record_and_records_not_there_are_refused(tmp_path: Path):
    # Record 0 torn on disk (its bytes changed after its checksum was taken), record 1 of a
    # segment the batch does not hold, record 2 past what was written, record 3 off a record
    # boundary; the rest read and verified.
    log, data, segs, offs, sums = _log_with(tmp_path, 8)
    seg = log.segments[int(segs[0])]
    fd = os.open(seg.path, os.O_WRONLY)
    os.pwrite(fd, b"torn" * 1024, int(offs[0]) * 4096)
    os.close(fd)
    segs, offs = segs.copy(), offs.copy()
    segs[1] = 999
    offs[2] = offs.max() + 64
    offs[3] += 1
    pool = _pool(8)
    held = _held(log, segs)
    batch = reads.record_batch(log, pool, np.arange(8), segs, offs, sums, held)
    assert batch.requests == 5                     # 1, 2 and 3 never go to the disk
    reads.run_batch(log, batch)
    assert reads.verdicts(log, batch).tolist() == [False, False, False, False] + [True] * 4
    with pytest.raises(IndexError):
        reads.record_batch(log, pool, np.array([8]), segs[:1], offs[:1], sums[:1], held)
    log.unpin(held)
    log.close()


def test_a_batch_read_twice_is_refused_while_queued_and_its_verdicts_before_the_read(tmp_path):
    log, data, segs, offs, sums = _log_with(tmp_path, 4)
    held = _held(log, segs)
    batch = reads.record_batch(log, _pool(4), np.arange(4), segs, offs, sums, held)
    with pytest.raises(RuntimeError, match="not been read"):
        batch.ok()
    log.unpin(held)
    log.close()


def test_reader_threads_signal_their_eventfd_and_hand_back_each_batch(tmp_path: Path):
    log, data, segs, offs, sums = _log_with(tmp_path, 16)
    pool = _pool(16)
    held = _held(log, segs)
    r = reads.native.Reader(2, 32, reads.checksums._fn)
    batches = [reads.record_batch(log, pool, np.arange(i, 16, 4), segs[i::4], offs[i::4],
                                  sums[i::4], held) for i in range(4)]
    for i, b in enumerate(batches):
        r.submit(b, f"t{i}")
    with pytest.raises(ValueError, match="queued"):
        r.submit(batches[0], "again")              # one read at a time per batch
    got: list = []
    poll = select.poll()
    poll.register(r.fd, select.POLLIN)
    while len(got) < 4:
        assert poll.poll(10_000), "no completion signalled"
        got += r.reap()
    assert sorted(got) == [(f"t{i}", 0) for i in range(4)]
    assert all(reads.verdicts(log, b).all() for b in batches)
    assert (pool == data).all()
    r.submit(batches[0], "queued at close")        # close finishes what was queued
    r.close()
    assert r.reap() == []
    log.unpin(held)
    log.close()


# ---------------------------------------------------------------------- the service's steps

def _engine(tmp_path: Path):
    """An engine whose namespace m holds 8 blocks, all on NVMe only."""
    from kvtier.coherence.engine import Engine
    from kvtier.config import make_settings
    from kvtier.types import Tier
    from tests.conftest import blocks, keys

    eng = Engine(make_settings({"data_dir": str(tmp_path), "host_capacity": "4MiB",
                                "nvme_capacity": "32MiB"}))
    eng.create_namespace("m", BB)
    data = blocks(8, BB)
    eng.put("m", keys(range(8)), data)
    eng.flush()
    eng.evict(Tier.HOST, 8)
    return eng, data


def _drive(eng, runner_kw: dict | None = None, scenario=None):
    from kvtier.api.steps import StepRunner

    loop = asyncio.new_event_loop()
    pool = ThreadPoolExecutor(2)
    runner = StepRunner(eng.lock, lambda fn, *a: loop.run_in_executor(pool, fn, *a),
                        lambda fn, *a: loop.run_in_executor(pool, fn, *a), **(runner_kw or {}))
    try:
        return runner, loop.run_until_complete(scenario(runner))
    finally:
        runner.close()
        pool.shutdown()
        loop.close()


def test_the_step_runner_reads_on_its_c_threads_what_drive_reads_in_one_call(tmp_path: Path):
    from tests.conftest import keys

    eng, data = _engine(tmp_path)
    try:
        async def get(runner):
            return await runner.drive(eng.get_steps("m", keys(range(8)), 0))

        runner, res = _drive(eng, scenario=get)
        assert runner.c_reads == 1
        assert res.found.all()
        pool = eng.namespace("m").slots[1].pool
        assert (pool.array[res.slots] == data).all()
        eng.release(res.lease_id)
    finally:
        eng.close(flush=False)


class _FakeReader:
    """reads.native.Reader's shape: each batch really read on submit (its bytes land in the
    slots), its end signalled DELAY s later with ERR (0, or errno.EIO: a reap that failed
    mid-way), noted in EVENTS."""

    ERR, DELAY = 0, 0.05
    EVENTS: list = []

    def __init__(self, threads: int, depth: int, fn: int) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK)
        self._done: list = []
        self.fn, self.depth = fn, depth

    def submit(self, batch, token) -> None:
        from kvtier.tiers.aio import Aio
        aio = Aio(self.depth)
        batch.run(aio._ctx.value, self.depth, self.fn)
        aio.close()

        def done() -> None:
            self.EVENTS.append("read done")
            self._done.append((token, self.ERR))
            os.eventfd_write(self.fd, 1)

        threading.Timer(self.DELAY, done).start()

    def reap(self) -> list:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass
        out, self._done = self._done, []
        return out

    def close(self) -> None:
        os.close(self.fd)


def _fake(monkeypatch, err: int, delay: float) -> list:
    import types

    events: list = []
    cls = type("Fake", (_FakeReader,), {"ERR": err, "DELAY": delay, "EVENTS": events})
    monkeypatch.setattr(reads, "native", types.SimpleNamespace(Reader=cls,
                                                               Batch=reads.native.Batch))
    return events


def _nothing_installed_nor_held(eng, data) -> None:
    from kvtier.types import Tier
    from tests.conftest import keys

    ns = eng.namespace("m")
    rows = ns.table.lookup(keys(range(8)))
    assert (ns.table.cols["copy_ver"][rows, Tier.HOST] != ns.table.cols["version"][rows]).all()
    st = ns.slots[Tier.HOST]
    assert not eng.leases and int(st.leases.sum()) == 0
    assert st.pool.free_count == st.pool.n_slots
    found, out = eng.read("m", keys(range(8)))
    assert found.all() and (out == data).all()


def test_a_c_read_that_fails_mid_way_installs_nothing_and_leaves_no_lease(tmp_path, monkeypatch):
    # The C threads report the read failed after its bytes landed: the get raises, nothing is
    # installed, its slots (and any lease of what was already here) go back.
    from tests.conftest import keys

    eng, data = _engine(tmp_path)
    _fake(monkeypatch, errno.EIO, 0.01)
    try:
        async def get(runner):
            with pytest.raises(OSError, match="NVMe read"):
                await runner.drive(eng.get_steps("m", keys(range(8)), 0))

        runner, _ = _drive(eng, scenario=get)
        assert runner.c_reads == 1
        monkeypatch.undo()
        _nothing_installed_nor_held(eng, data)
    finally:
        eng.close(flush=False)


def test_a_get_cancelled_during_its_c_read_waits_for_its_end_then_installs_nothing(
        tmp_path, monkeypatch):
    # Cancelled (its peer gone) while the read is in flight: the steps' install, which frees
    # the read's slots, runs only after the read has ended (a slot freed under a read still in
    # flight could be given to another block and then overwritten by it).
    from tests.conftest import keys

    eng, data = _engine(tmp_path)
    events = _fake(monkeypatch, 0, 0.2)
    finish = eng.gets._finish_get

    def noted(*a, **k):
        events.append("install")
        return finish(*a, **k)

    eng.gets._finish_get = noted
    try:
        async def cancelled(runner):
            task = asyncio.ensure_future(runner.drive(eng.get_steps("m", keys(range(8)), 0)))
            while runner.c_reads == 0:
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        runner, _ = _drive(eng, scenario=cancelled)
        assert events[0] == "read done" and set(events[1:]) == {"install"}   # (it recurses)
        del eng.gets._finish_get
        monkeypatch.undo()
        _nothing_installed_nor_held(eng, data)
    finally:
        eng.close(flush=False)


def test_a_destination_that_is_not_a_host_array_is_left_to_the_python_read(tmp_path: Path):
    # An HBM pool's array (cupy) has no host address: the C read must never be handed one.
    log, data, segs, offs, sums = _log_with(tmp_path, 2)

    class DeviceArray:                  # the shape of a cupy array, no .ctypes
        ndim, shape, strides = 2, (2, BB), (BB, 1)

    held = _held(log, segs)
    assert reads.record_batch(log, DeviceArray(), np.arange(2), segs, offs, sums, held) is None
    log.unpin(held)
    log.close()


def test_rows_off_4k_boundaries_are_left_to_the_python_read(tmp_path: Path):
    log, data, segs, offs, sums = _log_with(tmp_path, 2)
    held = _held(log, segs)
    mm = mmap.mmap(-1, 3 * BB + 4096)
    shifted = np.frombuffer(mm, dtype=np.uint8)[512:512 + 3 * BB].reshape(3, BB)
    assert reads.record_batch(log, shifted, np.arange(2), segs, offs, sums, held) is None
    with pytest.raises(ValueError, match="8-byte integers"):     # the caller's bug: raised
        reads.native.Batch(np.zeros((0, 4), np.int64), np.zeros(2, np.int64),
                           np.zeros(1, np.int64), np.zeros(2, np.int64), _pool(2), BB,
                           np.zeros(2, np.uint64))
    log.unpin(held)
    log.close()


def test_a_window_wider_than_the_batch_is_clamped_not_allocated(tmp_path: Path):
    # Batch.run's window sized its event array (window x 32 bytes): a huge one failed the
    # read with ENOMEM (and destroyed the log's context), or wrapped size_t to a tiny array
    # the kernel then wrote events past. At most the batch's requests can be in flight.
    log, data, segs, offs, sums = _log_with(tmp_path, 4)
    pool = _pool(4)
    held = _held(log, segs)
    batch = reads.record_batch(log, pool, np.arange(4), segs, offs, sums, held)
    log._aio_reads.run_native(lambda ctx, depth: batch.run(ctx, 1 << 58, reads.checksums._fn))
    assert reads.verdicts(log, batch).all()
    assert all((pool[r] == d).all() for r, d in enumerate(data))
    log.unpin(held)
    log.close()


def test_an_offset_whose_byte_offset_overflows_is_a_bad_record_not_a_wrapped_read(
        tmp_path: Path):
    # offs are in 4 KiB units: 2**52 + k units is 2**64 + 4096 k bytes, which int64 arithmetic
    # wrapped onto record k's offset, so the batch read (and verified) a record its row does
    # not name. It lies past any segment: refused, as an offset past what was written.
    log, data, segs, offs, sums = _log_with(tmp_path, 4)
    bad = offs.astype(np.int64)                 # (the log's own offsets are uint32)
    bad[1] += 1 << 52
    pool = _pool(4)                                 # (a Batch does not hold its destination)
    held = _held(log, segs)
    batch = reads.record_batch(log, pool, np.arange(4), segs, bad, sums, held)
    assert batch.requests == 3
    reads.run_batch(log, batch)
    assert reads.verdicts(log, batch).tolist() == [True, False, True, True]
    log.unpin(held)
    log.close()


def test_a_get_whose_reader_threads_close_before_its_read_is_reaped_ends_not_hangs(
        tmp_path: Path):
    # Reader.close runs the queued reads to their end but drops what was never reaped, so a
    # get awaiting one (a runner closed or moved to another loop with a read in flight) waited
    # for a future nothing would ever complete, cancellations included (StepRunner.drive waits for its steps' end).
    from tests.conftest import keys

    eng, data = _engine(tmp_path)
    try:
        async def closed_under_it(runner):
            task = asyncio.ensure_future(runner.drive(eng.get_steps("m", keys(range(8)), 0)))
            while runner.c_reads == 0:
                await asyncio.sleep(0)
            runner.close()                          # before the loop could reap the read
            for _ in range(1000):                   # (wait_for could not end it: see above)
                if task.done():
                    break
                await asyncio.sleep(0.01)
            assert task.done(), "the get still waits for a read the closed reader dropped"
            with pytest.raises(OSError, match="closed"):
                await task

        _drive(eng, scenario=closed_under_it)
        _nothing_installed_nor_held(eng, data)
    finally:
        eng.close(flush=False)


def test_a_batch_run_again_that_fails_has_no_verdicts_not_the_last_runs(tmp_path: Path):
    # rev5's review: a re-run that failed left `ran` set, and ok() answered with the earlier
    # read's verdicts. Once on the calling thread, once on a Reader's thread.
    log, data, segs, offs, sums = _log_with(tmp_path, 4)
    held = _held(log, segs)
    pool = _pool(4)                                # (the batch holds its address only)
    batch = reads.record_batch(log, pool, np.arange(4), segs, offs, sums, held)
    reads.run_batch(log, batch)
    assert reads.verdicts(log, batch).all()
    reads.native._fail_next_read(errno.EIO)
    with pytest.raises(OSError):
        reads.run_batch(log, batch)
    with pytest.raises(RuntimeError, match="not been read"):
        batch.ok()
    reads.run_batch(log, batch)                    # read again: its own verdicts
    assert reads.verdicts(log, batch).all()
    r = reads.native.Reader(1, 8, reads.checksums._fn)
    try:
        reads.native._fail_next_read(errno.EIO)
        r.submit(batch, "t")
        poll = select.poll()
        poll.register(r.fd, select.POLLIN)
        got: list = []
        while not got:
            assert poll.poll(10_000), "no completion signalled"
            got += r.reap()
        assert got == [("t", errno.EIO)]
        with pytest.raises(RuntimeError, match="not been read"):
            batch.ok()
        assert (pool == data).all()                # (its bytes landed before the failure)
    finally:
        r.close()
        reads.native._fail_next_read(0)
    log.unpin(held)
    log.close()


def test_nvme_gets_after_a_failed_reap_read_on_a_fresh_context(tmp_path: Path):
    # rev5's review: the only AIO context failing a reap closed the log's set, and every later
    # NVMe get failed with EBADF until a restart. Now the failed get raises and installs
    # nothing, and the next one reads on a fresh context.
    from tests.conftest import keys

    eng, data = _engine(tmp_path)
    try:
        aset = eng.namespace("m").log._aio_reads
        assert aset._made == 1                     # the case that closed the set
        reads.native._fail_next_read(errno.EIO)
        with pytest.raises(OSError):
            eng.get("m", keys(range(8)))
        assert aset.alive and aset._made == 0
        _nothing_installed_nor_held(eng, data)     # (its eng.read reads on a fresh context)
        assert aset._made == 1
    finally:
        reads.native._fail_next_read(0)
        eng.close(flush=False)
