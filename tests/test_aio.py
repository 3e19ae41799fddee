"""kvtier.tiers.aio against a real O_DIRECT file: batches longer than the context's depth keep a
sliding window in flight and every request lands where it was asked to. Every test runs twice:
through the C loop (_aio.c) where it was built, and through the Python fallback."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest

import kvtier.tiers.aio as aio_mod
from kvtier.tiers.aio import IOCB_CMD_PREADV, IOCB_CMD_PWRITEV, Aio

pytestmark = pytest.mark.skipif(not Aio.available(), reason="no native AIO on this platform")
REC = 4096


@pytest.fixture(autouse=True, params=["native", "python"])
def loop(request, monkeypatch):
    """Which submit/reap loop runs: the C helper or the Python fallback."""
    if request.param == "native":
        if aio_mod._native is None:
            pytest.skip("kvtier.tiers._aio was not built")
    else:
        monkeypatch.setattr(aio_mod, "_native", None)
    return request.param


def _direct_file(tmp_path: Path) -> int:
    path = tmp_path / "f"
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)    # a file system without O_DIRECT


def _records(n: int) -> list[memoryview]:
    """n page-aligned records of REC bytes in one mapping, record k holding byte k + 1."""
    src = mmap.mmap(-1, n * REC)
    recs = np.frombuffer(src, dtype=np.uint8).reshape(n, REC)
    recs[:] = np.arange(n, dtype=np.uint8)[:, None] + 1
    v = memoryview(src)
    return [v[k * REC:(k + 1) * REC] for k in range(n)]


@pytest.mark.parametrize("depth, window", [(4, 3), (8, 8), (256, None)])
def test_long_batches_write_and_read_back_every_record(tmp_path: Path, depth: int, window):
    fd = _direct_file(tmp_path)
    aio = Aio(depth=depth)
    try:
        n = 50
        src = mmap.mmap(-1, n * REC)
        data = np.frombuffer(src, dtype=np.uint8).reshape(n, REC)
        data[:] = np.random.default_rng(depth).integers(0, 256, data.shape, dtype=np.uint8)
        view = memoryview(src)
        # Records written in a shuffled order, each request its own record.
        order = np.random.default_rng(1).permutation(n).tolist()
        writes = [(fd, [view[i * REC:(i + 1) * REC]], i * REC) for i in order]
        assert (aio.run(IOCB_CMD_PWRITEV, writes, window) == REC).all()
        dst = mmap.mmap(-1, n * REC)
        dview = memoryview(dst)
        reads = [(fd, [dview[i * REC:(i + 1) * REC]], i * REC) for i in range(n)]
        assert (aio.run(IOCB_CMD_PREADV, reads, window) == REC).all()
        assert (np.frombuffer(dst, dtype=np.uint8).reshape(n, REC) == data).all()
        past = aio.run(IOCB_CMD_PREADV, [(fd, [dview[:REC]], n * REC)], window)
        assert past.tolist() == [0]                        # past the end: nothing, no error
    finally:
        aio.close()
        os.close(fd)


def test_vectored_requests_in_a_window(tmp_path: Path):
    fd = _direct_file(tmp_path)
    aio = Aio(depth=2)
    try:
        src = mmap.mmap(-1, 8 * REC)
        np.frombuffer(src, dtype=np.uint8)[:] = np.arange(8 * REC) % 251
        v = memoryview(src)
        reqs = [(fd, [v[2 * i * REC:(2 * i + 1) * REC], v[(2 * i + 1) * REC:(2 * i + 2) * REC]],
                 2 * i * REC) for i in range(4)]
        assert aio.run(IOCB_CMD_PWRITEV, reqs).tolist() == [2 * REC] * 4
        back = mmap.mmap(-1, 8 * REC)
        b = memoryview(back)
        got = aio.run(IOCB_CMD_PREADV, [(fd, [b[i * 2 * REC:(i + 1) * 2 * REC]], i * 2 * REC)
                                        for i in range(4)])
        assert got.tolist() == [2 * REC] * 4 and bytes(back) == bytes(src)
    finally:
        aio.close()
        os.close(fd)


def test_vectored_requests_of_uneven_lengths_each_write_their_own_buffers(tmp_path: Path):
    # One iovec array serves the whole batch: request i's iovecs start after the buffers of
    # every request before it. Requests of 1, 3, 2 and 1 buffers, each buffer a different
    # record of a shuffled source: a request pointed at another's iovecs writes wrong bytes.
    fd = _direct_file(tmp_path)
    aio = Aio(depth=4)
    try:
        src = _records(7)
        order = [6, 2, 0, 5, 1, 4, 3]                           # file record j <- source order[j]
        bufs = [src[k] for k in order]
        reqs, at = [], 0
        for count in (1, 3, 2, 1):
            reqs.append((fd, bufs[at: at + count], at * REC))
            at += count
        assert aio.run(IOCB_CMD_PWRITEV, reqs).tolist() == [REC, 3 * REC, 2 * REC, REC]
        back = mmap.mmap(-1, 7 * REC)
        assert aio.run(IOCB_CMD_PREADV, [(fd, [memoryview(back)], 0)]).tolist() == [7 * REC]
        got = np.frombuffer(back, dtype=np.uint8).reshape(7, REC)
        assert got[:, 0].tolist() == [k + 1 for k in order] and (got == got[:, :1]).all()
    finally:
        aio.close()
        os.close(fd)


def test_a_refused_request_gets_its_errno_and_the_rest_complete(tmp_path: Path):
    fd = _direct_file(tmp_path)
    closed = os.open(tmp_path / "g", os.O_RDWR | os.O_CREAT, 0o600)
    os.close(closed)                                  # a real bad descriptor: io_submit says EBADF
    aio = Aio(depth=4)
    try:
        src = mmap.mmap(-1, 6 * REC)
        v = memoryview(src)
        reqs = [(closed if i in (0, 3) else fd, [v[i * REC:(i + 1) * REC]], i * REC)
                for i in range(6)]
        got = aio.run(IOCB_CMD_PWRITEV, reqs, 2).tolist()
        assert got == [-9, REC, REC, -9, REC, REC]      # EBADF where refused, the others written
        assert os.fstat(fd).st_size == 6 * REC
    finally:
        aio.close()
        os.close(fd)


def test_a_closed_context_raises_instead_of_submitting(tmp_path: Path):
    aio = Aio(depth=2)
    aio.close()
    with pytest.raises(OSError, match="closed"):
        aio.run(IOCB_CMD_PREADV, [])


def test_a_set_hands_concurrent_runs_their_own_contexts_and_makes_at_most_width():
    """Two batches in flight at once get two contexts (one used to serialise every NVMe read
    of the process); a third caller waits for one to come back, never makes a fifth."""
    import threading
    s = aio_mod.AioSet(depth=8, width=2)
    a, b = s._take(), s._take()
    assert a is not b and s._made == 2
    got: list = []
    t = threading.Thread(target=lambda: got.append(s._take()))
    t.start()
    t.join(0.2)
    assert t.is_alive() and s._made == 2          # waiting: the set is at its width
    s._give(a)
    t.join(5)
    assert got == [a]
    a.close()                                      # a context that failed its reap
    s._give(a)
    assert s._made == 1 and s.alive
    s._give(b)
    s.close()
    assert not s.alive
    with pytest.raises(OSError):
        s.run(IOCB_CMD_PREADV, [])


def test_flat_requests_land_where_their_addresses_say(tmp_path: Path):
    # run_flat: requests as arrays (fd, offset, address), in a shuffled order, more of them
    # than the context's depth; each lands in its own place, and a read past the end moves 0.
    fd = _direct_file(tmp_path)
    aio = Aio(depth=4)
    try:
        n = 20
        src = mmap.mmap(-1, n * REC)
        data = np.frombuffer(src, dtype=np.uint8).reshape(n, REC)
        data[:] = np.random.default_rng(3).integers(0, 256, data.shape, dtype=np.uint8)
        order = np.random.default_rng(4).permutation(n)
        fds = np.full(n, fd, dtype=np.int64)
        base = data.ctypes.data
        done = aio.run_flat(IOCB_CMD_PWRITEV, fds, order * REC, base + order * REC, REC)
        assert (done == REC).all()
        dst = mmap.mmap(-1, (n + 1) * REC)
        out = np.frombuffer(dst, dtype=np.uint8).reshape(n + 1, REC)
        rows = np.random.default_rng(5).permutation(n)            # record i into row rows[i]
        got = aio.run_flat(IOCB_CMD_PREADV, np.full(n + 1, fd, dtype=np.int64),
                           np.arange(n + 1) * REC, out.ctypes.data + np.append(rows, n) * REC,
                           REC)
        assert got[:n].tolist() == [REC] * n and got[n] == 0
        assert (out[rows] == data).all()
    finally:
        aio.close()
        os.close(fd)


def _destroyed_by_a_failed_reap(ctx: int, depth: int) -> None:
    """A run_native call whose reap failed: it destroyed its context and raised (_reads.c)."""
    aio_mod._syscall(aio_mod._DESTROY, aio_mod.ctypes.c_ulong(ctx))
    raise OSError(5, "io_getevents: Input/output error")


def test_a_set_whose_only_context_failed_its_reap_makes_a_fresh_one_for_the_next_run(
        tmp_path: Path):
    # rev5's review: the set closed itself when its only context failed a reap, and every NVMe
    # get of the process then failed with EBADF until a restart.
    s = aio_mod.AioSet(depth=8, width=1)
    seen: list[int] = []
    with pytest.raises(OSError, match="io_getevents"):
        s.run_native(_destroyed_by_a_failed_reap)
    assert s.alive and s._made == 0
    s.run_native(lambda ctx, depth: seen.append(ctx))
    assert seen and seen[0] != 0 and s._made == 1
    fd = _direct_file(tmp_path)
    try:
        buf = mmap.mmap(-1, REC)
        buf[:] = b"k" * REC
        assert s.run(IOCB_CMD_PWRITEV, [(fd, [memoryview(buf)], 0)]).tolist() == [REC]
        back = mmap.mmap(-1, REC)
        assert s.run(IOCB_CMD_PREADV, [(fd, [memoryview(back)], 0)]).tolist() == [REC]
        assert back[:] == buf[:]
    finally:
        os.close(fd)
        s.close()
    assert not s.alive
    with pytest.raises(OSError, match="closed"):
        s.run_native(lambda ctx, depth: None)


def test_a_set_that_cannot_make_a_fresh_context_fails_each_call_loudly_then_recovers(
        monkeypatch):
    import errno
    import threading

    s = aio_mod.AioSet(depth=8, width=2)
    with pytest.raises(OSError):
        s.run_native(_destroyed_by_a_failed_reap)

    def refused(depth: int) -> None:
        raise OSError(errno.EAGAIN, "io_setup: Resource temporarily unavailable")

    with monkeypatch.context() as m:
        m.setattr(aio_mod, "Aio", refused)
        errs: list = []

        def call() -> None:
            try:
                s.run_native(lambda ctx, depth: None)
            except OSError as exc:
                errs.append(exc)

        for _ in range(2):              # per call, never a wait for a context nobody holds
            t = threading.Thread(target=call)
            t.start()
            t.join(5)
            assert not t.is_alive(), "waited for a context that no one will give back"
        assert len(errs) == 2 and all(e.errno == errno.EAGAIN for e in errs)
        assert "fs.aio-max-nr" in str(errs[0])
    assert s.alive and s.width == 2
    seen: list[int] = []
    s.run_native(lambda ctx, depth: seen.append(ctx))
    assert seen[0] != 0
    s.close()


def test_addresses_given_by_the_caller_are_the_ones_written_from(tmp_path: Path):
    # SegmentLog.write passes the addresses it checked for O_DIRECT (fio6): the iocbs point
    # at those, so the bytes written are the ones at the given addresses; a list that does
    # not name every buffer is refused before anything is submitted.
    from kvtier.tiers.aio import buffer_address
    fd = _direct_file(tmp_path)
    aio = Aio(depth=4)
    try:
        bufs = _records(4)
        reqs = [(fd, bufs[:2], 0), (fd, bufs[2:], 2 * REC)]
        # The addresses of records 3, 2, 1, 0: what is written follows them, not the views.
        addrs = [buffer_address(b) for b in reversed(bufs)]
        assert aio.run(IOCB_CMD_PWRITEV, reqs, addrs=addrs).tolist() == [2 * REC, 2 * REC]
        back = mmap.mmap(-1, 4 * REC)
        assert aio.run(IOCB_CMD_PREADV, [(fd, [memoryview(back)], 0)]).tolist() == [4 * REC]
        got = np.frombuffer(back, dtype=np.uint8).reshape(4, REC)
        assert got[:, 0].tolist() == [4, 3, 2, 1]
        with pytest.raises(ValueError, match="3 addresses for 4 buffers"):
            aio.run(IOCB_CMD_PWRITEV, reqs, addrs=addrs[:3])
    finally:
        aio.close()
        os.close(fd)
