"""The shared remote tier on Redis or Valkey, through redis-py's asyncio client.

Layout. A block is one Redis string ``kvtier:{namespace}:{key hex}``: a 64-byte header
(``KVT2``, then the version, the xxh3-64 checksum of the bytes and a binding, 20 decimal
digits each) and the bytes. The binding is xxh3-64 of namespace, key, version and checksum
(``binding()``): the checksum covers the bytes only, so a value renamed or copied under
another key (or a flipped bit in the key) would otherwise be served as that key's block
(issue 20). ``KVT1`` values (a 44-byte header without the binding, written before) are still
read, unchecked for the key, and are replaced by the next put. One
string rather than a hash because plain GET and SET are what Redis moves fastest (bench/remote.py
measured a hash layout at 0.60 of plain GET and 0.29 of plain SET). Writes go through a Lua
script that reads only the header (GETRANGE) and sets the value only when the stored version is
older, so two hosts racing on a key end with the higher version, and a value that is not ours
(another type, or a string without our header) is never overwritten. Reads check the version, the size and the checksum; anything else is a miss and a
counter, never a wrong block. Blocks carry a TTL (``redis_ttl``) when one is set.

Modes. One URL: a single server. Several URLs: independent servers sharded by consistent
hashing (ring.py, 160 virtual nodes). ``cluster=True``: Redis Cluster; the cluster client
discovers the topology and routes keys (slot -> primary), and each primary is then spoken to
over its own connection, so that each has its own circuit breaker.

Shards. Each shard (server, or cluster primary) has a CircuitBreaker: while it is open, its
keys count as remote misses without a network call, and the local tiers keep serving.

The async store runs on its own event loop in a daemon thread (RemoteTier), so the synchronous
engine can call it; every call has a timeout (``redis_timeout``).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import xxhash
from redis import asyncio as aioredis
from redis.exceptions import NoScriptError, OutOfMemoryError, RedisError

from kvtier.errors import ConfigError
from kvtier.tiers.remote.breaker import BreakerState, CircuitBreaker
from kvtier.tiers.remote.ring import HashRing

MAGIC = b"KVT2"
HEADER = 64
MAGIC_V1 = b"KVT1"              # read, never written
HEADER_V1 = 44
# KEYS[1] = block key; ARGV = version (decimal), value (header + bytes), ttl_ms.
# Returns 1 written, 0 when the stored version is the same or newer, -1 when not ours.
PUT_SCRIPT = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= 'none' then
  if t ~= 'string' then return -1 end
  local h = redis.call('GETRANGE', KEYS[1], 0, 23)
  local m = string.sub(h, 1, 4)
  if m ~= 'KVT2' and m ~= 'KVT1' then return -1 end
  if tonumber(string.sub(h, 5, 24)) >= tonumber(ARGV[1]) then return 0 end
end
if tonumber(ARGV[3]) > 0 then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
else
  redis.call('SET', KEYS[1], ARGV[2])
end
return 1
"""


def binding(ns: str, key: bytes, version: int, checksum: int) -> int:
    """What ties a remote value to its namespace, key and version (module docstring)."""
    return xxhash.xxh3_64_intdigest(b"%s\x00%s%020d%020d" % (ns.encode(), key, version,
                                                              checksum))


def encode(ns: str, key: bytes, version: int, checksum: int, data: bytes | memoryview) -> bytes:
    return (b"%s%020d%020d%020d" % (MAGIC, version, checksum, binding(ns, key, version, checksum))
            + bytes(data))


@dataclass(slots=True)
class RemoteCounters:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    stale_puts: int = 0          # refused by the version guard: the remote had newer
    errors: int = 0              # connection errors, timeouts, OOM
    skipped: int = 0             # keys not asked because their shard's breaker was open
    foreign: int = 0             # a value under our key that is not ours
    checksum_failures: int = 0
    binding_failures: int = 0    # a value that names another namespace, key or version
    bytes_read: int = 0
    bytes_written: int = 0

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


@dataclass(slots=True)
class Shard:
    name: str
    client: Any
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    script: Any = None


def _no_retry() -> Any:
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    return Retry(NoBackoff(), 0)


