"""bench/stall_trace.py's hooks, loaded into `kvtier serve` as sitecustomize (PYTHONPATH) when
STALL_TRACE names a file and STALL_TRACE_ROLE is "serve": the loop's work is timed by kind
(a locked step by its function, a connection's data_received, a reply built, a reply written,
an inline engine call, piggybacked releases; the loop thread's CPU time in steps and
data_received: wall time beyond it is waiting, for the GIL, a lock or a core), each NVMe read
on the I/O threads, and the NVMe log's pin (in the decide) and unpin (after each read); the
list is pickled at exit. Perf counters are CLOCK_MONOTONIC, the probe's clock too. For
measuring only: it wraps methods of kvtier.api.server, kvtier.api.steps,
kvtier.coherence.persist and kvtier.tiers.nvme, and adds a gc callback (each collection
timed, by generation). STALL_SWITCH_INTERVAL: see below.
"""
import os, atexit, time

# bench/stall.py --switch-interval S: the service's GIL switch interval (its threads and the
# loop hand the GIL over after S seconds instead of 5 ms), in `kvtier serve` only.
_sw = os.environ.get("STALL_SWITCH_INTERVAL")
if _sw:
    try:
        with open("/proc/self/cmdline", "rb") as _fh:
            _cmd = _fh.read().split(b"\0")
    except OSError:
        _cmd = []
    if b"kvtier.cli" in _cmd and b"serve" in _cmd:
        import sys
        sys.setswitchinterval(float(_sw))
