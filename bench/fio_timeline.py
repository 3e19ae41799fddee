"""Per-thread timelines of `kvtier bench`'s randrw loop in process (issue 17): for each call,
its wall and CPU time (user / system), and the seconds every thread spent waiting for and
holding the engine lock and the flush writer, in AIO batches, taking an AIO context and in
fdatasync; and how long 1 or 2 threads had disk I/O in flight at once. Diagnostic: it wraps
the engine's lock and the store's writer, so its own figures cost a little more than the bench.

    PYTHONPATH=. python bench/fio_timeline.py THREADS SECONDS RWMIXREAD [zipf]
    IOD=8 ... (blocks per call, default 16)   SWI=0.0005 ... (sys.setswitchinterval)
    PROF=1 ... (cProfile of thread 0)   PROF=2 ... (a cProfile per call kind of thread 0,
    its time summed by module: where a get's and a put's CPU goes; with PROFOUT=DIR, the
    stats files)   ATTR=1 ... (no profiler: each named step's thread CPU, inclusive, in ms per
    get or put of the loop: Engine.get, NvmeStore.run_read, Flushes._pick, AioSet.run, ...)

Writes the events to /tmp/fio2/ev-THREADS-MIX.json and prints a JSON summary.
"""
import collections, json, os, sys, tempfile, threading, time, types
import numpy as np
import kvtier.coherence.engine as E
import kvtier.tiers.aio as A
import kvtier.tiers.backend as B
from kvtier import fio

EV = collections.defaultdict(list)   # thread name -> [(kind, t0, t1)]
def rec(kind, t0, t1):
    EV[threading.current_thread().name].append((kind, t0, t1))

class TRLock:
    def __init__(self, name):
        self._l = threading.RLock(); self._tl = threading.local(); self.name = name
    def acquire(self, blocking=True, timeout=-1):
        d = getattr(self._tl, "d", 0)
        if d == 0:
            t0 = time.perf_counter()
            ok = self._l.acquire(blocking, timeout)
            if not ok: return False
            t1 = time.perf_counter(); rec(self.name + "_wait", t0, t1); self._tl.h = t1
        else:
            ok = self._l.acquire(blocking, timeout)
            if not ok: return False
        self._tl.d = d + 1
        return True
    def release(self):
        self._tl.d -= 1
        if self._tl.d == 0:
            rec(self.name + "_hold", self._tl.h, time.perf_counter())
        self._l.release()
    __enter__ = acquire
    def __exit__(self, *a): self.release()
    def locked(self):
        if self._l.acquire(False):
            self._l.release(); return False
        return True
    def _is_owned(self): return self._l._is_owned()

shim = types.SimpleNamespace(**{k: getattr(threading, k) for k in dir(threading) if not k.startswith("__")})
shim.RLock = lambda: TRLock("elock")
E.threading = shim

def wrap(cls, meth, kind):
    orig = getattr(cls, meth)
    def f(*a, **k):
        t0 = time.perf_counter()
        try: return orig(*a, **k)
        finally: rec(kind, t0, time.perf_counter())
    setattr(cls, meth, f)
wrap(A.AioSet, "run", "aio_write")
wrap(A.AioSet, "run_flat", "aio_read")
wrap(B.PosixBackend, "sync", "fdatasync")
wrap(A.AioSet, "_take", "aio_take")

# ATTR=1: inclusive thread CPU of named steps (what a call's CPU is made of, no profiler)
ATTR, ATTR_N = collections.Counter(), collections.Counter()
def attr(obj, meth, label):
    orig = getattr(obj, meth)
    def f(*a, **k):
        c0 = time.thread_time()
        try: return orig(*a, **k)
        finally: ATTR[label] += time.thread_time() - c0; ATTR_N[label] += 1
    setattr(obj, meth, f)
