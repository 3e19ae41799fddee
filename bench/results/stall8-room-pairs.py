# stall8: bench/stall_steps.py with eviction's covered check alternated get by get; run from the
# repository root:
#   PYTHONPATH=. python bench/results/stall8-room-pairs.py --gets 1000 --json
"""In one process, an NVMe get's room step with eviction.evict_copies' one-call covered drop
(_gets.c victims_covered + the one-call evict_slots) and without it (the numpy check and
_drop_victims_native, main's code), alternated get by get on bench/stall_steps.py's engine and
workload: p50 / p90 of make_room and of the whole step, each variant; the other steps too."""
import json
import runpy
import sys
import time

import numpy as np

sys.argv = ["stall_steps.py"] + sys.argv[1:]
from kvtier.coherence import engine as E, eviction as EV, gets as G  # noqa: E402

C = EV._victims_covered
T: dict = {}
n = [0]
which = ["c"]
inside = [False]
room = G.Gets._room_for_get
make_room = E.Engine.make_room


def timed_room(self, namespace, keys, tier):
    n[0] += 1
    which[0] = "c" if n[0] % 2 else "numpy"
    EV._victims_covered = C if which[0] == "c" else None
    inside[0] = True
    t0 = time.perf_counter()
    try:
        return room(self, namespace, keys, tier)
    finally:
        T.setdefault(which[0] + "_step", []).append(time.perf_counter() - t0)
        inside[0] = False


def timed_make_room(self, ns, tier, k):
    if not inside[0]:
        return make_room(self, ns, tier, k)
    t0 = time.perf_counter()
    try:
        return make_room(self, ns, tier, k)
    finally:
        T.setdefault(which[0] + "_make_room", []).append(time.perf_counter() - t0)


timed_room.__name__ = "_room_for_get"
G.Gets._room_for_get = timed_room
E.Engine.make_room = timed_make_room
runpy.run_path("bench/stall_steps.py", run_name="__main__")
# (make_room also runs in the decide, where it evicts nothing: only the room step's is timed; the
# first 200 of each variant are left out, the 100 warm gets and the first of the timed ones.)
out = {}
for k, v in sorted(T.items()):
    v = np.array(v[200:])
    out[k] = {"p50_us": round(float(np.median(v)) * 1e6, 1),
              "p90_us": round(float(np.percentile(v, 90)) * 1e6, 1), "n": int(v.size)}
print(json.dumps(out))
