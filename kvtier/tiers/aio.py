"""Linux native AIO (io_submit / io_getevents) through ctypes, for the NVMe tier.

Why. Python threads issuing preadv top out near 20k IOPS on the 2-core development machine (the
GIL and the executor's per-task cost), while fio keeps 32 requests in flight with one thread.
Native AIO on O_DIRECT files does the same from Python: one io_submit of a whole batch, one
io_getevents for the completions, both in C with the GIL released. bench/nvme.py measures it.

No new dependency: the iocbs live in a numpy structured array laid out as ``struct iocb`` of
<linux/aio_abi.h>, one per request of the batch. The submit/reap loop runs in the optional C
helper ``_aio.c`` (built by setup.py, the GIL released) and otherwise in Python, with the
syscalls through libc's syscall(); the Python loop costs 20-40 us a completion on the
development VM, though bench/nvme.py was disk-bound there either way. Only on x86-64 and aarch64 Linux; elsewhere
``Aio.available()`` is False and the tier uses threads.
Thread-safety: Aio.run() serialises on the context's lock. Every segment log of the process
shares one AioSet of up to 4 contexts (acquire_shared), so that up to 4 batches (concurrent gets,
a put's write) are in flight at once: each namespace used to set up its own context, 256 events
of the host-wide fs.aio-max-nr (65,536 by default), so ~256 namespaces exhausted it for every
process on the host (issue 20).
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import platform
import threading
from typing import Callable, Sequence

import numpy as np

_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_SETUP, _DESTROY, _GETEVENTS, _SUBMIT = _SYSCALLS.get(platform.machine(), (-1, -1, -1, -1))

IOCB_CMD_PREAD = 0
IOCB_CMD_PWRITE = 1
IOCB_CMD_PREADV = 7
IOCB_CMD_PWRITEV = 8
_PLAIN = {IOCB_CMD_PREADV: IOCB_CMD_PREAD, IOCB_CMD_PWRITEV: IOCB_CMD_PWRITE}

_IOCB = np.dtype([("data", "<u8"), ("key", "<u4"), ("rw_flags", "<u4"), ("opcode", "<u2"),
                  ("reqprio", "<i2"), ("fildes", "<u4"), ("buf", "<u8"), ("nbytes", "<u8"),
                  ("offset", "<i8"), ("reserved2", "<u8"), ("flags", "<u4"), ("resfd", "<u4")])
_EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])
_IOVEC = np.dtype([("base", "<u8"), ("len", "<u8")])

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


try:
    from kvtier.tiers import _aio as _native
except ImportError:            # not built (no C compiler at install): the Python loop below
    _native = None


def buffer_address(buf: memoryview | bytearray) -> int:
    """The address of a buffer's first byte. ctypes for a writable one (under a microsecond),
    numpy's view otherwise (read-only or empty buffers: ~5 us on the development VM)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except (TypeError, ValueError, BufferError):
        return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def _iocbs(opcode: int, requests: Sequence[tuple[int, Sequence[memoryview], int]],
           addrs: Sequence[int] | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
    """One iocb per request, its ``data`` its own index, and the iovec array they point into
    (which must outlive the requests). Requests of one buffer each become plain PREAD/PWRITE,
    with no iovec array to build.

    One iovec array for the whole batch, filled by a few numpy calls: an array and a
    structured-field write per request cost ~200 us for a put's 9 PWRITEVs of two records
    (issue 17, fio3: a tenth of a put's CPU). addrs: the buffers' addresses in request
    order, where the caller has them already (SegmentLog.write: it checks them for O_DIRECT)."""
    n = len(requests)
    cb = np.zeros(n, dtype=_IOCB)
    cb["data"] = np.arange(n)
    cb["fildes"] = [r[0] for r in requests]
    cb["offset"] = [r[2] for r in requests]
    counts = [len(r[1]) for r in requests]
    bufs = [b for r in requests for b in r[1]]
    if addrs is None:
        addrs = [buffer_address(b) for b in bufs]
    elif len(addrs) != len(bufs):
        raise ValueError(f"{len(addrs)} addresses for {len(bufs)} buffers")
    if all(c == 1 for c in counts):
        cb["opcode"] = _PLAIN[opcode]
        cb["buf"] = addrs
        cb["nbytes"] = [len(b) for b in bufs]
        return cb, []
    cb["opcode"] = opcode
    iov = np.empty(len(bufs), dtype=_IOVEC)
    iov["base"] = addrs
    iov["len"] = [len(b) for b in bufs]
    base, size = iov.ctypes.data, _IOVEC.itemsize
    cb["buf"] = [base + size * k for k in itertools.accumulate(counts[:-1], initial=0)]
    cb["nbytes"] = counts
    return cb, [iov]


class Aio:
    """A context of up to ``depth`` in-flight requests. run() keeps a window of them in flight
    over a batch of any length and returns when all are done."""

    def __init__(self, depth: int = 256) -> None:
        if _SETUP < 0:
            raise OSError(errno.ENOSYS, "native AIO is wired up for x86-64 and aarch64 only")
        self.depth = depth
        self._ctx = ctypes.c_ulong(0)
        if _syscall(_SETUP, ctypes.c_uint(depth), ctypes.byref(self._ctx)) < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"io_setup: {os.strerror(e)}")
        self._events = np.zeros(depth, dtype=_EVENT)
        self._lock = threading.Lock()

    @staticmethod
    def available() -> bool:
        try:
            Aio(1).close()
            return True
        except OSError:
            return False

    def run(self, opcode: int, requests: Sequence[tuple[int, Sequence[memoryview], int]],
            window: int | None = None, addrs: Sequence[int] | None = None) -> np.ndarray:
        """Each request is (fd, buffers, file offset): one PREADV or PWRITEV. Returns the bytes
        moved per request, or -errno. At most ``window`` (default: depth) are in flight; as
        each completes the next is submitted, so a long batch keeps the device's queue full
        instead of draining it every ``depth`` requests. addrs: the buffers' addresses, in
        request order, where the caller has them (else they are taken from the buffers)."""
        cbs, keep = _iocbs(opcode, requests, addrs)
        out = self._run_cbs(cbs, window, lambda i, o: self._sync_one(opcode, requests[i], o, i))
        del keep                            # the iovecs: alive until every request completed
        return out

    def run_flat(self, opcode: int, fds: np.ndarray, offsets: np.ndarray, addrs: np.ndarray,
                 nbytes: int, window: int | None = None) -> np.ndarray:
        """run() for requests of one buffer each, given as arrays: request i moves ``nbytes``
        between file offset offsets[i] of fds[i] and the memory at address addrs[i] (PREAD or
        PWRITE). The iocbs are filled by a few numpy calls, not one Python call per request,
        so a batch costs the GIL a few tens of microseconds whatever its length (issue 17:
        an NVMe get of 64 blocks spent most of its GIL time building requests). The caller
        keeps the memory alive and, for O_DIRECT files, aligned."""
        n = len(fds)
        cb = np.zeros(n, dtype=_IOCB)
        cb["data"] = np.arange(n)
        cb["fildes"] = fds
        cb["offset"] = offsets
        cb["buf"] = addrs
        cb["nbytes"] = nbytes
        cb["opcode"] = _PLAIN.get(opcode, opcode)
        return self._run_cbs(cb, window, lambda i, o: _sync_flat(cb[i], o, i))

    def write_run(self, fd: int, offset: int, addrs: np.ndarray, nbytes: int, per: int,
                  window: int | None = None) -> np.ndarray | None:
        """Buffers of nbytes each at addrs (int64) written to fd from offset on, consecutive,
        as PWRITEVs of ``per`` buffers (the last of the rest), all built and run in one C call
        (_aio.c write_run). Returns the bytes each request wrote, or -errno; None where the C
        module is not built (the caller uses run()). The caller keeps the buffers alive."""
        if _native is None or not hasattr(_native, "write_run"):
            return None
        if not self._ctx.value:
            raise OSError(errno.EBADF, "this AIO context is closed")
        out = np.empty(-(-len(addrs) // per) if per > 0 else 0, dtype=np.int64)
        window = max(1, min(window or self.depth, self.depth))
        with self._lock:
            try:
                _native.write_run(self._ctx.value, window, fd, offset, addrs, nbytes, per, out)
            except OSError:
                self.close()                # as _loop: io_destroy waited for what was in flight
                raise
        return out

    def _run_cbs(self, cbs: np.ndarray, window: int | None,
                 sync_one: Callable[[int, np.ndarray], None]) -> np.ndarray:
        if not self._ctx.value:
            raise OSError(errno.EBADF, "this AIO context is closed")
        n = len(cbs)
        out = np.zeros(n, dtype=np.int64)
        window = max(1, min(window or self.depth, self.depth))
        with self._lock:
            first = 0
            while first < n:
                first = self._loop(cbs, out, first, window)
                if first < n:
                    # The kernel's queue refused even one with nothing in flight: do it here.
                    sync_one(first, out)
                    first += 1
        return out

    def _loop(self, cbs: np.ndarray, out: np.ndarray, first: int, window: int) -> int:
        """Submit cbs[first:] with at most ``window`` in flight and reap them all. Returns len
        (cbs), or the index of a request the kernel refused with EAGAIN while nothing was in
        flight. The C loop (_aio.c) where built; this Python one otherwise."""
        try:
            if _native is not None:
                return _native.run(self._ctx.value, cbs, out, first, window)
            return self._loop_py(cbs, out, first, window)
        except OSError:
            # io_getevents failed with requests in flight: io_destroy waits for them, so no
            # buffer is freed under the kernel. The context is gone; the tier falls back.
            self.close()
            raise

    def _loop_py(self, cbs: np.ndarray, out: np.ndarray, first: int, window: int) -> int:
        n = len(cbs)
        ptrs = cbs.ctypes.data + np.arange(n, dtype=np.uint64) * _IOCB.itemsize
        nxt, inflight = first, 0
        while nxt < n or inflight:
            k = min(window - inflight, n - nxt)
            if k > 0:
                got = _syscall(_SUBMIT, self._ctx, ctypes.c_long(k),
                               ctypes.c_void_p(ptrs.ctypes.data + nxt * 8))
                if got >= 0:
                    nxt += got
                    inflight += got
                else:
                    e = ctypes.get_errno()
                    if e == errno.EAGAIN:
                        if inflight == 0:
                            return nxt
                    elif e != errno.EINTR:
                        out[nxt] = -e                # refused; the rest go on
                        nxt += 1
                        continue
            if inflight:
                got = _syscall(_GETEVENTS, self._ctx, ctypes.c_long(1), ctypes.c_long(window),
                               ctypes.c_void_p(self._events.ctypes.data), None)
                if got < 0:
                    e = ctypes.get_errno()
                    if e == errno.EINTR:
                        continue
                    raise OSError(e, f"io_getevents: {os.strerror(e)}")
                ev = self._events[:got]
                out[ev["data"].astype(np.int64)] = ev["res"]
                inflight -= got
        return nxt

    @staticmethod
    def _sync_one(opcode: int, request: tuple[int, Sequence[memoryview], int],
                  out: np.ndarray, i: int) -> None:
        fd, bufs, offset = request
        try:
            out[i] = (os.preadv if opcode == IOCB_CMD_PREADV else os.pwritev)(fd, bufs, offset)
        except OSError as exc:
            out[i] = -(exc.errno or errno.EIO)

    def close(self, _syscall: object = _syscall, _destroy: int = _DESTROY) -> None:
        # (bound at definition: the process-wide context may be destroyed by __del__ at
        # interpreter exit, when module globals are already gone)
        if self._ctx.value:
            _syscall(_destroy, self._ctx)
            self._ctx = ctypes.c_ulong(0)

    def __del__(self) -> None:
        self.close()


class AioSet:
    """A few AIO contexts that threads share: run() takes a free one (making it on first
    need, up to ``width``) or waits for one. One context serialised every NVMe read of the
    process behind the batch in flight, a write's included (issue 17: concurrent gets queued
    one behind the other, and a randrw job's reads waited for its puts' writes)."""

    def __init__(self, depth: int = 256, width: int = 4) -> None:
        self.depth = depth
        self.width = width
        self._free: list[Aio] = [Aio(depth)]      # the first at once: availability is known
        self._made = 1
        self._closed = False                      # by close() only: a failed reap never does
        self._cv = threading.Condition()

    @property
    def alive(self) -> bool:
        """False once close() ran. A set whose contexts all failed their reaps is still alive:
        its next run makes a fresh context."""
        with self._cv:
            return not self._closed

    def run(self, opcode: int, requests: Sequence[tuple[int, Sequence[memoryview], int]],
            window: int | None = None, addrs: Sequence[int] | None = None) -> np.ndarray:
        """Aio.run on a free context of the set."""
        aio = self._take()
        try:
            return aio.run(opcode, requests, window, addrs)
        finally:
            self._give(aio)

    def run_flat(self, opcode: int, fds: np.ndarray, offsets: np.ndarray, addrs: np.ndarray,
                 nbytes: int, window: int | None = None) -> np.ndarray:
        """Aio.run_flat on a free context of the set."""
        aio = self._take()
        try:
            return aio.run_flat(opcode, fds, offsets, addrs, nbytes, window)
        finally:
            self._give(aio)

    def write_run(self, fd: int, offset: int, addrs: np.ndarray, nbytes: int, per: int,
                  window: int | None = None) -> np.ndarray | None:
        """Aio.write_run on a free context of the set."""
        aio = self._take()
        try:
            return aio.write_run(fd, offset, addrs, nbytes, per, window)
        finally:
            self._give(aio)

    def run_native(self, fn: Callable[[int, int], None]) -> None:
        """fn(ctx, depth) on a free context of the set: a C call that runs its own submit and
        reap loop (tiers/reads.py). When fn raises OSError its context was destroyed by fn
        (after a failed reap, which io_destroy waits out) and is dropped here."""
        aio = self._take()
        try:
            with aio._lock:
                fn(aio._ctx.value, aio.depth)
        except OSError:
            aio._ctx = ctypes.c_ulong(0)         # destroyed by fn: never reused
            raise
        finally:
            self._give(aio)

    def _take(self) -> Aio:
        """A free context, a new one (up to width), or the next one given back.

        A context that failed its reap is dropped (_give), and the next caller makes a fresh
        one in its place: the set used to close itself when its only context failed, and every
        NVMe get of the process then failed with EBADF until a restart (rev5's review). When
        no context is left and io_setup refuses a fresh one, this call raises io_setup's
        error (naming fs.aio-max-nr) and the next call tries again."""
        with self._cv:
            while True:
                if self._closed:
                    raise OSError(errno.EBADF, "this AIO context set is closed")
                if self._free:
                    return self._free.pop()
                if self._made < self.width:
                    try:
                        aio = Aio(self.depth)
                    except OSError as exc:
                        if self._made == 0:         # nothing to wait for: say so, per call
                            raise OSError(exc.errno, f"{exc.strerror}: no AIO context for "
                                          "the NVMe tier (every one failed; raise "
                                          "fs.aio-max-nr if io_setup said EAGAIN)") from None
                        self.width = self._made     # the host-wide limit: share what exists
                    else:
                        self._made += 1
                        return aio
                    continue
                self._cv.wait()

    def _give(self, aio: Aio) -> None:
        with self._cv:
            if aio._ctx.value and not self._closed:
                self._free.append(aio)
            else:                   # failed its reap (a fresh one is made on need), or closing
                aio.close()
                self._made -= 1
            self._cv.notify()

    def close(self) -> None:
        """Destroy the contexts (their users are done: release_shared's last one)."""
        with self._cv:
            for a in self._free:
                a.close()
            self._made -= len(self._free)
            self._free.clear()
            self._closed = True
            self._cv.notify_all()


def _sync_flat(cb: np.void, out: np.ndarray, i: int) -> None:
    """One flat request done synchronously (the kernel's queue refused it)."""
    buf = (ctypes.c_char * int(cb["nbytes"])).from_address(int(cb["buf"]))
    op = os.preadv if int(cb["opcode"]) == IOCB_CMD_PREAD else os.pwritev
    try:
        out[i] = op(int(cb["fildes"]), [memoryview(buf).cast("B")], int(cb["offset"]))
    except OSError as exc:
        out[i] = -(exc.errno or errno.EIO)


_shared: AioSet | None = None
_shared_users = 0
_shared_lock = threading.Lock()


def acquire_shared(depth: int = 256) -> AioSet | None:
    """The process's AIO contexts (an AioSet of up to 4, each ``depth`` events of the
    host-wide fs.aio-max-nr), set up on first use; None where native AIO is missing or the
    host-wide limit is reached (io_setup: EAGAIN), and the caller then uses threads. Give
    it back with release_shared()."""
    global _shared, _shared_users
    with _shared_lock:
        if _shared is None or not _shared.alive:
            try:
                _shared = AioSet(depth)
            except OSError:
                return None
        _shared_users += 1
        return _shared


def release_shared(aio: AioSet) -> None:
    """One user fewer; the contexts are destroyed with their last user."""
    global _shared, _shared_users
    with _shared_lock:
        if aio is not _shared:
            aio.close()              # a set replaced after a failure: this was its user
            return
        _shared_users -= 1
        if _shared_users == 0:
            aio.close()
            _shared = None