if os.environ.get("ATTR"):
    import kvtier.coherence.persist as P, kvtier.tiers.nvme as N, kvtier.tiers.host as H
    try:
        import kvtier.coherence.flushes as FL; FLC = FL.Flushes
    except ImportError:
        FLC = P.NvmeStore                      # main before the split: the same methods
    try:
        import kvtier.coherence.puts as PU; PUT = PU.Puts
    except ImportError:
        PUT = E.Engine                         # main before the split: the same methods
    for obj, meth in [(PUT, "reserve"), (PUT, "commit"), (H.SlotPool, "read"),
                      (H.SlotPool, "write"), (P.NvmeStore, "plan_read"), (P.NvmeStore, "run_read"),
                      (P.NvmeStore, "finish_read"), (N.SegmentLog, "read_rows"),
                      (A.AioSet, "run_flat"), (A.AioSet, "run"), (N.SegmentLog, "write"),
                      (N.SegmentLog, "sync"), (P.NvmeStore, "flush")]:
        attr(obj, meth, f"{obj.__name__}.{meth}")
    for meth in ("_pick", "_apply_flush", "_outcomes", "_write_group", "_finish_group"):
        attr(FLC, meth, f"Flushes.{meth}")

WORK = os.environ.get("WORK", tempfile.gettempdir())
nthreads, secs, mix = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
sys.setswitchinterval(float(os.environ.get("SWI", "0.005")))
zipf = len(sys.argv) > 4
job = fio.Job(name="t", rw="randrw", bs=65536, iodepth=int(os.environ.get("IOD", "16")), numjobs=nthreads, size=256 << 20,
              runtime=secs, direct=True, rwmixread=mix, tier="nvme", zipf=1.1 if zipf else None,
              directory=WORK)
job.validate()
import shutil
wd = tempfile.mkdtemp(dir=WORK)
tg = fio._Target(job, wd)
# the writer (group commit) lock
class TLock:
    def __init__(s, l, name): s._l, s.name = l, name
    def __enter__(s):
        t0 = time.perf_counter(); s._l.acquire(); s.h = time.perf_counter(); rec(s.name + "_wait", t0, s.h)
    def __exit__(s, *a):
        rec(s.name + "_hold", s.h, time.perf_counter()); s._l.release()
    def locked(s): return s._l.locked()
tg.engine.nvme.writer = TLock(tg.engine.nvme.writer, "writer")
if os.environ.get("ATTR"):
    for meth in ("get", "release", "evict"):     # bound in Engine.__init__: the instance's
        attr(tg.engine, meth, f"Engine.{meth}")
    attr(tg, "get", "_Target.get"); attr(tg, "put", "_Target.put")
tg.fill()
EV.clear(); ATTR.clear(); ATTR_N.clear()
calls = collections.defaultdict(list)
start = time.perf_counter(); stop = start + secs
import cProfile, pstats
PROF = cProfile.Profile() if os.environ.get('PROF') == '1' else None
KPROF = ({"get": cProfile.Profile(), "put": cProfile.Profile()} if os.environ.get('PROF') == '2'
         else None)
SYS = {True: [], False: []}; USR = {True: [], False: []}
def worker(j):
    if PROF and j == 0: PROF.enable()
    rng = np.random.default_rng(100 + j)
    out = np.empty((job.iodepth, 65536), dtype=np.uint8)
    order = fio._order(job, tg.nblocks, rng, 1 << 16); pos = 0
    while time.perf_counter() < stop:
        idx = order[(pos + np.arange(job.iodepth)) % order.size]; pos += job.iodepth
        w = rng.random() * 100 >= mix
        import resource; r0 = resource.getrusage(resource.RUSAGE_THREAD)
        c0 = time.thread_time(); t0 = time.perf_counter()
        kp = KPROF["put" if w else "get"] if KPROF and j == 0 else None
        if kp: kp.enable()
        (tg.put(idx, owner=j + 1) if w else tg.get(idx, owner=j + 1, out=out))
        if kp: kp.disable()
        t1 = time.perf_counter(); c1 = time.thread_time(); r1 = resource.getrusage(resource.RUSAGE_THREAD)
        SYS[w].append(r1.ru_stime - r0.ru_stime); USR[w].append(r1.ru_utime - r0.ru_utime)
        rec("put" if w else "get", t0, t1)
        calls[j].append(("put" if w else "get", t1 - t0, c1 - c0))
    if PROF and j == 0: PROF.disable()
