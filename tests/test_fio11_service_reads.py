"""The service's NVMe reads (api/steps.py's ReadThreads on _reads.c's Reader threads) hash with
tiers.reads.XXH3_READ, libxxhash's dispatching XXH3 (issue 17, fio11), and a damaged record is
still refused on that path: never served, the other keys of the get served with their bytes."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvtier.tiers import reads
from tests.conftest import key, keys
from tests.test_reads import _engine

pytestmark = pytest.mark.skipif(not reads.available(), reason="kvtier.tiers._reads not built "
                                "or no libxxhash: the Python read runs")


def _drive_get(eng, names):
    from kvtier.api.steps import StepRunner

    loop = asyncio.new_event_loop()
    pool = ThreadPoolExecutor(2)
    runner = StepRunner(eng.lock, lambda fn, *a: loop.run_in_executor(pool, fn, *a),
                        lambda fn, *a: loop.run_in_executor(pool, fn, *a))

    async def get():
        return await runner.drive(eng.get_steps("m", names, 0))
    try:
        return runner, loop.run_until_complete(get())
    finally:
        runner.close()
        pool.shutdown()
        loop.close()


def _segment_file(tmp_path: Path, seg_id: int) -> Path:
    (path,) = (tmp_path / "nvme").glob(f"ns-*/seg-{seg_id:08d}.kvt")
    return path


def test_the_reader_threads_hash_with_the_dispatching_xxh3(tmp_path: Path, monkeypatch):
    # Which function the C threads hash with is not visible from Python: a spy on the
    # Reader's constructor (the real Reader is built and reads) notes it.
    made: list[int] = []
    real = reads.native.Reader

    def spy(threads, depth, fn):
        made.append(fn)
        return real(threads, depth, fn)

    import types
    monkeypatch.setattr(reads, "native", types.SimpleNamespace(Reader=spy,
                                                               Batch=reads.native.Batch))
    eng, data = _engine(tmp_path)
    try:
        runner, res = _drive_get(eng, keys(range(8)))
        assert runner.c_reads == 1 and res.found.all()
        assert made == [reads.XXH3_READ]
        eng.release(res.lease_id)
    finally:
        eng.close(flush=False)


def test_a_damaged_record_is_refused_through_the_service_read(tmp_path: Path):
    eng, data = _engine(tmp_path)
    try:
        nvme = eng.entry("m", key(3))["copies"]["nvme"]
        fd = os.open(_segment_file(tmp_path, nvme["slot"]), os.O_WRONLY)
        try:
            os.pwrite(fd, b"damaged!", nvme["offset"] + 1000)    # inside the block's bytes
        finally:
            os.close(fd)
        failures = eng.counters.checksum_failures
        runner, res = _drive_get(eng, keys(range(8)))
        assert runner.c_reads == 1
        assert res.found.tolist() == [i != 3 for i in range(8)]
        pool = eng.namespace("m").slots[1].pool
        assert (pool.array[res.slots[res.found]] == data[res.found]).all()
        assert eng.counters.checksum_failures == failures + 1
        eng.release(res.lease_id)
    finally:
        eng.close(flush=False)


def test_many_batches_ending_together_are_all_handed_back_once(tmp_path: Path):
    # Four threads finishing one-record batches as fast as they can, the eventfd written
    # outside the mutex and only by the batch that finds the done list empty: a lost wake
    # would leave batches never reaped (the poll times out), a double hand-back repeats one.
    import select

    import numpy as np

    from tests.test_reads import _log_with, _pool

    log, data, segs, offs, sums = _log_with(tmp_path, 16)
    pool = _pool(16)
    held = log.pin(segs)
    r = reads.native.Reader(4, 8, reads.XXH3_READ)
    try:
        batches = [reads.record_batch(log, pool, np.array([i]), segs[i:i + 1], offs[i:i + 1],
                                      sums[i:i + 1], held) for i in range(16)]
        poll = select.poll()
        poll.register(r.fd, select.POLLIN)
        for rnd in range(25):
            for i, b in enumerate(batches):
                r.submit(b, (rnd, i))
            got: list = []
            while len(got) < len(batches):
                assert poll.poll(10_000), f"round {rnd}: {len(got)} of 16 handed back, no wake"
                got += r.reap()
            assert sorted(got) == [((rnd, i), 0) for i in range(16)]
            assert all(reads.verdicts(log, b).all() for b in batches)
        assert (pool == data).all()
    finally:
        r.close()
        log.unpin(held)
        log.close()


@pytest.mark.parametrize("n, twice", [(2, (0, 1)), (16, (3, 15)), (300, (7, 299)),
                                      (300, None)])
def test_a_batch_naming_a_row_twice_is_refused(tmp_path: Path, n: int, twice):
    # rev11's finding: each record is verified as its read lands, so two records read into
    # one row would both pass while the row holds one of them. Refused at once (the
    # caller's bug); distinct rows, however many (300: past the set's stack buffer), are not.
    import mmap

    import numpy as np

    from tests.test_reads import _log_with

    log, data, segs, offs, sums = _log_with(tmp_path, 4)
    pick = np.arange(n) % 4
    rows = np.arange(n)
    if twice is not None:
        rows[twice[1]] = rows[twice[0]]
    pool = np.frombuffer(mmap.mmap(-1, n * 65536), dtype=np.uint8).reshape(n, 65536)
    held = log.pin(segs)
    try:
        def batch():
            return reads.record_batch(log, pool, rows, segs[pick], offs[pick], sums[pick], held)
        if twice is not None:
            with pytest.raises(ValueError, match="row named twice"):
                batch()
        else:
            b = batch()
            log._aio_reads.run_native(lambda ctx, depth: b.run(ctx, depth, reads.XXH3_READ))
            assert reads.verdicts(log, b).all() and (pool == data[pick]).all()
    finally:
        log.unpin(held)
        log.close()
