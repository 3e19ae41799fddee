# stall8: try_get's refusal of a 64-key NVMe batch (an NVMe reader's get tried on the loop before
# its steps), the C check (_gets.c must_bring) and the numpy one alternated call by call, in
# process on bench/stall_steps.py's engine shape. Run from the repository root:
#   PYTHONPATH=. python bench/results/stall8-refusal-pairs.py
import json, os, shutil, sys, tempfile, time
sys.path.insert(0, os.getcwd())
import numpy as np
from kvtier.coherence.engine import Engine
from kvtier.coherence import gets as G
from kvtier.config import make_settings
base = tempfile.mkdtemp(dir=os.getcwd(), prefix="kvtier-stall-tg-")
bb = 65536
eng = Engine(make_settings({"data_dir": base, "host_capacity": "64MiB",
    "nvme_capacity": str(4096 * bb * 2 + (64 << 20)), "segment_bytes": "64MiB", "write_policy": "write_back"}))


def key(i):
    return (i + 2).to_bytes(16, "big")


eng.create_namespace("s", bb)
data = np.random.default_rng(0).integers(0, 256, (64, bb), dtype=np.uint8)
for lo in range(0, 4096, 64):
    eng.put("s", b"".join(key(i) for i in range(lo, lo + 64)), data)
eng.flush()
rng = np.random.default_rng(1)
C = G._must_bring
T = {"c": [], "numpy": []}
for i in range(3000):
    ks = b"".join(key(int(k)) for k in rng.choice(4096, 64, replace=False))
    w = "c" if i % 2 else "numpy"
    G._must_bring = C if w == "c" else None
    t0 = time.perf_counter(); r = eng.try_get("s", ks, 0); t1 = time.perf_counter()
    if r is not None:
        eng.release(r.lease_id)
        continue
    T[w].append(t1 - t0)
    # the blocks then read: the host tier churns as in the service
    eng.release(eng.get("s", ks).lease_id)
eng.close(flush=False); shutil.rmtree(base, ignore_errors=True)
out = {}
for k, v in T.items():
    v = np.array(v[100:]) * 1e6
    out[k] = {"n": int(v.size), "p50_us": round(float(np.median(v)), 1),
              "p90_us": round(float(np.percentile(v, 90)), 1)}
print(json.dumps(out))
