"""rev12: a client's round trip (ping, and a 16-key reserve + abort) against one real
`kvtier serve`, the client's tree alternated (main / head): _reply's read-past check is on
every reply's path. Usage: python s37-rev12-reply-pairs.py MAIN_TREE HEAD_TREE [rounds]."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

CLIENT = r'''
import json, statistics, sys, time
import kvtier
c = kvtier.Client(sys.argv[1])
ns = c.namespace("pairs", block_bytes=4096)
k = b"".join(i.to_bytes(16, "little") for i in range(1, 17))
def med(fn, n=2000):
    for _ in range(200):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return round(statistics.median(ts) * 1e6, 2)
def reserve():
    r = c._call("reserve", ns="pairs", keys=k)
    c._call("abort", rid=r["rid"])
print(json.dumps({"ping_us": med(c.ping), "reserve_abort_us": med(reserve)}))
'''


def main() -> None:
    trees = {"main": sys.argv[1], "head": sys.argv[2]}
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    sys.path.insert(0, trees["head"])
    from tests.service import Service
    svc = Service(Path(tempfile.mkdtemp()) / "svc", host_capacity="64MiB").start()
    try:
        for r in range(rounds):
            order = ("main", "head") if r % 2 == 0 else ("head", "main")
            for name in order:
                out = subprocess.run([sys.executable, "-c", CLIENT, str(svc.socket)],
                                     env={"PYTHONPATH": trees[name], "PATH": "/usr/bin"},
                                     capture_output=True, text=True, check=True).stdout
                print(json.dumps({"round": r, "tree": name, **json.loads(out)}), flush=True)
    finally:
        svc.stop()


if __name__ == "__main__":
    main()
