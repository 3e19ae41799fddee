"""The worker API end to end: a real `kvtier serve` and a real redis-server, both started here.

    python bench/api.py --json [--blocks 1024] [--rounds 5]

For 64 KiB blocks in batches of 64, from a client process over the Unix socket:

    get_gbps / put_gbps        kvtier.Client with the mapped (zero-copy) path and its defaults
                               (puts send checksums, gets do not re-hash: kvtier.api.client);
                               get_verify_gbps re-hashes every copy, put_noverify_gbps sends none
    inline_get_gbps            the inline fallback (bytes inside frames)
    redis_get_gbps             redis-py pipelined GETs of the same blocks from redis-server on a
                               Unix socket, persistence off (its best case)
    memcpy_gbps                numpy copy of the same batch into a preallocated array: the ceiling
    p50_us / p99_us            single-block get latency (mapped, verified, lease released)
    busy_poll_us               the service's busy-polling window (its default, or
                               KVTIER_BUSY_POLL_US from the environment; 0 turns it off)

The service's control path of a GPU offload (issue 16: the CUDA put's reserve and commit
requests, kvtier.gpu.transfer.put_async), without a GPU: one batch of 4,096 keys of 16 KiB
reserved and committed with trusted checksums (the GPU's), over the socket, timed at the
client, median over --control-rounds:

    api_reserve_us_per_key_4096  reserve of the same 4,096 keys again (each a rewrite: fresh
    api_commit_us_per_key_4096   slots, then the old copies freed at commit; no eviction), as
                                 bench/gpu.py's offload rewrites its batch; the host tier runs
                                 lru, as it does under an HBM tier (the GPU host's case)
    api_reserve_us_per_key_4096_new / api_commit_us_per_key_4096_new
                                 4,096 new keys into a full host tier (reserve evicts 4,096)
    ..._chain                    the same with the host tier's default policy, chain
    hello_rtt_p50_us (above)     the round trip every one of these requests also pays

bench/engine.py reports the engine's own share of the same requests (reserve_us_per_key_4096,
commit_us_per_key_4096, ...), without the socket.

    python bench/api.py --control-only --json     (only these, no redis-server)

Each figure is the median over rounds, whose kinds run in a shuffled order (seeded); ratios use
medians from this same run. paired_ratio_* take the ratio within each round first (one pass of
each kind per round), then the median over rounds, as bench/nvme.py does.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header, percentiles  # noqa: E402

BB = 64 * 1024


def keyset(lo: int, n: int) -> bytes:
    return b"".join((i + 1).to_bytes(16, "big") for i in range(lo, lo + n))


def start_redis(tmp: str) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(tmp, "redis.sock")
    proc = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", sock,
                             "--save", "", "--appendonly", "no", "--maxmemory", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        if os.path.exists(sock):
            return proc, sock
        time.sleep(0.025)
    proc.kill()
    raise SystemExit("redis-server did not start")


def gbps(samples: list[float], nbytes: int) -> float:
    return round(nbytes / float(np.median(samples)) / 1e9, 3)


def paired(slow: list[float], fast: list[float]) -> float:
    """Median over rounds of fast's speed over slow's (time of slow / time of fast)."""
    return round(float(np.median([a / b for a, b in zip(slow, fast)])), 3)


def run(args: argparse.Namespace) -> dict:
    sys.path.insert(0, ROOT)
    from tests.service import Service
    import kvtier
    import redis

    tmp = tempfile.mkdtemp(prefix="kvtier-api-")
    n, b = args.blocks, args.batch
    data = np.random.default_rng(0).integers(0, 256, (n, BB), dtype=np.uint8)
    svc = Service(os.path.join(tmp, "svc"), admin=False, host_capacity=f"{2 * n * BB}",
                  nvme_capacity="0", write_policy="write_back").start()
    rproc, rsock = start_redis(tmp)
    out: dict = {}
    try:
        c = kvtier.Client(svc.socket)
        ns = c.namespace("bench", block_bytes=BB)
        inline = c.namespace("bench", inline=True)
        r = redis.Redis(unix_socket_path=rsock)
        dst = np.empty((b, BB), dtype=np.uint8)
        batches = list(range(0, n, b))
        for lo in batches:                     # fill (and fault in) the shared pages once
            ns.put(keyset(lo, b), data[lo:lo + b])
        pipe = r.pipeline(transaction=False)
        for i in range(n):
            pipe.set(keyset(i, 1), data[i].tobytes())
        pipe.execute()

        res = {k: [] for k in ("put", "put_noverify", "get", "get_verify", "inline_get",
                               "redis_get", "redis_set", "memcpy")}
        def redis_get(lo: int) -> None:
            p = r.pipeline(transaction=False)
            for i in range(lo, lo + b):
                p.get(keyset(i, 1))
            vals = p.execute()
            if len(vals) != b or vals[0] != data[lo].tobytes():
                raise SystemExit("redis returned wrong bytes")

        def redis_set(lo: int) -> None:
            p = r.pipeline(transaction=False)
            for i in range(lo, lo + b):
                p.set(keyset(i, 1), data[i].tobytes())
            p.execute()

        kinds = {
            "put": lambda lo: ns.put(keyset(lo, b), data[lo:lo + b]),
            "put_noverify": lambda lo: ns.put(keyset(lo, b), data[lo:lo + b], verify=False),
            "get": lambda lo: ns.get(keyset(lo, b), out=dst),
            "get_verify": lambda lo: ns.get(keyset(lo, b), out=dst, verify=True),
            "inline_get": lambda lo: inline.get(keyset(lo, b), out=dst),
            "redis_get": redis_get, "redis_set": redis_set,
            "memcpy": lambda lo: np.copyto(dst, data[lo:lo + b]),
        }
        # One pass over every batch per kind, so that no kind warms the caches for another.
        # The kinds run in a new order each round: the pass right after a put pass (whose
        # rewrites move every key to fresh slots) ran ~20% slower whichever kind it was.
        order = random.Random(1)
        names = list(kinds)
        per_round: dict[str, list[float]] = {k: [] for k in kinds}
        for _round in range(args.rounds):
            order.shuffle(names)
            for kind in names:
                fn = kinds[kind]
                times = []
                for lo in batches:
                    t0 = time.perf_counter()
                    fn(lo)
                    times.append(time.perf_counter() - t0)
                res[kind] += times
                per_round[kind].append(float(np.median(times)))
        found, got = ns.get(keyset(0, b))
        if not found.all() or not (got == data[:b]).all():
            raise SystemExit("kvtier returned wrong bytes")
        nbytes = b * BB
        for k, v in res.items():
            out[f"{k}_gbps"] = gbps(v, nbytes)
        single = []
        one = np.empty((1, BB), dtype=np.uint8)
        for i in range(args.single):
            kb = keyset(i % n, 1)
            t0 = time.perf_counter()
            ns.get(kb, out=one)
            single.append(time.perf_counter() - t0)
        lat = percentiles([s * 1e6 for s in single])
        pings = percentiles([c.ping() * 1e6 for _ in range(500)])
        busy = c.stats()["busy_poll"]         # the service's setting (KVTIER_BUSY_POLL_US)
        out.update({
            "p50_us": round(lat["p50"], 1), "p90_us": round(lat["p90"], 1),
            "p99_us": round(lat["p99"], 1), "max_us": round(lat["max"], 1),
            "hello_rtt_p50_us": round(pings["p50"], 1),
            "busy_poll_us": busy["window_us"], "busy_poll_spun_s": busy["spun_s"],
            "ratio_get_vs_redis": round(out["get_gbps"] / out["redis_get_gbps"], 2),
            "ratio_get_vs_memcpy": round(out["get_gbps"] / out["memcpy_gbps"], 3),
            "ratio_put_vs_redis_set": round(out["put_gbps"] / out["redis_set_gbps"], 2),
            # The same ratios round by round (each kind's pass in that round), then the median:
            # robust to the host's load drifting between rounds, which moves both sides.
            "paired_ratio_get_vs_memcpy": paired(per_round["memcpy"], per_round["get"]),
            "paired_ratio_get_vs_redis": paired(per_round["redis_get"], per_round["get"]),
            "rounds_ratio_get_vs_memcpy": [round(m / g, 3) for m, g in
                                           zip(per_round["memcpy"], per_round["get"])],
            "block_bytes": BB, "batch": b, "blocks": n, "rounds": args.rounds,
        })
        c.close()
    finally:
        rproc.kill()
        rproc.wait()
        svc.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def control_path(rounds: int, policy: str) -> dict:
    """Reserve and commit of 4,096-key batches through a real `kvtier serve` (see the module
    docstring): the service's share of a GPU offload, per key, medians over rounds. policy:
    the host tier's (on a GPU host, under an HBM tier, that is lru)."""
    sys.path.insert(0, ROOT)
    from tests.service import Service
    import kvtier

    n, bb = 4096, 16 << 10
    tmp = tempfile.mkdtemp(prefix="kvtier-ctl-")
    # Room for four batches: the rewrites (one batch) never evict; the new batches fill the
    # tier, then each evicts as many blocks as it brings.
    svc = Service(os.path.join(tmp, "svc"), admin=False, host_capacity=f"{4 * n * bb}",
                  nvme_capacity="0", eviction=policy).start()
    sums = np.random.default_rng(3).integers(0, 1 << 63, n, dtype=np.uint64).astype("<u8")
    times: dict[str, list[float]] = {}
    try:
        c = kvtier.Client(svc.socket)
        c.namespace("ctl", block_bytes=bb)

        def once(kb: bytes, tag: str) -> None:
            t0 = time.perf_counter()
            r = c._call("reserve", ns="ctl", keys=kb, tier="host")
            t1 = time.perf_counter()
            v = c._call("commit", rid=r["rid"], checksums=sums.tobytes(), trusted=True)
            t2 = time.perf_counter()
            if len(np.frombuffer(v["versions"], "<u8")) != n:
                raise SystemExit("commit returned the wrong number of versions")
            times.setdefault(f"reserve{tag}", []).append((t1 - t0) * 1e6 / n)
            times.setdefault(f"commit{tag}", []).append((t2 - t1) * 1e6 / n)

        same = keyset(0, n)
        for i in range(rounds + 2):
            once(same, "" if i >= 2 else "_warm")
        fresh = n
        for i in range(rounds + 4):
            once(keyset(fresh, n), "_new" if i >= 4 else "_warm")
            fresh += n
        c.close()
    finally:
        svc.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    sfx = "" if policy == "lru" else f"_{policy}"
    out = {f"api_{k.split('_')[0]}_us_per_key_4096{'_new' if k.endswith('_new') else ''}{sfx}":
           round(float(np.median(v)), 3) for k, v in times.items() if not k.endswith("_warm")}
    out["control_rounds"] = rounds
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--single", type=int, default=3000)
    ap.add_argument("--control-rounds", type=int, default=30)
    ap.add_argument("--control-only", action="store_true",
                    help="only the 4,096-key reserve and commit (no redis-server)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = header("bench/api.py")
    result = {} if args.control_only else run(args)
    for policy in ("lru", "chain"):
        result.update(control_path(args.control_rounds, policy))
    result["machine"] = m
    emit(result, args.json)


if __name__ == "__main__":
    main()
