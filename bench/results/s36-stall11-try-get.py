"""try_get's refusal of an NVMe reader's 64-key batch, and a resident 64-key batch's lease and
release, in process (stall11): us per call, the median of 7 runs of 2,000 calls. Run from a
tree's root: PYTHONPATH=$PWD python bench/results/s36-stall11-try-get.py"""
import importlib, json, os, shutil, sys, time
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
slices = importlib.import_module("s35-stall10-slices")

eng, base = slices.engine()
cold = b"".join(slices.key(i) for i in range(0, 64))            # on NVMe only (evicted)
from kvtier.types import Tier
eng.evict(Tier.HOST, 1 << 20)
hot = b"".join(slices.key(i) for i in range(64, 128))
eng.release(eng.get("s", hot).lease_id)                          # now resident
assert eng.try_get("s", cold) is None
res = eng.try_get("s", hot)
assert res is not None and res.found.all(), res
eng.release(res.lease_id)


def refuse():
    for _ in range(2000):
        eng.try_get("s", cold)


def resident():
    for _ in range(2000):
        eng.release(eng.try_get("s", hot).lease_id)


out = {}
for name, fn in (("refuse", refuse), ("resident_lease_release", resident)):
    runs = []
    for _ in range(7):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) / 2000 * 1e6)
    out[name] = round(float(np.median(runs)), 2)
print(json.dumps(out))
eng.close(flush=False)
shutil.rmtree(base, ignore_errors=True)
