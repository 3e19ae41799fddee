# stall9: bench/stall_steps.py with the bring-up's and install's C writes alternated get by get;
# run from the repository root:
#   PYTHONPATH=. python bench/results/stall9-steps-pairs.py --gets 1000
"""In one process, an NVMe get's decide and install steps with stall9's C calls
(_gets.c nvme_hits and _fast.pin_slots in Transfers._bring_up_from_nvme, set_copies in
Engine.set_copy, touch_rows in Engine.touch) and with their numpy fallbacks (the code main
ran, less the frames stall9 also removed), alternated get by get on bench/stall_steps.py's
engine and workload: p50 / p90 of each locked step, each variant."""
import json
import os
import runpy
import sys
import time

import numpy as np

sys.argv = ["stall_steps.py"] + sys.argv[1:]
from kvtier.coherence import engine as E, gets as G, transfers as T  # noqa: E402

C = (T._nvme_hits, T._fast, E._set_copies, E._touch_rows)
TIMES: dict = {}
n = [0]
which = ["c"]


def use(c: bool) -> None:
    T._nvme_hits, T._fast, E._set_copies, E._touch_rows = C if c else (None,) * 4


room = G.Gets._room_for_get


def room_first(self, namespace, keys, tier):
    n[0] += 1                       # each get starts with its room step: the variant flips
    which[0] = "c" if n[0] % 2 else "numpy"
    use(which[0] == "c")
    return room(self, namespace, keys, tier)


room_first.__name__ = "_room_for_get"
G.Gets._room_for_get = room_first
for name in ("_get_decide", "_finish_get"):
    orig = getattr(G.Gets, name)

    def timed(self, *a, _o=orig, _n=name):
        t0 = time.perf_counter()
        try:
            return _o(self, *a)
        finally:
            if _n == "_get_decide" or len(a) > 1:     # the outer _finish_get (held given)
                TIMES.setdefault(which[0] + _n, []).append(time.perf_counter() - t0)
    timed.__name__ = name
    setattr(G.Gets, name, timed)
runpy.run_path("bench/stall_steps.py", run_name="__main__")
out = {"loadavg": os.getloadavg()[0]}
for k, v in sorted(TIMES.items()):
    v = np.array(v[100:])           # the warm gets left out
    out[k] = {"p50_us": round(float(np.median(v)) * 1e6, 1),
              "p90_us": round(float(np.percentile(v, 90)) * 1e6, 1), "n": int(v.size)}
print(json.dumps(out))
