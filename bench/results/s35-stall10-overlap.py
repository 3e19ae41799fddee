"""How often an NVMe get's install finds a block already installed by another get's read of it
(stall10): K gets of 64 random cold blocks decided together, then read and installed in turn;
read_installable's answers counted, with why it said no (on stall10's tree "fast" also counts the
bring-up steps' re-checks, one a get; "slow" is the installs' alone). Run from a tree's root:
    PYTHONPATH=$PWD python bench/results/s35-stall10-overlap.py 4
"""
import contextlib, importlib, os, shutil, sys
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
slices = importlib.import_module("s35-stall10-slices")     # the same engine and keys
import kvtier.coherence.gets as G
from kvtier.coherence.gets import advance

eng, base = slices.engine()
rng = np.random.default_rng(1)
stats = {"fast": 0, "slow": 0, "why": {}}
real = G._read_installable


def told(version, copy_ver, keyc, n_rows, tier, ok, rows, keys, versions):
    r = real(version, copy_ver, keyc, n_rows, tier, ok, rows, keys, versions)
    stats["fast" if r else "slow"] += 1
    if not r:
        w = tuple(x for x, bad in (("ok", not ok.all()),
                                   ("version", (version[rows] != versions).any()),
                                   ("current", (copy_ver[rows, tier] == version[rows]).any()))
                  if bad)
        stats["why"][w] = stats["why"].get(w, 0) + 1
    return r


G._read_installable = told
K = int(sys.argv[1]) if len(sys.argv) > 1 else 4
for _ in range(150):
    gens = []
    for _ in range(K):
        ks = b"".join(slices.key(int(k)) for k in rng.choice(slices.cold, slices.batch,
                                                               replace=False))
        s = eng.get_steps("s", ks, 0)
        gens.append([s, *advance(s, None, None)])
    live = True
    while live:                         # one step of each get in turn
        live = False
        for g in gens:
            s, st, _ = g
            if st is None:
                continue
            live = True
            with eng.lock if st.locked else contextlib.nullcontext():
                v = st.fn()
            g[1], g[2] = advance(s, v, None)
    for g in gens:
        eng.release(g[2].lease_id)
print(K, stats)
eng.close(flush=False)
shutil.rmtree(base, ignore_errors=True)
