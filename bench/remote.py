"""The remote tier against plain redis-py on the same redis-server, in one run.

    python bench/remote.py --json [--blocks 1024] [--batch 64] [--rounds 5]

For 64 KiB blocks in batches of 64, over TCP on loopback to one redis-server started here:

    remote_get_gbps / remote_put_gbps   kvtier's RemoteStore (a 44-byte header and the bytes;
                                        new blocks go by SET NX), pipelined per batch, gets
                                        checksum-verified
    remote_rewrite_gbps                 rewrites of existing blocks: the version-guarded Lua
                                        script (reported, no target)
    redis_get_gbps / redis_set_gbps     plain redis-py asyncio pipelined GET / SET of the same
                                        bytes under plain keys
    overhead_get / overhead_put         1 - kvtier / redis (target <= 0.10)

Each kind gets its own pass over all batches per round; medians over every batch of every round.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header  # noqa: E402

BB = 64 * 1024


async def run(args: argparse.Namespace, url: str) -> dict:
    from redis import asyncio as aioredis
    from kvtier.tiers.remote import RemoteStore
    n, b = args.blocks, args.batch
    data = np.random.default_rng(0).integers(0, 256, (n, BB), dtype=np.uint8)
    blobs = [data[i].tobytes() for i in range(n)]
    keys = [(i + 1).to_bytes(16, "big") for i in range(n)]
    sums = np.array([xxhash.xxh3_64_intdigest(x) for x in blobs], dtype=np.uint64)
    store = RemoteStore([url], timeout=10)
    await store.connect()
    plain = aioredis.Redis.from_url(url)
    version = [0]

    rnd = [0]

    async def remote_put(lo: int) -> None:
        # New blocks, as a KV cache mostly writes: a fresh namespace per round.
        ok = await store.put_many(f"bench{rnd[0]}", keys[lo:lo + b], np.ones(b, np.uint64),
                                  sums[lo:lo + b], blobs[lo:lo + b])
        if not ok.all():
            raise SystemExit("remote put refused a block")

    async def remote_rewrite(lo: int) -> None:
        version[0] += 1
        v = np.full(b, version[0], dtype=np.uint64)
        ok = await store.put_many("bench", keys[lo:lo + b], v, sums[lo:lo + b], blobs[lo:lo + b])
        if not ok.all():
            raise SystemExit("remote rewrite refused a block")

    async def remote_get(lo: int) -> None:
        found, _, _, got = await store.get_many("bench", keys[lo:lo + b], BB)
        if not found.all() or got[0] != blobs[lo]:
            raise SystemExit("remote get returned wrong bytes")

    async def redis_set(lo: int) -> None:
        # New keys each round too, like remote_put: Redis allocates for new keys.
        pipe = plain.pipeline(transaction=False)
        for i in range(lo, lo + b):
            pipe.set(b"plain%d:" % rnd[0] + keys[i], blobs[i])
        await pipe.execute()

    async def redis_get(lo: int) -> None:
        pipe = plain.pipeline(transaction=False)
        for i in range(lo, lo + b):
            pipe.get(b"plain0:" + keys[i])
        vals = await pipe.execute()
        if vals[0] != blobs[lo]:
            raise SystemExit("redis returned wrong bytes")

    kinds = {"remote_put": remote_put, "remote_rewrite": remote_rewrite, "redis_set": redis_set,
             "remote_get": remote_get, "redis_get": redis_get}
    res: dict[str, list[float]] = {k: [] for k in kinds}
    for lo in range(0, n, b):            # fill both layouts once
        await remote_rewrite(lo)
        await redis_set(lo)
    for r in range(args.rounds):
        rnd[0] = r + 1
        for kind, fn in kinds.items():
            for lo in range(0, n, b):
                t0 = time.perf_counter()
                await fn(lo)
                res[kind].append(time.perf_counter() - t0)
    await store.close()
    await plain.aclose()
    nbytes = b * BB
    out = {f"{k}_gbps": round(nbytes / float(np.median(v)) / 1e9, 3) for k, v in res.items()}
    out["overhead_get"] = round(1 - out["remote_get_gbps"] / out["redis_get_gbps"], 3)
    out["overhead_put"] = round(1 - out["remote_put_gbps"] / out["redis_set_gbps"], 3)
    out.update({"block_bytes": BB, "batch": b, "blocks": n, "rounds": args.rounds})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = header("bench/remote.py")
    from tests.redis_servers import RedisServer
    server = RedisServer(Path(tempfile.mkdtemp(prefix="kvtier-remote-"))).start()
    try:
        out = asyncio.run(run(args, server.url))
    finally:
        server.stop()
    out["machine"] = m
    emit(out, args.json)


if __name__ == "__main__":
    main()
