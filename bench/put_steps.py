"""A GPU put's service steps in process (issue 16's offload rows; off7): Server._dispatch of
packed reserve and trusted commit requests, as kvtier.gpu.transfer.put_async sends them for
bench/gpu.py's rows (4,096 rewrites of existing keys in a random key order, in
pipeline.cuda_put_chunks), each reply packed; a real engine (no NVMe, as bench/gpu.py's
service). Also the same put as one request each way, and the fixed cost of a reserve and a
commit of 8 keys. Medians of --puts, us or ms per put.

    python bench/put_steps.py [--block 16384] [--puts 300] [--json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header  # noqa: E402


def run(block: int, n: int, puts: int) -> dict:
    from kvtier.api import pipeline
    from kvtier.api import protocol as P
    from kvtier.api.quota import ClientInfo
    from kvtier.api.server import Server
    from kvtier.coherence.engine import Engine
    from kvtier.config import make_settings
    eng = Engine(make_settings({"data_dir": tempfile.mkdtemp(prefix="kvtier-putsteps-"),
                                "host_capacity": "6GiB", "nvme_capacity": "0"}))
    eng.create_namespace("rows", block)
    karr = np.zeros((n, 16), np.uint8)
    karr[:, 8:] = np.arange(1, n + 1, dtype=">u8").view(np.uint8).reshape(n, 8)
    eng.put("rows", karr.tobytes(), np.random.default_rng(0).integers(0, 255, (n, block),
                                                                      dtype=np.uint8))
    srv, cl = Server(eng, eng.settings), ClientInfo(1, 0, 0)
    rng = np.random.default_rng(1)
    sums = rng.integers(1, 2 ** 63, n, dtype=np.uint64)
    pc = time.perf_counter

    def step(req: dict) -> tuple[float, dict]:
        """One request through Server._dispatch and its reply's pack: (seconds, reply)."""
        body = P.pack(req)[4:]
        t0 = pc()
        r = srv._dispatch(cl, body)
        P.pack(r[0])
        dt = pc() - t0
        if not r[0].get("ok"):
            raise RuntimeError(f"{req['op']} failed: {r[0]}")
        return dt, r[0]

    def put(chunks: list) -> tuple[float, float]:
        kb = karr[rng.permutation(n)].tobytes()
        tr = tc = 0.0
        rids = []
        for lo, hi in chunks:
            dt, r = step({"op": "reserve", "id": 1, "ns": "rows", "keys": kb[lo * 16:hi * 16],
                          "tier": "host"})
            tr += dt
            rids.append(r["rid"])
        for (lo, hi), rid in zip(chunks, rids):
            tc += step({"op": "commit", "id": 2, "rid": rid, "trusted": True,
                        "checksums": sums[lo:hi].tobytes()})[0]
        return tr, tc
    cuts = {"chunks": pipeline.cuda_put_chunks(n, block), "one": [(0, n)], "fixed_8": [(0, 8)]}
    times: dict = {k: [] for k in cuts}
    for i in range(puts + 20):
        for name, ch in cuts.items():
            t = put(ch)
            if i >= 20:
                times[name].append(t)
    out: dict = {"block": block, "n": n, "puts": puts,
                 "chunks": [hi - lo for lo, hi in cuts["chunks"]]}
    for name, v in times.items():
        r, c = np.median(np.array(v), 0)
        unit, scale = ("us", 1e6) if name.startswith("fixed") else ("ms", 1e3)
        out[f"{name}_reserve_{unit}"] = round(float(r) * scale, 3)
        out[f"{name}_commit_{unit}"] = round(float(c) * scale, 3)
    eng.close(flush=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block", type=int, default=16384)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--puts", type=int, default=300)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = header("bench/put_steps.py")
    res = run(args.block, args.n, args.puts)
    res["loadavg"] = os.getloadavg()[0]
    res["machine"] = m
    emit(res, args.json)


if __name__ == "__main__":
    main()
