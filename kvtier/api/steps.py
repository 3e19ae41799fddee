"""A get's steps (coherence.gets.Gets.get_steps) run by the socket server's event loop.

A get that reads NVMe is a few steps: room (eviction), decide (pin, plan), the read, install
(with versions checked), and sometimes a release and a second try. The locked steps are memory
work, a few hundred microseconds of numpy each for a batch of 64 blocks; the read is the C AIO
loop and the checksums, with the GIL released.

Where they run, and why (issue 17, bench/stall.py). When a whole get ran on an I/O thread, a
resident get beside 8 NVMe readers waited for the engine lock and for the GIL, both held by
reader threads that had to win the GIL back from each other (and from the loop) to finish
what they held the lock for: its p99 was 76x alone on the 16-core H200 host. Here:

- the locked steps run on the loop itself, so that no other thread holds the GIL while the
  engine is decided on (when the lock is taken by some other thread, a flush or a prefetch, a
  step waits for it on the loop up to LOOP_WAIT_S, then on the memory lane);
- they run one per loop iteration, in the order they came: between two of them the loop polls
  its sockets, and a resident get that arrived meanwhile is answered at once, inline in
  data_received, rather than behind every step that was ready. The next step is a zero-delay
  timer, not call_soon: asyncio's loop runs the callbacks queued by call_soon before those of
  the sockets it polls next, and both loops (asyncio's, uvloop's) poll before they run a timer
  that came due while a step ran;
- a step does not start while a frame is waiting in a socket (frames_waiting, one zero-timeout
  poll of the connections): it goes after the loop's next poll, once. Without it a frame that
  came while the loop answered other connections' frames, or ran the callbacks queued behind
  a step, waited for the whole next step: the loop polls once per iteration, and the step runs
  in the iteration's ready callbacks, before its poll (uvloop's call_later(0) is call_soon).
  Once only, so a busy socket cannot hold a get's steps back (bench/stall.py, stall3);
- an NVMe read given as a C batch (Step.read, kvtier.tiers.reads) goes to C threads that
  never take the GIL (ReadThreads); the loop learns that it is done from an eventfd it
  watches, as it learns of a frame. On the I/O pool the read's thread took the GIL back three
  times per read, and each time, while the loop ran a step, waited for CPython's 5 ms switch
  interval to force the loop off it mid-step (bench/stall_trace.py, stall3: 74% of the
  decides blocked beside 8 readers, on the H200 host);
- the other unlocked steps go to the I/O pool. A get cancelled during one (its peer gone)
  waits for it to end before its steps go on: their install frees the read's slots, which
  a read still in flight would go on writing.

Thread-safety: StepRunner is used from the loop's thread only.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import os
import threading
from typing import Any, Callable

from kvtier.coherence.gets import GetSteps, advance
from kvtier.coherence.namespace import GetResult
from kvtier.tiers import reads

Thunk = Callable[[], Any]

# How long the loop itself waits for the engine lock (the GIL released meanwhile) before a
# step goes to the memory lane. Most holders off the loop are brief (a prefetch, a release
# on the memory lane: 50-100 us); sending each step that met one to the memory lane made a
# convoy on the H200 host: the lane's thread held the lock while it waited for the GIL,
# the loop's next steps found the lock taken and followed (bench/stall.py, 8 readers:
# 654 steps on the lane, a resident get's p99 7-8 ms).
LOOP_WAIT_S = 300e-6

# The C reader threads of a StepRunner: as many as the server's I/O pool has workers (4), so
# that as many reads are in flight as before; each has its own AIO context of READ_DEPTH
# events of the host-wide fs.aio-max-nr (an NVMe get is one batch of at most its keys).
READ_THREADS = 4
READ_DEPTH = 128


class ReadThreads:
    """tiers.reads Batches read on C threads (kvtier/tiers/_reads.c's Reader); each one's end
    comes to the loop through the Reader's eventfd (add_reader). Loop thread only."""

    def __init__(self, loop: asyncio.AbstractEventLoop, threads: int = READ_THREADS,
                 depth: int = READ_DEPTH) -> None:
        self.loop = loop
        self._reader = reads.native.Reader(threads, depth, reads.checksums._fn)
        self._waiting: set[asyncio.Future] = set()      # submitted, not reaped yet
        loop.add_reader(self._reader.fd, self._reap)

    def submit(self, batch: Any) -> asyncio.Future:
        """A future of the batch's read: None, or the OSError that ended it."""
        fut = self.loop.create_future()
        self._reader.submit(batch, fut)
        self._waiting.add(fut)
        return fut

    def _reap(self) -> None:
        for fut, err in self._reader.reap():
            self._waiting.discard(fut)
            if fut.cancelled():
                continue
            if err:
                fut.set_exception(OSError(err, f"NVMe read: {os.strerror(err)}"))
            else:
                fut.set_result(None)

    def close(self) -> None:
        """Stop watching and stop the threads (after the reads queued: the GIL released).
        The reads never reaped end with an OSError: they are over (nothing is in flight once
        the threads stop), but their outcome went with the reader, and their gets would
        otherwise wait for them for ever."""
        if not self.loop.is_closed():
            self.loop.remove_reader(self._reader.fd)
        self._reader.close()
        waiting, self._waiting = self._waiting, set()
        if self.loop.is_closed():
            return                          # (no callback of its futures can run any more)
        for fut in waiting:
            if not fut.done():
                fut.set_exception(OSError(errno.ECANCELED, "NVMe read: the reader threads "
                                          "were closed before its end was reaped"))


class StepRunner:
    """Drive get steps: locked ones on the loop (one per iteration), the rest on threads.

    run_io(fn, *args) and run_mem(fn, *args) return asyncio futures of fn(*args) run on the
    server's I/O pool and memory lane."""

    def __init__(self, lock: threading.RLock, run_io: Callable[..., asyncio.Future],
                 run_mem: Callable[..., asyncio.Future],
                 frames_waiting: Callable[[], bool] = lambda: False) -> None:
        self.lock = lock
        self._run_io = run_io
        self._run_mem = run_mem
        self._frames_waiting = frames_waiting
        self._queue: collections.deque[tuple[Thunk, asyncio.Future]] = collections.deque()
        self._held_back = False         # the queue's head already waited for one poll
        self.held_back = 0              # steps that let the loop poll first (for stats)
        self._reads: ReadThreads | None = None
        self.use_read_threads = reads.available()
        self.c_reads = 0                # reads run on the C threads (for stats and tests)

    async def drive(self, steps: GetSteps) -> GetResult:
        """The get's result, once every step has run."""
        step, out = advance(steps, None, None)
        while step is not None:
            try:
                if step.locked:
                    value = await self._locked(step.fn)
                else:
                    value = await _to_its_end(self._unlocked(step))
            except BaseException as exc:
                # Back into the steps, a cancellation too: their finally installs what was
                # read (or frees its pinned slots) before the error goes on.
                step, out = advance(steps, None, exc)
            else:
                step, out = advance(steps, value, None)
        return out

    def _unlocked(self, step: Any) -> asyncio.Future:
        """An unlocked step's future: a C read on the reader threads, the rest (and every read
        where the C threads are not available) on the I/O pool."""
        if step.read is not None and self.use_read_threads:
            loop = asyncio.get_running_loop()
            if self._reads is None or self._reads.loop is not loop:
                self.close()                    # (a runner moved to a new loop)
                try:
                    self._reads = ReadThreads(loop)
                except OSError:                 # fs.aio-max-nr reached: the I/O pool
                    self.use_read_threads = False
                    return self._run_io(step.fn)
            self.c_reads += 1
            return self._reads.submit(step.read)
        return self._run_io(step.fn)

    def close(self) -> None:
        """Stop the C reader threads (the server's shutdown)."""
        if self._reads is not None:
            self._reads.close()
            self._reads = None

    def _locked(self, fn: Thunk) -> asyncio.Future:
        """fn under the engine lock, on the loop, after the steps queued before it."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.append((fn, fut))
        if len(self._queue) == 1:
            loop.call_later(0, self._next)
        return fut

    def _next(self) -> None:
        if not self._held_back and self._frames_waiting():
            # A request is waiting in a socket: the loop reads it (a resident get is answered
            # inline) before this step, whose turn comes after that poll.
            self._held_back = True
            self.held_back += 1
            asyncio.get_running_loop().call_later(0, self._next)
            return
        self._held_back = False
        fn, fut = self._queue.popleft()
        if self._queue:
            asyncio.get_running_loop().call_later(0, self._next)   # after the next poll
        if fut.cancelled():
            return
        if not self.lock.acquire(timeout=LOOP_WAIT_S):
            # Taken by another thread for longer (a flush applying its batch): wait for it
            # off the loop.
            self._run_mem(self._with_lock, fn).add_done_callback(
                lambda mem: _pass_outcome(mem, fut))
            return
        try:
            value = fn()
        except BaseException as exc:
            fut.set_exception(exc)
        else:
            fut.set_result(value)
        finally:
            self.lock.release()

    def _with_lock(self, fn: Thunk) -> Any:
        with self.lock:
            return fn()


async def _to_its_end(fut: asyncio.Future) -> Any:
    """fut's outcome; when the awaiting task is cancelled first, fut is still waited for (its
    step ends on its thread whatever happens here) before the cancellation goes on."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            try:
                await asyncio.wait([fut])
            except asyncio.CancelledError:
                pass
        if not fut.cancelled():
            fut.exception()                 # retrieved: the cancellation is what goes on
        raise


def _pass_outcome(src: asyncio.Future, dst: asyncio.Future) -> None:
    """src's result or exception into dst (unless dst was cancelled meanwhile)."""
    if dst.cancelled():
        return
    if src.cancelled():
        dst.cancel()
    elif src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())
