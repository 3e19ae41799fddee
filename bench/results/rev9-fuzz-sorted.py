"""rev9: sorted gets' fields as structured garbage at a real `kvtier serve`, counting replies
that are internal errors (a bug of ours) and the leases left held at the end.

    .venv/bin/python bench/results/rev9-fuzz-sorted.py SEED

20,000 get requests a seed: first requests with keys and pieces' ends (some wrong), later
pieces naming recent heads or garbage, and tier / inline / device / release_first / keys /
sort swapped for garbage in 5% each. Results: bench/results/rev9-fuzz-sorted.txt.
"""
import random
import sys
import numpy as np
sys.path.insert(0, ".")
import kvtier
from kvtier.errors import KvtierError
from tests.service import Service
from tests.conftest import keys, blocks
from pathlib import Path
import tempfile
tmp = Path(tempfile.mkdtemp())
svc = Service(tmp / "svc", host_capacity="8MiB", nvme_capacity="64MiB", segment_bytes="4MiB").start()
r = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
vals = [None, 0, 1, -1, 2, 1 << 40, 1 << 63, 1.5, float("nan"), "x", b"", b"\x00" * 4, b"\x01\x02\x03",
        [1, 2], {"a": 1}, True, False]
internal = {}
try:
    with kvtier.Client(str(svc.socket)) as c:
        ns = c.namespace("s", block_bytes=4096)
        ns.put(keys(range(64)), blocks(64, 4096))
        heads = []
        for i in range(20000):
            d = {"ns": r.choice(["s", "s", "s", "nope", 5])}
            kind = r.random()
            if kind < 0.5:
                n = r.choice([0, 1, 8, 64])
                d["keys"] = keys(r.sample(range(200), n)) if r.random() < 0.9 else r.choice(vals)
                m = r.choice([1, 2, 3, 5])
                ends = sorted(r.sample(range(1, max(n, 1) + 1), min(m, max(n, 1))))
                if ends and r.random() < 0.8:
                    ends[-1] = n
                d["sort"] = (np.array(ends, "<u4").tobytes() if r.random() < 0.85
                             else r.choice(vals))
            else:
                d["of"] = r.choice(heads[-5:] + [r.choice(vals)]) if heads and r.random() < 0.8 else r.choice(vals)
                d["piece"] = r.choice([1, 2, 3, 4] + vals)
            for f in ("tier", "inline", "device", "release_first", "keys", "sort"):
                if r.random() < 0.05:
                    d[f] = r.choice(vals + ["host", "hbm"])
            rid = c._send("get", {k: v for k, v in d.items() if v is not None} | ({"ns": d["ns"]}))
            try:
                rep = c._reply(rid)
                if "lease" in rep and rep.get("lease") is not None:
                    c._call("release", lease=rep["lease"])
                if "sort" in d:
                    heads.append(rid)
            except KvtierError as exc:
                s = str(exc)
                if "internal" in s:
                    internal.setdefault(s[:200], (d, 0))
        st = c._call("stats")
        print("leases held", st["leases"])
finally:
    svc.stop()
for k, (d, _) in internal.items():
    print(k, {a: (b if not isinstance(b, bytes) else b[:20]) for a, b in d.items()})
print("internal errors:", len(internal))
