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
- they run one per loop iteration, in the order they came, as slices (a locked step and the
  get's Python up to its next step) of one queue that also holds the long requests' dispatch
  (StepRunner.later: kvtier.api.connection answers the short ones in data_received and queues
  the rest): between two slices the loop polls its sockets, and a short request that arrived
  meanwhile is answered at once, rather than behind every slice that was ready. A get goes
  from slice to slice by callbacks, no task wakes between its steps. The next step is a zero-delay
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
from functools import partial
from typing import Any, Callable

from kvtier.coherence.gets import GetSteps, Step, advance
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
        self._reader = reads.native.Reader(threads, depth, reads.XXH3_READ)
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


def released_first(release: Thunk, steps: GetSteps) -> GetSteps:
    """steps, after release (a request's piggybacked releases) as a locked step of their own:
    the slice ahead of the get's first step, not part of the request's dispatch (stall12: the
    release of an NVMe reader's previous 64 blocks was ~17 of its dispatch's ~80 us, the
    longest slice of the loop). The get's steps start only once it ran; when it raises (or a
    cancel is thrown in there) they never start, so nothing of the get is left to end; the
    releases still end after a cancel thrown in before they ran (a get's task cancelled while
    the step was queued), as a cleanup step (a driver runs the steps after its cancel)."""
    try:
        yield Step(True, release)
    except asyncio.CancelledError:
        yield Step(True, release)
        raise
    return (yield from steps)


class _Job:
    """One get's steps as StepRunner drives them: the generator, the future of its result
    (the awaiting coroutine's), whether its cancellation was thrown into the steps (once:
    their cleanup steps then run), whether they are over, the future of their end that a
    cancelled drive waits for, and what takes a result they return after the cancel."""

    __slots__ = ("steps", "fut", "thrown", "over", "end", "dropped")

    def __init__(self, steps: GetSteps, fut: asyncio.Future,
                 dropped: Callable[[Any], None] | None = None) -> None:
        self.steps = steps
        self.fut = fut
        self.dropped = dropped
        self.thrown = False
        self.over = False
        self.end: asyncio.Future | None = None


# What a queued slice is: a get's locked step (its job is resumed with the value), a locked
# thunk whose future gets the value (_locked), or a thunk run on the loop with no lock (later).
_JOB, _FUT, _LOOP = 0, 1, 2


class StepRunner:
    """Drive get steps: locked ones on the loop (one slice per iteration), the rest on threads;
    and the loop's other long work (later: a long request's dispatch) in the same queue.

    A slice is a locked step and the get's own Python up to its next step (the generator's
    advance), or one thunk of later(). Slices run one per loop iteration in the order they
    came, each held back once while a frame waits in a socket (frames_waiting), so that a
    short request that arrives meanwhile waits for at most the slice in progress. A get's
    steps go from slice to slice, and from an unlocked step's end to its next slice, by
    callbacks: no task wakes between them (stall6: beside 8 readers the probe's tail waited
    ~77 us for untraced wake-ups, the readers' tasks resumed between two steps).

    run_io(fn, *args) and run_mem(fn, *args) return asyncio futures of fn(*args) run on the
    server's I/O pool and memory lane."""

    def __init__(self, lock: threading.RLock, run_io: Callable[..., asyncio.Future],
                 run_mem: Callable[..., asyncio.Future],
                 frames_waiting: Callable[[], bool] = lambda: False) -> None:
        self.lock = lock
        self._run_io = run_io
        self._run_mem = run_mem
        self._frames_waiting = frames_waiting
        self._queue: collections.deque[tuple[Thunk, int, Any]] = collections.deque()
        self._held_back = False         # the queue's head already waited for one poll
        self.held_back = 0              # slices that let the loop poll first (for stats)
        self.slices = 0                 # slices run (for stats and tests)
        self._reads: ReadThreads | None = None
        self.use_read_threads = reads.available()
        self.c_reads = 0                # reads run on the C threads (for stats and tests)

    async def drive(self, steps: GetSteps,
                    dropped: Callable[[Any], None] | None = None) -> GetResult:
        """The get's result, once every step has run. When the awaiting task is cancelled
        (its peer gone), the steps still go on: an unlocked step in flight ends first, then
        the cancellation is thrown into the steps (their finally installs what was read, or
        frees its pinned slots), and only once they are over does the cancellation go on.
        dropped(result): a result the steps returned all the same (their last step, a lease's,
        ran on the memory lane while the cancel came: _after_locked), which nobody will read;
        it must end what the result holds."""
        job = _Job(steps, asyncio.get_running_loop().create_future(), dropped)
        self._advance(job, None, None)
        try:
            return await job.fut
        except asyncio.CancelledError:
            if not job.over and job.end is None:
                job.end = asyncio.get_running_loop().create_future()
            while not job.over and not job.end.done():
                try:
                    await asyncio.wait([job.end])
                except asyncio.CancelledError:
                    pass
            raise

    def _advance(self, job: _Job, value: Any, exc: BaseException | None,
                 ran_locked: bool = False) -> None:
        """Send value (or throw exc) into job's steps, and queue or start the next step.
        ran_locked: value is a locked step's that ran on the memory lane; a cancel is then
        thrown in at the next step, not instead of this one's value (the locked steps read
        a cancel thrown in as a step that did not run)."""
        if job.fut.cancelled() and not job.thrown and not ran_locked:
            exc = asyncio.CancelledError()      # once: the steps' cleanup steps then run
        if isinstance(exc, asyncio.CancelledError):
            job.thrown = True
        try:
            step, out = advance(job.steps, value, exc)
        except BaseException as err:
            self._over(job, None, err)
            return
        if step is None:
            self._over(job, out, None)
        elif step.locked:
            self._push(step.fn, _JOB, job)
        else:
            self._unlocked(step).add_done_callback(partial(self._after, job))

    def _after(self, job: _Job, fut: asyncio.Future) -> None:
        """An unlocked step (or a locked one run on the memory lane) ended: resume its get."""
        if fut.cancelled():
            self._advance(job, None, asyncio.CancelledError())
        elif fut.exception() is not None:
            self._advance(job, None, fut.exception())
        else:
            self._advance(job, fut.result(), None)

    def _after_locked(self, job: _Job, fut: asyncio.Future) -> None:
        """A locked step run on the memory lane ended: resume its get with the step's own
        outcome, even where the get was cancelled while the step waited for the lock (rev13:
        the room step's pins or the releases were taken, and a cancel thrown in there, as
        though the step had not run, left the pins, or ran the releases twice). The cancel
        is thrown in at the next step (a get whose last step this was gives its result to
        drive's dropped). A step that raised is _after's,
        as before: the cancel in its place (a failed step ends what it took itself, and the
        cleanup steps the cancel calls for then run; thrown after its error, they would be
        refused)."""
        if fut.cancelled() or fut.exception() is not None:
            self._after(job, fut)
        else:
            self._advance(job, fut.result(), None, ran_locked=True)

    @staticmethod
    def _over(job: _Job, out: Any, exc: BaseException | None) -> None:
        job.over = True
        if job.end is not None and not job.end.done():
            job.end.set_result(None)
        if job.fut.done():
            # Cancelled: the steps' own end was waited for. A result made all the same
            # (its last step ran on the memory lane) goes to dropped (rev13: its lease was
            # left until lease_timeout).
            if exc is None and out is not None and job.dropped is not None:
                job.dropped(out)
            return
        if exc is None:
            job.fut.set_result(out)
        elif isinstance(exc, asyncio.CancelledError):
            job.fut.cancel()
        else:
            job.fut.set_exception(exc)

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
        """fn under the engine lock, on the loop, after the slices queued before it."""
        fut = asyncio.get_running_loop().create_future()
        self._push(fn, _FUT, fut)
        return fut

    @property
    def busy(self) -> bool:
        """Whether slices are queued (a long request's dispatch then queues behind them)."""
        return bool(self._queue)

    def later(self, fn: Thunk) -> None:
        """fn on the loop, no lock taken, as a slice after those queued before it: a long
        request's dispatch (kvtier.api.connection), which then waits its turn behind the
        steps already queued rather than running in data_received ahead of the short
        requests read in the same poll. fn's exceptions are fn's to handle."""
        self._push(fn, _LOOP, None)

    def _push(self, fn: Thunk, kind: int, target: Any) -> None:
        self._queue.append((fn, kind, target))
        if len(self._queue) == 1:
            asyncio.get_running_loop().call_later(0, self._next)

    def _next(self) -> None:
        if not self._held_back and self._frames_waiting():
            # A request is waiting in a socket: the loop reads it (a short one is answered
            # inline) before this slice, whose turn comes after that poll.
            self._held_back = True
            self.held_back += 1
            asyncio.get_running_loop().call_later(0, self._next)
            return
        self._held_back = False
        fn, kind, target = self._queue.popleft()
        if self._queue:
            asyncio.get_running_loop().call_later(0, self._next)   # after the next poll
        self.slices += 1
        if kind == _LOOP:
            fn()
            return
        if kind == _JOB and target.fut.cancelled() and not target.thrown:
            self._advance(target, None, asyncio.CancelledError())   # the step is not run
            return
        if kind == _FUT and target.cancelled():
            return
        if not self.lock.acquire(timeout=LOOP_WAIT_S):
            # Taken by another thread for longer (a flush applying its batch): wait for it
            # off the loop.
            mem = self._run_mem(self._with_lock, fn)
            mem.add_done_callback(partial(self._after_locked, target) if kind == _JOB
                                  else partial(_pass_outcome, dst=target))
            return
        value, exc = None, None
        try:
            value = fn()
        except BaseException as err:
            exc = err
        finally:
            self.lock.release()
        if kind == _JOB:
            self._advance(target, value, exc)     # the get's Python up to its next step
        elif exc is not None:
            target.set_exception(exc)
        else:
            target.set_result(value)

    def _with_lock(self, fn: Thunk) -> Any:
        with self.lock:
            return fn()


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