_path = os.environ.get("STALL_TRACE")
if _path and os.environ.get("STALL_TRACE_ROLE") == "serve":
    import pickle
    pc = time.perf_counter
    tt = time.thread_time     # the loop thread's CPU time: wall minus it is waiting
    import resource
    _ru = resource.getrusage
    _RT = resource.RUSAGE_THREAD
    def cs():
        # The loop thread's context switches: voluntary (it blocked: the GIL, a lock) and
        # involuntary (the OS preempted it: a core shared), each call ~1 us.
        r = _ru(_RT)
        return r.ru_nvcsw, r.ru_nivcsw
    EV = []
    def _dump():
        with open(_path, "wb") as f:
            pickle.dump(EV, f)
    atexit.register(_dump)
    # CPython's cyclic garbage collector, in whichever thread an allocation set it off: the
    # GIL is held throughout, so every thread's Python waits for it ("gc:<generation>",
    # with what it collected; stall8). Most of these collections are the tracer's own: each
    # event is a tuple the collector tracks, and their count sets off a generation-0 run
    # every 700 (H200, beside 8 readers: 22 a phase of ~125 us each, in 30-38% of the tail
    # gets; the service untraced, dev VM: ~5 in the ~9 s of the measured phases, collecting
    # nothing). STALL_TRACE_GC=off turns the collector off in the traced service, so that a
    # trace's tail holds none of them.
    import gc
    if os.environ.get("STALL_TRACE_GC") == "off":
        gc.disable()
    _gc_t0 = [0.0]
    def _gc_cb(phase, info):
        if phase == "start":
            _gc_t0[0] = pc()
        else:
            EV.append(("gc", _gc_t0[0], pc(), info.get("generation"), info.get("collected")))
    gc.callbacks.append(_gc_cb)
    # STALL_GC_TYPES=FILE: what the collections find, by type (gc.DEBUG_SAVEALL keeps every
    # unreachable object in gc.garbage; their type names counted into FILE, JSON, at exit).
    _gc_types = os.environ.get("STALL_GC_TYPES")
    if _gc_types:
        gc.set_debug(gc.DEBUG_SAVEALL)
        def _dump_types():
            import collections, json
            c = collections.Counter(type(o).__qualname__ for o in gc.garbage)
            with open(_gc_types, "w") as f:
                json.dump(c.most_common(40), f)
        atexit.register(_dump_types)
    import kvtier.api.steps as S
    import kvtier.api.server as SV
    _next = S.StepRunner._next
    def _next_t(self):
        fn = self._queue[0][0] if self._queue else None
        v0, i0 = cs(); c0 = tt(); t0 = pc(); _next(self); t1 = pc(); c1 = tt(); v1, i1 = cs()
        EV.append(("step", t0, t1, getattr(getattr(fn, "func", None), "__name__", "?"), c1 - c0,
                   v1 - v0, i1 - i0))
    S.StepRunner._next = _next_t
    try:                          # one worker's connection: api/connection.py since its split
        from kvtier.api.connection import Connection as C
    except ImportError:           # (a tree from before it: server.py's _Connection)
        C = SV._Connection
    _dr = C.data_received
    def _dr_t(self, data):
        v0, i0 = cs(); c0 = tt(); t0 = pc(); _dr(self, data); t1 = pc(); c1 = tt(); v1, i1 = cs()
        EV.append(("dr", t0, t1, getattr(self.client, "name", "?"), c1 - c0, v1 - v0, i1 - i0))
    C.data_received = _dr_t
    _w = C._write
    def _w_t(self, reply, t0_):
        t0 = pc(); _w(self, reply, t0_); t1 = pc()
        EV.append(("write", t0, t1, getattr(self.client, "name", "?"), t0_))
    C._write = _w_t
    _gr = SV.Server._get_reply
    def _gr_t(self, *a, **k):
        t0 = pc(); r = _gr(self, *a, **k); t1 = pc()
        EV.append(("reply", t0, t1, getattr(a[0], "name", "?")))
        return r
    SV.Server._get_reply = _gr_t
    _el = SV.Server._end_leases
    def _el_t(self, *a):
        t0 = pc(); r = _el(self, *a); t1 = pc()
        EV.append(("endl", t0, t1, getattr(a[0], "name", "?")))
        return r
    SV.Server._end_leases = _el_t
    _fast = SV.Server._fast
    def _fast_t(self, fn, *a):
        t0 = pc(); r = _fast(self, fn, *a); t1 = pc()
        EV.append(("fast", t0, t1, getattr(fn, "__name__", "?"), r[0]))
        return r
    SV.Server._fast = _fast_t
    import kvtier.coherence.persist as PE
    import threading
    _tl = threading.local()
    _rr = PE.NvmeStore.run_read
    def _rr_t(self, *a, **k):
        _tl.nogil = 0.0
        t0 = pc(); r = _rr(self, *a, **k); t1 = pc()
        EV.append(("read", t0, t1, "io", t1 - t0 - _tl.nogil))    # 5th: its Python, GIL held
        return r
    PE.NvmeStore.run_read = _rr_t
    # The read's parts that run without the GIL (the AIO loop, the checksums): run_read's
    # wall time minus these is the I/O thread's Python, holding the GIL the loop wants.
    _bc = PE.block_checksums
    def _bc_t(*a, **k):
        t0 = pc(); r = _bc(*a, **k); t1 = pc()
        _tl.nogil = getattr(_tl, "nogil", 0.0) + (t1 - t0)
        return r
    PE.block_checksums = _bc_t
    import kvtier.tiers.nvme as NV
    for _cls in [c for c in vars(NV).values() if isinstance(c, type) and "pin" in vars(c)]:
        def _wrap(orig, kind):
            def f(self, *a, **k):
                t0 = pc(); r = orig(self, *a, **k); t1 = pc()
                EV.append((kind, t0, t1, "lock"))
                return r
            return f
        _cls.pin = _wrap(_cls.pin, "pin")
        if "read_rows" in vars(_cls):
            def _nogil(orig):
                def f(self, *a, **k):
                    t0 = pc(); r = orig(self, *a, **k)
                    _tl.nogil = getattr(_tl, "nogil", 0.0) + (pc() - t0)
                    return r
                return f
            _cls.read_rows = _nogil(_cls.read_rows)
        if "unpin" in vars(_cls):
            _cls.unpin = _wrap(_cls.unpin, "unpin")
    # The C read path (kvtier.api.steps.ReadThreads, stall4): each read from its submit on the
    # loop to its reap there, as a "read" event with no I/O-thread Python (0.0); the loop's
    # reap callback itself as loop work ("reap").
    if hasattr(S, "ReadThreads"):
        _sub = S.ReadThreads.submit
        _t_sub = {}
        def _sub_t(self, batch):
            fut = _sub(self, batch)
            _t_sub[id(fut)] = pc()
            return fut
        S.ReadThreads.submit = _sub_t
        _reader_reap = S.ReadThreads._reap
        def _reap_t(self):
            t0 = pc()
            real = self._reader.reap
            got = []
            def reap():
                out = real()
                got.extend(out)
                return out
            self._reader = _Shim(self._reader, reap)
            try:
                _reader_reap(self)
            finally:
                self._reader = self._reader.inner
            t1 = pc()
            for fut, _err in got:
                ts = _t_sub.pop(id(fut), None)
                if ts is not None:
                    EV.append(("read", ts, t0, "c", 0.0))
            EV.append(("reap", t0, t1, "loop"))
        class _Shim:
            def __init__(self, inner, reap):
                self.inner, self.reap = inner, reap
            def __getattr__(self, k):
                return getattr(self.inner, k)
        S.ReadThreads._reap = _reap_t
    # STALL_TRACE_TASKS=1: the steps of the reply tasks (Connection._finish, "reply-<cid>")
    # timed as loop work too, "task:start" (the first step, to its first await), "task:end"
    # (the last, which writes the reply) and "task:mid": on a loop of pure-Python tasks (a
    # few microseconds slower a step), set as the server starts (stall12: the reply task's
    # last step was the loop's longest slice, and no step event saw it).
    if os.environ.get("STALL_TRACE_TASKS") == "1":
        import asyncio
        class _TimedTask(asyncio.tasks._PyTask):
            def _Task__step(self, exc=None):
                first = not getattr(self, "_stepped", False)
                self._stepped = True
                v0, i0 = cs(); c0 = tt(); t0 = pc()
                super()._Task__step(exc)
                t1 = pc(); c1 = tt(); v1, i1 = cs()
                name = self.get_name() or ""
                if name.startswith("reply-"):
                    kind = "start" if first else ("end" if self.done() else "mid")
                    EV.append(("task", t0, t1, kind, c1 - c0, v1 - v0, i1 - i0))
        _srv_start = SV.Server.start
        async def _start_t(self):
            asyncio.get_running_loop().set_task_factory(
                lambda loop, coro, **kw: _TimedTask(coro, loop=loop, **kw))
            await _srv_start(self)
        SV.Server.start = _start_t
    # STALL_TRACE_PARTS="module:Class.method,...": each named function timed as a "part" event
    # (nested in the step or request that calls it; bench/stall_trace.py --parts), to split a
    # step's time in the service itself, where it costs more than in process (stall9, stall10).
    _parts = os.environ.get("STALL_TRACE_PARTS")
    if _parts:
        import importlib
        for _spec in _parts.split(","):
            _mod, _, _attr = _spec.partition(":")
            _owner = importlib.import_module(_mod)
            _path_ = _attr.split(".")
            for _p in _path_[:-1]:
                _owner = getattr(_owner, _p)
            def _part(orig, label):
                def f(*a, **k):
                    t0 = pc(); r = orig(*a, **k); t1 = pc()
                    EV.append(("part", t0, t1, label))
                    return r
                return f
            setattr(_owner, _path_[-1], _part(getattr(_owner, _path_[-1]), _path_[-1]))