def redis_key(ns: str, key: bytes) -> bytes:
    return f"kvtier:{ns}:".encode() + key.hex().encode()


class RemoteStore:
    """Async access to the remote tier. Use through RemoteTier from synchronous code."""

    def __init__(self, urls: Sequence[str], cluster: bool = False, ttl: float = 0.0,
                 timeout: float = 2.0, cooldown: float = 5.0) -> None:
        if not urls:
            raise ConfigError("redis: give at least one URL, e.g. redis://127.0.0.1:6379/0")
        self.urls = list(urls)
        self.cluster = cluster
        self.ttl_ms = int(ttl * 1000)
        self.timeout = timeout
        self.cooldown = cooldown
        self.counters = RemoteCounters()
        self.shards: list[Shard] = []
        self._ring: HashRing | None = None
        self._cluster: Any = None

    def _client(self, url: str) -> Any:
        # No client-side retries: a failing shard must surface at once, so that its breaker
        # counts it; the breaker's half-open probe is the retry.
        return aioredis.Redis.from_url(url, socket_timeout=None,
                                       socket_connect_timeout=self.timeout,
                                       retry=_no_retry())

    def _shard(self, name: str, client: Any) -> Shard:
        return Shard(name, client, CircuitBreaker(cooldown=self.cooldown))

    async def connect(self) -> None:
        if self.cluster:
            from redis.asyncio.cluster import RedisCluster
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
            self._cluster = RedisCluster.from_url(self.urls[0], socket_timeout=self.timeout,
                                                  socket_connect_timeout=self.timeout,
                                                  retry=Retry(NoBackoff(), 1))
            await self._cluster.initialize()
            for node in self._cluster.get_primaries():
                self.shards.append(self._shard(node.name, aioredis.Redis(
                    host=node.host, port=node.port, socket_timeout=None,
                    socket_connect_timeout=self.timeout, retry=_no_retry())))
        else:
            for url in self.urls:
                self.shards.append(self._shard(url, self._client(url)))
            if len(self.shards) > 1:
                self._ring = HashRing([s.name for s in self.shards])

    def _route(self, rkeys: list[bytes]) -> np.ndarray:
        if self._cluster is not None:
            index = {s.name: i for i, s in enumerate(self.shards)}
            return np.array([index.get(self._cluster.get_node_from_key(k).name, 0)
                             for k in rkeys], dtype=np.int64)
        if self._ring is not None:
            return self._ring.lookup(rkeys)
        return np.zeros(len(rkeys), dtype=np.int64)

    async def _per_shard(self, rkeys: list[bytes], fn: Any) -> list[Any]:
        """Run fn(shard, positions) for each shard's keys; None where its breaker is open or
        the call failed. Results are aligned with the shards."""
        route = self._route(rkeys)
        jobs = []
        for si, shard in enumerate(self.shards):
            pos = np.flatnonzero(route == si)
            if pos.size == 0:
                continue
            jobs.append((shard, pos))

        async def one(shard: Shard, pos: np.ndarray) -> Any:
            if not shard.breaker.allow():
                self.counters.skipped += int(pos.size)
                return pos, None
            try:
                # One deadline per shard call rather than a socket timeout on every read:
                # redis-py arms a timer per read when socket_timeout is set, which cost 15%
                # of get throughput on 64 KiB blocks (bench/remote.py).
                async with asyncio.timeout(self.timeout * 2):
                    res = await fn(shard, pos)
            except (RedisError, OSError, asyncio.TimeoutError):
                shard.breaker.record(False)
                self.counters.errors += 1
                return pos, None
            shard.breaker.record(True)
            return pos, res

        if len(jobs) == 1:
            return [await one(*jobs[0])]
        return await asyncio.gather(*(one(s, p) for s, p in jobs))

    async def put_many(self, ns: str, keys: Sequence[bytes], versions: np.ndarray,
                       sums: np.ndarray, blocks: Sequence[Any]) -> np.ndarray:
        """Write blocks whose stored version is older. Returns True where the remote now holds
        this version (written, or refused because it had this one or newer)."""
        rkeys = [redis_key(ns, k) for k in keys]
        out = np.zeros(len(keys), dtype=bool)

        async def put(shard: Shard, pos: np.ndarray) -> list[Any]:
            # A new key needs no comparison: SET NX writes it only if it is still absent, at
            # plain SET speed. Keys that exist (a rewrite, or another host's copy) go through
            # the version-guarded script; both steps are atomic on the server.
            values = {i: encode(ns, keys[i], int(versions[i]), int(sums[i]), blocks[i])
                      for i in pos.tolist()}
            pipe = shard.client.pipeline(transaction=False)
            for i, val in values.items():
                pipe.set(rkeys[i], val, nx=True, px=self.ttl_ms or None)
            first = await pipe.execute(raise_on_error=False)
            res: list[Any] = [1 if r is True else r for r in first]
            again = [j for j, r in enumerate(first) if r is None]
            if again:
                if shard.script is None:
                    shard.script = await shard.client.script_load(PUT_SCRIPT)
                pipe = shard.client.pipeline(transaction=False)
                idx = pos.tolist()
                for j in again:
                    i = idx[j]
                    pipe.evalsha(shard.script, 1, rkeys[i], int(versions[i]), values[i],
                                 self.ttl_ms)
                second = await pipe.execute(raise_on_error=False)
                if any(isinstance(r, NoScriptError) for r in second):
                    shard.script = None        # the server restarted: load it again next time
                for j, r in zip(again, second):
                    res[j] = r
            return res

        for pos, res in await self._per_shard(rkeys, put):
            if res is None:
                continue
            for i, r in zip(pos.tolist(), res):
                if isinstance(r, OutOfMemoryError):
                    self.counters.errors += 1       # maxmemory with noeviction: Redis is full
                elif isinstance(r, Exception) or r == -1:
                    self.counters.foreign += 1
                elif r == 0:
                    self.counters.stale_puts += 1
                    out[i] = True
                else:
                    self.counters.puts += 1
                    self.counters.bytes_written += len(blocks[i])
                    out[i] = True
        return out

    async def get_many(self, ns: str, keys: Sequence[bytes], block_bytes: int
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Any]]:
        """(found, versions, checksums, data) for keys; a miss for anything not sound."""
        n = len(keys)
        rkeys = [redis_key(ns, k) for k in keys]
        found = np.zeros(n, dtype=bool)
        versions = np.zeros(n, dtype=np.uint64)
        sums = np.zeros(n, dtype=np.uint64)
        data: list[Any] = [None] * n
        hit_pos: list[int] = []
        hit_v: list[int] = []
        hit_c: list[int] = []

        async def get(shard: Shard, pos: np.ndarray) -> list[Any]:
            pipe = shard.client.pipeline(transaction=False)
            for i in pos.tolist():
                pipe.get(rkeys[i])
            return await pipe.execute(raise_on_error=False)

        for pos, res in await self._per_shard(rkeys, get):
            if res is None:
                continue
            for i, r in zip(pos.tolist(), res):
                if r is None:
                    continue
                # Header: KVT2, version, checksum and binding as 20 decimal digits (encode()).
                head = (0 if isinstance(r, Exception) else HEADER if r[:4] == MAGIC
                        else HEADER_V1 if r[:4] == MAGIC_V1 else 0)
                if not head or len(r) != head + block_bytes:
                    self.counters.foreign += 1
                    continue
                try:
                    vi, ci = int(r[4:24]), int(r[24:44])
                    bi = int(r[44:64]) if head == HEADER else None
                except ValueError:
                    self.counters.foreign += 1
                    continue
                d = memoryview(r)[head:]
                # Both fit the table's uint64 (a version of 2^64 or more, e.g. a KVT1 value
                # set by hand, raised OverflowError out of get_many: the get's pins leaked).
                if vi <= 0 or vi >= 1 << 64 or ci >= 1 << 64:
                    self.counters.foreign += 1
                    continue
                if bi is not None and bi != binding(ns, keys[i], vi, ci):
                    self.counters.binding_failures += 1   # another key's value, or altered
                    continue
                if xxhash.xxh3_64_intdigest(d) != ci:
                    self.counters.checksum_failures += 1
                    continue
                hit_pos.append(i)
                hit_v.append(vi)
                hit_c.append(ci)
                data[i] = d
        if hit_pos:
            found[hit_pos] = True
            versions[hit_pos] = hit_v
            sums[hit_pos] = hit_c
        self.counters.hits += int(found.sum())
        self.counters.misses += int(n - found.sum())
        self.counters.bytes_read += int(found.sum()) * block_bytes
        return found, versions, sums, data    # data: memoryviews into the replies

    async def exists_many(self, ns: str, keys: Sequence[bytes]) -> np.ndarray:
        rkeys = [redis_key(ns, k) for k in keys]
        out = np.zeros(len(keys), dtype=bool)

        async def exists(shard: Shard, pos: np.ndarray) -> list[Any]:
            pipe = shard.client.pipeline(transaction=False)
            for i in pos.tolist():
                pipe.exists(rkeys[i])
            return await pipe.execute(raise_on_error=False)

        for pos, res in await self._per_shard(rkeys, exists):
            if res is not None:
                for i, r in zip(pos.tolist(), res):
                    out[i] = r is True or r == 1
        return out

    async def delete_many(self, ns: str, keys: Sequence[bytes]) -> int:
        rkeys = [redis_key(ns, k) for k in keys]

        async def delete(shard: Shard, pos: np.ndarray) -> Any:
            return await shard.client.delete(*[rkeys[i] for i in pos.tolist()])

        return sum(int(res) for _pos, res in await self._per_shard(rkeys, delete)
                   if res is not None)

    def stats(self) -> dict[str, Any]:
        return {**self.counters.as_dict(),
                "mode": "cluster" if self.cluster else ("sharded" if self._ring else "single"),
                "breakers": {s.name: s.breaker.snapshot() for s in self.shards},
                "open_breakers": sum(s.breaker.state is not BreakerState.CLOSED
                                     for s in self.shards)}

    async def close(self) -> None:
        for s in self.shards:
            await s.client.aclose()
        if self._cluster is not None:
            await self._cluster.aclose()


