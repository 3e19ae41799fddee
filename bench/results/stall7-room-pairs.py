# stall7: bench/stall_steps.py with the room step patched; run from the repository root:
#   PYTHONPATH=. python bench/results/stall7-room-pairs.py --gets 1000 --json
"""In one process, the room step's count and pins by the C call and by the old numpy body,
alternated get by get (bench/stall_steps.py's engine and workload): p50 of that part and of the
whole step, each variant."""
import sys, time, runpy, json
import numpy as np
sys.argv = ["stall_steps.py"] + sys.argv[1:]
from kvtier.coherence import gets as G
from kvtier.coherence.namespace import add_one
T = {}
n = [0]
def old_count(ns, rows, tier):
    cols = ns.table.cols
    r = rows[rows >= 0]
    here = cols["copy_ver"][r, tier] == cols["version"][r]
    want = int(r.size - here.sum())
    if not want:
        return 0, np.empty(0, np.int64)
    keep = cols["slot"][r[here], tier].astype(np.int64)
    add_one(ns.slots[tier].leases, keep)
    return want, keep
def timed(self, namespace, keys, tier):
    n[0] += 1
    which = "c" if n[0] % 2 else "numpy"
    count = G._room_count if which == "c" else old_count
    t0 = time.perf_counter()
    ns = self.namespace(namespace)
    rows = ns.table.lookup(self.check_keys(ns, keys, zero_check=False))
    t1 = time.perf_counter()
    want, keep = count(ns, rows, tier)
    t2 = time.perf_counter()
    if want:
        try:
            self.owner.make_room(ns, tier, want)
        finally:
            self.owner.unpin_slots(ns, tier, keep)
    t3 = time.perf_counter()
    T.setdefault(which + "_count_pins", []).append(t2 - t1)
    T.setdefault(which + "_step", []).append(t3 - t0)
timed.__name__ = "_room_for_get"
G.Gets._room_for_get = timed
runpy.run_path("bench/stall_steps.py", run_name="__main__")
print(json.dumps({k: {"p50_us": round(float(np.median(v[100:])) * 1e6, 1),
                      "p90_us": round(float(np.percentile(v[100:], 90)) * 1e6, 1), "n": len(v) - 100}
                  for k, v in sorted(T.items())}))
