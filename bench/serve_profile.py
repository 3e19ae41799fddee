"""Where the service's time goes for single-block host gets: `kvtier serve` under cProfile.

    python bench/serve_profile.py [--gets 3000] [--top 25]

Starts `python -m cProfile -m kvtier.cli serve` (host tier only), times --gets single-block
host gets of 64 KiB and as many pings (hello) from one client, stops the service with SIGTERM
(cProfile then writes its profile) and prints the p50s and the service's functions by own time.
The profile counts the loop thread only: what a single get costs the service inline (its fast
path). Figures under cProfile are inflated; compare them within one run.
"""

from __future__ import annotations

import argparse
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gets", type=int, default=3000)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    import kvtier
    work = tempfile.mkdtemp(prefix="kvtier-prof-")
    prof, log = os.path.join(work, "serve.prof"), os.path.join(work, "serve.log")
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "cProfile", "-o", prof, "-m",
                                 "kvtier.cli", "serve", "--data-dir", os.path.join(work, "d"),
                                 "--admin", "", "--host-capacity", "256MiB",
                                 "--nvme-capacity", "0"], stdout=fh, stderr=subprocess.STDOUT,
                                cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while "kvtier: socket" not in open(log).read():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"kvtier serve did not start:\n{open(log).read()}")
            time.sleep(0.05)
        with kvtier.Client(os.path.join(work, "d", "run", "kvtier.sock")) as c:
            ns = c.namespace("p", block_bytes=65536)
            keys = [(i + 1).to_bytes(16, "big") for i in range(64)]
            ns.put(b"".join(keys), np.random.default_rng(0).integers(
                0, 255, (64, 65536), dtype=np.uint8))
            host = np.empty((1, 65536), np.uint8)
            tg, tp = [], []
            for i in range(args.gets):
                t0 = time.perf_counter()
                ns.get(keys[i % 64], out=host)
                tg.append(time.perf_counter() - t0)
            for _ in range(args.gets):
                t0 = time.perf_counter()
                c.ping()
                tp.append(time.perf_counter() - t0)
        print(f"# under cProfile: host get p50 {np.median(tg) * 1e6:.1f} us, ping p50 "
              f"{np.median(tp) * 1e6:.1f} us ({args.gets} each)")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