class RemoteTier:
    """A RemoteStore on its own event loop thread, with synchronous methods for the engine."""

    def __init__(self, store: RemoteStore) -> None:
        self.store = store
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvtier-remote",
                                        daemon=True)
        self._thread.start()
        self._call(store.connect(), timeout=max(10.0, store.timeout * 3))

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout or self.store.timeout * 4 + 1)
        except TimeoutError:
            fut.cancel()                  # do not leave the call running on the loop
            raise

    def _safe(self, coro: Any, on_timeout: Any) -> Any:
        """Run a store call; a call that outlives its deadline counts as an error and gives
        on_timeout() (misses), never an exception into the engine."""
        try:
            return self._call(coro)
        except TimeoutError:
            self.store.counters.errors += 1
            return on_timeout()

    def put_many(self, ns: str, keys: Sequence[bytes], versions: np.ndarray, sums: np.ndarray,
                 blocks: Sequence[Any]) -> np.ndarray:
        return self._safe(self.store.put_many(ns, keys, versions, sums, blocks),
                          lambda: np.zeros(len(keys), dtype=bool))

    def get_many(self, ns: str, keys: Sequence[bytes], block_bytes: int):
        n = len(keys)
        return self._safe(self.store.get_many(ns, keys, block_bytes),
                          lambda: (np.zeros(n, bool), np.zeros(n, np.uint64),
                                   np.zeros(n, np.uint64), [None] * n))

    def exists_many(self, ns: str, keys: Sequence[bytes]) -> np.ndarray:
        return self._safe(self.store.exists_many(ns, keys),
                          lambda: np.zeros(len(keys), dtype=bool))

    def delete_many(self, ns: str, keys: Sequence[bytes]) -> int:
        return self._safe(self.store.delete_many(ns, keys), lambda: 0)

    def stats(self) -> dict[str, Any]:
        return self.store.stats()

    def close(self) -> None:
        try:
            self._call(self.store.close(), timeout=10)
        finally:
            async def cancel_rest() -> None:
                rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in rest:
                    t.cancel()
                await asyncio.gather(*rest, return_exceptions=True)
            try:
                asyncio.run_coroutine_threadsafe(cancel_rest(), self._loop).result(10)
            except TimeoutError:
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
