import os, sys, shutil, tempfile, numpy as np
sys.path.insert(0, os.getcwd())
from kvtier.coherence.engine import Engine
from kvtier.coherence.gets import advance
import kvtier.coherence.gets as G
from kvtier.config import make_settings
from kvtier.types import Tier
def key(i): return (i + 2).to_bytes(16, "big")
cold, batch, bb = 4096, 64, 65536
base = tempfile.mkdtemp(prefix="s10-", dir="/tmp")
eng = Engine(make_settings({"data_dir": base, "host_capacity": "64MiB",
    "nvme_capacity": str(cold * bb * 2 + (64 << 20)), "segment_bytes": "64MiB", "write_policy": "write_back"}))
eng.create_namespace("s", bb)
data = np.random.default_rng(0).integers(0, 256, (64, bb), dtype=np.uint8)
for lo in range(0, cold, 64):
    eng.put("s", b"".join(key(i) for i in range(lo, lo + 64)), data[:64])
eng.flush()
rng = np.random.default_rng(1)
stats = {"fast": 0, "slow": 0, "why": {}}
real = G._read_installable
def ri(version, copy_ver, keyc, n_rows, tier, ok, rows, keys, versions):
    r = real(version, copy_ver, keyc, n_rows, tier, ok, rows, keys, versions)
    stats["fast" if r else "slow"] += 1
    if not r:
        w = []
        if not ok.all(): w.append("ok")
        if (version[rows] != versions).any(): w.append("version")
        if (copy_ver[rows, tier] == version[rows]).any(): w.append("current")
        stats["why"][tuple(w)] = stats["why"].get(tuple(w), 0) + 1
    return r
G._read_installable = ri
K = int(sys.argv[1])
for it in range(150):
    gens = []
    for j in range(K):
        ks = b"".join(key(int(k)) for k in rng.choice(cold, batch, replace=False))
        s = eng.get_steps("s", ks, 0); st, out = advance(s, None, None); gens.append([s, st, out])
    # run all gens to their read, then reads, then installs, interleaved round-robin
    live = True
    while live:
        live = False
        for g in gens:
            s, st, out = g
            if st is None: continue
            live = True
            with eng.lock if st.locked else __import__('contextlib').nullcontext():
                v = st.fn()
            g[1], g[2] = advance(s, v, None)
    for g in gens: eng.release(g[2].lease_id)
print(K, stats)
eng.close(flush=False); shutil.rmtree(base, ignore_errors=True)