ths = [threading.Thread(target=worker, args=(j,), name=f"w{j}") for j in range(nthreads)]
[t.start() for t in ths]; [t.join() for t in ths]
el = time.perf_counter() - start
tg.close(); shutil.rmtree(wd, ignore_errors=True)
res = {"threads": nthreads, "mix": mix, "zipf": zipf, "elapsed": el}
allc = [c for j in calls for c in calls[j]]
for op in ("get", "put"):
    cs = [c for c in allc if c[0] == op]
    if cs:
        res[op] = {"n": len(cs), "MiBps": len(cs) * job.iodepth * 64 / 1024 / el,
                   "wall_ms": 1e3 * np.median([c[1] for c in cs]), "cpu_ms": 1e3 * np.median([c[2] for c in cs])}
# per-thread time in each kind, per call kind
tot = collections.Counter()
for th, evs in EV.items():
    for k, a, b in evs: tot[k] += b - a
res["seconds_in"] = {k: round(v, 3) for k, v in sorted(tot.items())}
# overlap: time when >=2 threads are in a disk op (aio_*, fdatasync)
def busy(kinds):
    iv = sorted((a, b) for th, evs in EV.items() for k, a, b in evs if k in kinds)
    pts = sorted([(a, 1) for a, b in iv] + [(b, -1) for a, b in iv])
    cur = 0; last = None; acc = collections.Counter()
    for t, d in pts:
        if last is not None: acc[cur] += t - last
        cur += d; last = t
    return {k: round(v, 3) for k, v in sorted(acc.items()) if k}
res["disk_concurrency_s"] = busy({"aio_read", "aio_write", "fdatasync"})
res["call_concurrency_s"] = busy({"get", "put"})
json.dump(dict(EV), open(os.path.join(WORK, f"ev-{nthreads}-{mix}.json"), "w"))
res['sys_usr_ms'] = {('put' if k else 'get'): (1e3*np.mean(SYS[k]), 1e3*np.mean(USR[k])) for k in SYS}
print(json.dumps(res, indent=1))
if ATTR:
    GET = ("_Target.get", "Engine.get", "Engine.release", "Engine.evict", "SlotPool.read",
           "NvmeStore.plan_read", "NvmeStore.run_read", "NvmeStore.finish_read",
           "SegmentLog.read_rows", "AioSet.run_flat")
    per = {k: round(1e3 * v / max(1, ATTR_N["_Target.get" if k in GET else "_Target.put"]), 3)
           for k, v in ATTR.items()}
    print("cpu_ms_per_call:", json.dumps(dict(sorted(per.items(), key=lambda kv: -kv[1])), indent=1))
def by_module(prof, ncalls):
    """tottime per call of the loop (ms), summed by source file (C builtins by their name)."""
    st = pstats.Stats(prof).stats
    acc = collections.Counter()
    for (fn, line, name), (cc, nc, tt, ct, callers) in st.items():
        key = os.path.relpath(fn) if fn != "~" else name
        acc[key] += tt
    return {k: round(1e3 * v / max(1, ncalls), 3) for k, v in acc.most_common(25)}
if KPROF:
    prof_out = os.environ.get("PROFOUT")
    for kind, prof in KPROF.items():
        n = sum(1 for c in calls[0] if c[0] == kind)
        print(kind, "ms per call by module:", json.dumps(by_module(prof, n), indent=1))
        if prof_out:
            prof.dump_stats(os.path.join(prof_out, f"prof-{kind}.pstats"))
if PROF: pstats.Stats(PROF).sort_stats('tottime').print_stats(30); pstats.Stats(PROF).sort_stats('cumtime').print_stats(45)
