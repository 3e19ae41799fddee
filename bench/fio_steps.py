"""Calls and wall seconds of a `kvtier bench` job's steps, by thread (issue 17, fio4): the
lane's gets and puts (put_begin where the tree has it), and where the flushes ran — in the
lane (a get's eviction draining write-downs), on the store's flush thread ("kvtier-flush"),
or in the main thread (the untimed fill) — with their writes, fdatasyncs and reads.

    PYTHONPATH=TREE python bench/fio_steps.py JOBFILE [DIR]

Wraps the methods with a perf_counter pair each (~1 us a call). Prints one line per (thread,
step): calls, seconds, ms a call; the job's MiB/s first.
"""
import collections, sys, threading, time, json
import kvtier.coherence.flushes as F, kvtier.coherence.persist as P, kvtier.tiers.nvme as N
from kvtier import fio
T = collections.defaultdict(lambda: [0, 0.0])
def wrap(cls, m, label):
    orig = getattr(cls, m)
    def f(*a, **k):
        t0 = time.perf_counter()
        try: return orig(*a, **k)
        finally:
            x = T[(threading.current_thread().name[:6], label)]; x[0] += 1; x[1] += time.perf_counter() - t0
    setattr(cls, m, f)
wrap(F.Flushes, "flush", "flush"); wrap(P.NvmeStore, "drain", "drain"); wrap(N.SegmentLog, "sync", "sync")
wrap(N.SegmentLog, "write", "write"); wrap(P.NvmeStore, "run_read", "run_read")
wrap(fio._Target, "get", "Target.get"); wrap(fio._Target, "put", "Target.put")
if hasattr(fio._Target, "put_begin"): wrap(fio._Target, "put_begin", "Target.put_begin")
job = fio.parse_jobfile(open(sys.argv[1]).read())[0]
job = fio.replace(job, directory=sys.argv[2] if len(sys.argv) > 2 else "/tmp")
r = fio.run_job(job)
print(json.dumps({"job": job.name, "read_mib": round(r["read"]["bw_bytes"] / 2**20, 1),
                  "write_mib": round(r["write"]["bw_bytes"] / 2**20, 1)}))
for k, v in sorted(T.items()):
    print(json.dumps({"thread": k[0], "step": k[1], "calls": v[0], "s": round(v[1], 3),
                      "ms_per_call": round(1e3 * v[1] / max(1, v[0]), 2)}))
