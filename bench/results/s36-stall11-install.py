"""An NVMe get's install step when gets overlap (stall11): K gets of 64 random cold blocks
decided together, then each step of each in turn (as s35-stall10-overlap.py), every locked step
timed as a loop slice (fn + the generator's advance, as s35-stall10-slices.py). Prints per step
name p50/p90 us and, for the install step, split by whether it shared a copy. Run from a tree:
    PYTHONPATH=$PWD python bench/results/s36-stall11-install.py 4 150
STALL11_NOGC=1: the cyclic collector off after the setup (its pauses land in whichever slice).
"""
import importlib, json, os, shutil, sys, time
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
slices = importlib.import_module("s35-stall10-slices")     # the same engine and keys
from kvtier.coherence.gets import advance

K = int(sys.argv[1]) if len(sys.argv) > 1 else 4
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 150
eng, base = slices.engine()
rng = np.random.default_rng(1)
T: dict[str, list[float]] = {}


def name_of(fn):
    f = getattr(fn, "func", fn)
    n = f.__name__
    if n == "_finish_get" and len(fn.args) == 3 and fn.args[2] is False:
        n = "install"
    return n


def one_round(timed):
    gens = []
    for _ in range(K):
        ks = b"".join(slices.key(int(k)) for k in rng.choice(slices.cold, slices.batch,
                                                               replace=False))
        s = eng.get_steps("s", ks, 0)
        gens.append([s, *advance(s, None, None)])
    live = True
    while live:
        live = False
        for g in gens:
            s, st, _ = g
            if st is None:
                continue
            live = True
            if st.locked:
                name = name_of(st.fn)
                t0 = time.perf_counter()
                with eng.lock:
                    v = st.fn()
                g[1], g[2] = advance(s, v, None)
                if timed:
                    T.setdefault(name, []).append(time.perf_counter() - t0)
            else:
                v = st.fn()
                g[1], g[2] = advance(s, v, None)
    for g in gens:
        eng.release(g[2].lease_id)


if os.environ.get("STALL11_NOGC"):       # the collector's pauses out of the slices
    import gc
    gc.collect()
    gc.disable()
for _ in range(20):
    one_round(False)
for _ in range(ROUNDS):
    one_round(True)
out = {k: [round(float(np.percentile(v, q)) * 1e6, 1) for q in (50, 90)] + [len(v)]
       for k, v in sorted(T.items())}
print(json.dumps({"K": K, "slices_p50_p90_n": out}))
eng.close(flush=False)
shutil.rmtree(base, ignore_errors=True)
