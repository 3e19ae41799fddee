"""The socket server: a thin asyncio façade over the engine.

Each connection is one worker (``owner`` = connection id): its leases and reservations end when
it disconnects, so a crashed worker leaks nothing. Requests on a connection are answered in
order; a client may pipeline them.

Where engine calls run. The engine is synchronous and takes a lock. Calls that cannot touch the
disk (a get whose blocks are all resident in the tier it asks for, host or HBM: resident.py;
release, match_prefix) run inline on the loop when the lock is free at once; a host get that
reads NVMe runs as steps (kvtier.api.steps: its locked memory work on the loop, one step per
loop iteration, its read on a worker thread), unless the service has a remote tier or the
namespace an HBM tier; everything else (puts, flushes, those gets, HBM gets that move blocks)
runs on a worker thread, so disk I/O never blocks the loop. Measured on the dev VM: the thread
hop costs about 60 us, which is most of a single-block get's budget.

Security. The socket is created mode 0600 (0660 with socket_group) in a directory that only the
service's user may write. A namespace's shared memory fd is passed (SCM_RIGHTS) only to a peer
whose SO_PEERCRED uid is the service's own or listed in allowed_uids; others may use the inline
data path. Slots are chosen by the server, never accepted from clients except to release them,
where they are checked against the lease.
"""

from __future__ import annotations

import asyncio
import grp
import inspect
import logging
import os
import socket
import stat
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Awaitable, Callable

import numpy as np

from kvtier import __version__
from kvtier.api import protocol as P
from kvtier.api import quota
from kvtier.api.busypoll import BusyPoll
from kvtier.api.connection import Connection, Later, Reply, failed_reply, ok_reply
from kvtier.api.metrics import ConnectorReports
from kvtier.api.quota import ClientInfo
from kvtier.api.resident import NEEDS_DISK, ResidentGets
from kvtier.api.sortedgets import SortedGets
from kvtier.api.steps import LOOP_WAIT_S, StepRunner, released_first
from kvtier.coherence.engine import Engine
from kvtier.config import Settings
from kvtier.errors import AuthError, BadRequest, ConfigError, KvtierError, ProtocolError
from kvtier.tiers.hbm import on_device
from kvtier.types import Tier

log = logging.getLogger("kvtier.server")
STAGE_WAIT_S = 5.0     # longest a get waits for a stage of its namespace in flight
# A request of these ops with more than SHORT_KEYS keys is long (Server._long): its dispatch
# waits its turn in the step queue, behind the gets' steps, and the short ones go first.
LONG_OPS = frozenset(("get", "reserve", "commit", "match_prefix"))
SHORT_KEYS = 4
# The most keys a put's reserve or commit runs inline on the loop (op_reserve, op_commit): bounds
# how long one request holds the loop (a 4,096-key commit with the writer's checksums: ~1 ms).
INLINE_PUT_KEYS = 4096
_PEERCRED = struct.Struct("3i")
# Read as module names on the put path (an Enum member read on its class goes through
# EnumType's __getattr__, a dtype built from a string costs a parse each time).
_HOST = Tier.HOST
_I4, _U8 = np.dtype("<i4"), np.dtype("<u8")


class Server(ResidentGets, SortedGets):
    """Serve one engine on a Unix socket. start(), then serve until stop()."""

    def __init__(self, engine: Engine, settings: Settings,
                 on_op: Callable[[str, float, bool], None] | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.path = settings.socket_path
        self.clients: dict[int, ClientInfo] = {}
        self._next_cid = 0
        self._server: asyncio.base_events.Server | None = None
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvtier-engine")
        # Memory-only calls that found the engine lock taken wait for it here, never in a
        # queue behind other workers' NVMe reads and flushes on _pool (issue 17: beside eight
        # NVMe readers a resident get's p99 was 3.3x alone, most of it waiting for a pool
        # thread held by a 40 ms disk read).
        self._mem_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvtier-mem")
        self._tasks: set[asyncio.Task] = set()
        self._staging: dict[str, asyncio.Task] = {}     # namespace -> its latest stage task
        self._live: set[Connection] = set()
        self._on_op = on_op
        self.allowed = {os.getuid(), *settings.allowed_uids}
        self._ops: dict[str, Callable[..., Any]] = {op: getattr(self, f"op_{op}") for op in P.OPS}
        self._threads_busy = 0              # engine calls in flight on the pool
        # The steps of host gets that read NVMe: locked ones on the loop, the read on _pool.
        self.steps = StepRunner(engine.lock, self._run, self._run_mem, self._frames_waiting)
        self.buffered = 0                   # bytes of partly received frames, all connections
        self.reports = ConnectorReports()
        self.busy = BusyPoll(settings.busy_poll_us * 1e-6, lambda: self._threads_busy == 0)

    # ------------------------------------------------------------------ lifecycle

    def _prepare_path(self) -> None:
        parent = self.path.parent
        if not parent.exists():
            parent.mkdir(parents=True, mode=0o700)
        st = parent.stat()
        if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ConfigError(
                f"the socket directory {parent} must belong to uid {os.getuid()} and be "
                "writable by it alone (chmod 700); choose another --socket path")
        if self.path.is_symlink() or (self.path.exists() and not self.path.is_socket()):
            raise ConfigError(f"{self.path} exists and is not a socket; remove it or choose "
                              "another --socket path")
        if self.path.exists():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(self.path))
            except OSError:
                self.path.unlink()          # stale socket of a service that died
            else:
                raise ConfigError(f"another kvtier serve is listening on {self.path}")
            finally:
                probe.close()

    async def start(self) -> None:
        self._prepare_path()
        old = os.umask(0o177)
        try:
            self._server = await asyncio.get_running_loop().create_unix_server(
                lambda: Connection(self), path=str(self.path))
        finally:
            os.umask(old)
        mode = 0o600
        if self.settings.socket_group:
            try:
                gid = grp.getgrnam(self.settings.socket_group).gr_gid
            except KeyError:
                raise ConfigError(f"socket_group {self.settings.socket_group!r} does not "
                                  "exist") from None
            os.chown(self.path, -1, gid)
            mode = 0o660
        os.chmod(self.path, mode)
        self._spawn(self._housekeeping())

    def _spawn(self, aw: Awaitable[Any], name: str | None = None) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(_awaited(aw), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        """A background task's failure is logged here, once: nobody else awaits it (issue 20:
        'Future exception was never retrieved' for a release whose connection had closed)."""
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            if isinstance(exc, KvtierError):
                log.info("%s: %s", task.get_name(), exc)
            else:
                log.error("%s failed", task.get_name(), exc_info=exc)

    async def _housekeeping(self) -> None:
        """Expire stalled reservations and leases; flush under write_back."""
        last_flush = time.monotonic()
        while True:
            await asyncio.sleep(0.5)
            try:
                await self._run(self.engine.reap)
                await self._run(self.engine.nvme.tick)    # LMDB catches up with the log
                if (self.settings.write_policy == "write_back"
                        and time.monotonic() - last_flush >= self.settings.flush_interval):
                    last_flush = time.monotonic()
                    await self._run(self.engine.flush, None, False)   # the rest next time
            except KvtierError:
                log.exception("housekeeping failed; retrying")

    async def stop(self) -> None:
        """Stop accepting, end connections, flush dirty blocks, close LMDB."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._live):
            conn.transport.close()            # connection_lost queues its releases
        if self._server is not None:
            await self._server.wait_closed()
        await asyncio.sleep(0)
        for t in list(self._tasks):
            # Releases of closed connections and replies in flight run to their end (their
            # engine calls are on threads anyway); cancelling a reply task before it started
            # left its op's coroutine never awaited.
            if not (t.get_name() or "").startswith(("release-", "reply-")):
                t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, self.engine.close)
        self._pool.shutdown(wait=True)
        self._mem_pool.shutdown(wait=True)
        self._close_frames()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ connections

    def _connection_made(self, conn: Connection) -> ClientInfo:
        sock = conn.transport.get_extra_info("socket")
        pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          _PEERCRED.size))
        self._next_cid += 1
        client = ClientInfo(self._next_cid, pid, uid)
        client.pins.live = self._holds_id
        self.clients[client.cid] = client
        self._live.add(conn)
        self._watch_frames(conn)
        return client

    def _holds_id(self, hold_id: int) -> bool:
        """Whether the engine still holds lease or reservation hold_id (Pins.live). Read
        without the lock: a membership test of a dict is atomic, and an ended id never
        comes back (ids are not reused)."""
        return hold_id in self.engine.reservations or hold_id in self.engine.leases

    def _connection_lost(self, conn: Connection) -> None:
        self._live.discard(conn)
        self._unwatch_frames(conn)
        self.clients.pop(conn.client.cid, None)
        self._spawn(self._run(self.engine.release_owner, conn.client.cid),
                    name=f"release-owner-{conn.client.cid}")

    def _finished(self, client: ClientInfo, op: str, t0: float, ok: bool) -> None:
        dt = time.perf_counter() - t0
        client.record(dt, ok)
        if self._on_op is not None:
            self._on_op(op, dt, ok)

    def _dispatch(self, client: ClientInfo, body: bytes, own: int = -1
                  ) -> Reply | Awaitable[Reply] | Later:
        """Decode and run one request. Ops that need no thread are answered here, on the loop,
        with no coroutine or task; the others come back as an awaitable of the reply; a long
        one (_long) as a Later, its dispatch to be run in its turn (kvtier.api.connection),
        when steps are queued or a frame waits in another connection's socket than own's (the
        dispatching connection's fd)."""
        req_id: Any = None
        op = "invalid"
        try:
            req = P.unpack(body)
            req_id = req.get("id")
            op = req.get("op")
            if not isinstance(op, str) or op not in self._ops:
                op = "invalid"
                raise BadRequest(f"unknown op {req.get('op')!r}; known: {', '.join(P.OPS)}")
            if op in LONG_OPS and self._long(req) and (self.steps.busy
                                                        or self._another_waits(own)):
                return Later(partial(self._dispatch_req, client, req, req_id, op))
        except Exception as exc:
            return failed_reply(exc, req_id, op)
        return self._dispatch_req(client, req, req_id, op)

    def _another_waits(self, own: int) -> bool:
        """_frames_waiting(own), with no epoll where no other connection's socket is watched
        (kvtier.api.resident): a lone worker's long requests (a GPU put's reserves and
        commits) pay no syscall each."""
        return len(getattr(self, "_frame_fds", ())) > 1 and self._frames_waiting(own)

    def _long(self, req: dict[str, Any]) -> bool:
        """Whether a request of LONG_OPS is long: more than SHORT_KEYS keys (or checksums, a
        commit's). Its dispatch then waits its turn behind the gets' steps already queued
        (kvtier.api.steps), and the short requests read in the same poll go first: a host
        get of few resident keys costs tens of microseconds on the loop, an NVMe reader's
        frame of 64 keys ~90 (try_get's refusal, the steps' start; H200, stall5). Only when
        there is something to go first (_dispatch: steps queued, or a frame waiting in a
        socket, one zero-timeout epoll): a lone worker's batches (a GPU put's reserve and
        commit, chunk by chunk) keep their inline dispatch, with no loop iteration added."""
        keys, name = req.get("keys"), req.get("ns")
        if "piece" in req:
            return True                 # a sorted get's later piece (kvtier.api.sortedgets)
        if type(keys) is bytes:
            ns = self.engine.namespaces.get(name) if type(name) is str else None
            return len(keys) > SHORT_KEYS * (ns.key_width if ns is not None else 16)
        sums = req.get("checksums")
        return type(sums) is bytes and len(sums) > SHORT_KEYS * 8

    def _dispatch_req(self, client: ClientInfo, req: dict[str, Any], req_id: Any,
                      op: str) -> Reply | Awaitable[Reply]:
        try:
            if op == "get" and ("sort" in req or "of" in req):
                return self._sorted_get(client, req, req_id)      # kvtier.api.sortedgets
            if "release_first" in req and op == "get":
                out = self._get_resident_first(client, req)
                if out is not None:
                    return ok_reply(out, req_id, op)
                if req.get(NEEDS_DISK) and self._by_steps(req["ns"], Tier.HOST):
                    # An NVMe reader's batch, refused by try_get (after its quota check):
                    # straight to its steps, its releases their first locked step
                    # (released_first) rather than part of this dispatch, the loop's longest
                    # slice (stall12). op_get would only check again what was checked.
                    P.arg(req, "device", int, None)
                    ids = P.array_arg(req, "release_first", "<u8").tolist()
                    return self._await_op(self._get_slow(client, req["ns"], req["keys"], False,
                                                         releases=ids), req_id, op)
            left = self._release_first(client, req) if "release_first" in req else []
            if left:
                return self._dispatch_after(client, req, req_id, op, left)
            result = self._ops[op](client, req)
            # (an inline op answers a dict: no isawaitable's protocol checks for it)
            if type(result) is not dict and inspect.isawaitable(result):
                return self._await_op(result, req_id, op)
            return ok_reply(result, req_id, op)
        except Exception as exc:
            return failed_reply(exc, req_id, op)

    async def _dispatch_after(self, client: ClientInfo, req: dict[str, Any], req_id: Any,
                              op: str, leases: list[int]) -> Reply:
        """The rest of a request whose piggybacked releases had to wait for the engine lock."""
        client.errors += await self._run_mem(self.engine.release_many, leases, client.cid)
        try:
            result = self._ops[op](client, req)
        except Exception as exc:
            return failed_reply(exc, req_id, op)
        if inspect.isawaitable(result):
            return await self._await_op(result, req_id, op)
        return ok_reply(result, req_id, op)

    async def _await_op(self, result: Awaitable[dict[str, Any]], req_id: Any, op: str) -> Reply:
        try:
            return ok_reply(await result, req_id, op)
        except Exception as exc:
            return failed_reply(exc, req_id, op)

    def _release_first(self, client: ClientInfo, req: dict[str, Any]) -> list[int]:
        """End the leases a client piggybacked on this request, in one engine call; returns
        them all when that must wait for the engine lock. An unknown one is counted, not fatal:
        the request itself must still be answered."""
        ids = P.array_arg(req, "release_first", "<u8").tolist()
        client.pins.end(ids)
        done, bad = self._fast(self.engine.release_many, ids, client.cid)
        if not done:
            return ids
        client.errors += bad
        return []

    def _release_step(self, client: ClientInfo, ids: list[int]) -> None:
        """Under the lock (a get's first step, released_first): the engine's part of the
        releases a get carried (client.pins ended them already); unknown ids are counted as
        the connection's errors, as _release_first counts them."""
        client.errors += self.engine.release_many(ids, client.cid)

    def _run(self, fn: Callable[..., Any], *args: Any,
             pool: ThreadPoolExecutor | None = None) -> asyncio.Future:
        fut = asyncio.get_running_loop().run_in_executor(pool or self._pool, fn, *args)
        self._threads_busy += 1
        fut.add_done_callback(self._thread_done)
        return fut

    def _run_mem(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """fn (memory-only: it takes the engine lock, never the disk) on the memory lane."""
        return self._run(fn, *args, pool=self._mem_pool)

    def _thread_done(self, _fut: asyncio.Future) -> None:
        self._threads_busy -= 1

    def _fast(self, fn: Callable[..., Any], *args: Any) -> tuple[bool, Any]:
        """Run fn inline when the engine lock is free now (memory-only calls)."""
        if not self.engine.lock.acquire(blocking=False):
            return False, None
        try:
            return True, fn(*args)
        finally:
            self.engine.lock.release()

    # ------------------------------------------------------------------ ops
    # An op returns its result, or an awaitable of it when it must wait for a thread. Ops that
    # never touch the disk try the engine inline first (_fast).

    def op_hello(self, client: ClientInfo, req: dict[str, Any]) -> dict[str, Any]:
        version = P.arg(req, "version", int)
        if version != P.PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {version} is not supported; this service "
                                f"speaks {P.PROTOCOL_VERSION}: upgrade the client")
        client.name = str(P.arg(req, "client", str, ""))[:100]
        return {"version": P.PROTOCOL_VERSION, "server": f"kvtier {__version__}",
                "pid": os.getpid(), "uid": os.getuid(), "client_id": client.cid}

    async def op_ns_create(self, client: ClientInfo, req: dict[str, Any]) -> dict[str, Any]:
        layout = P.arg(req, "layout", dict, None)
        return await self._run(self.engine.create_namespace, P.arg(req, "name", str),
                               P.arg(req, "block_bytes", int), P.arg(req, "key_width", int, 16),
                               layout)

    def op_ns_open(self, client: ClientInfo, req: dict[str, Any]) -> dict[str, Any]:
        ns = self.engine.namespace(P.arg(req, "name", str))
        ns.check_layout(P.arg(req, "layout", dict, None))
        info = ns.info()
        if P.arg(req, "map", bool, False):
            if client.uid not in self.allowed:
                raise AuthError(f"uid {client.uid} may not map namespace memory; add it to "
                                "allowed_uids, or use the inline data path")
            pool = ns.slots[Tier.HOST].pool
            info["map_bytes"] = pool.n_slots * pool.block_bytes
            info["_fd"] = pool.fd
            hbm = ns.slots.get(Tier.HBM)
            if hbm is not None and hasattr(hbm.pool, "ipc_info"):
                # The HBM pools, for workers on this host: CUDA IPC of each GPU's allocation.
                info["hbm"] = hbm.pool.ipc_info()
        return info

    def op_reserve(self, client: ClientInfo, req: dict[str, Any]
                   ) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        if "count" in req and "keys" not in req:
            return self._reserve_credit(client, req)
        name, keys = P.arg(req, "ns", str), P.arg(req, "keys", bytes)
        # A GPU put's reserves name the host tier (or none): its parse only for the others.
        tier = _HOST if req.get("tier", "host") == "host" else _slot_tier(req)
        parents, device = P.arg(req, "parents", bytes, None), P.arg(req, "device", int, None)
        if tier is _HOST:
            ns = self.engine.namespace(name)
            client.pins.check(ns, keys, self.settings.max_client_share)
            # Inline on the loop when the engine lock is free now and the reserve touches no
            # disk (Puts.reserve_inline; at most INLINE_PUT_KEYS keys): no thread hop.
            if (len(keys) <= INLINE_PUT_KEYS * ns.key_width
                    and self.engine.lock.acquire(blocking=False)):
                try:
                    res = self.engine.puts.reserve_inline(name, keys, parents, client.cid)
                finally:
                    self.engine.lock.release()
                if res is not None:
                    return self._reserved(client, name, tier, res)
        return self._reserve_slow(client, name, keys, parents, tier, device)

    def _reserve_credit(self, client: ClientInfo, req: dict[str, Any]
                        ) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        """A credit: count host slots reserved with no keys (Puts.reserve_credit), inline
        where the room is free now, within the connection's share as any reservation."""
        name, n = P.arg(req, "ns", str), P.arg(req, "count", int)
        if _slot_tier(req) is not Tier.HOST:
            raise BadRequest("a credit (reserve by count) is of host slots; leave tier out")
        ns = self.engine.namespace(name)
        if not 0 < n <= INLINE_PUT_KEYS:
            raise BadRequest(f"a credit of {n} slots; ask for 1 to {INLINE_PUT_KEYS}")
        client.pins.check_count(ns, n, self.settings.max_client_share)
        if self.engine.lock.acquire(blocking=False):
            try:
                res = self.engine.puts.reserve_credit_inline(name, n, client.cid)
            finally:
                self.engine.lock.release()
            if res is not None:
                return self._reserved(client, name, Tier.HOST, res, credit=True)
        return self._credit_slow(client, name, n)

    async def _credit_slow(self, client: ClientInfo, name: str, n: int) -> dict[str, Any]:
        res = await self._run(self.engine.puts.reserve_credit, name, n, client.cid)
        return self._reserved(client, name, Tier.HOST, res, credit=True)

    async def _reserve_slow(self, client: ClientInfo, name: str, keys: bytes,
                            parents: bytes | None, tier: Tier,
                            device: int | None) -> dict[str, Any]:
        res = await self._run(on_device, device, self.engine.reserve, name, keys, parents,
                              tier, client.cid)
        return self._reserved(client, name, tier, res)

    def _reserved(self, client: ClientInfo, name: str, tier: Tier, res: Any,
                  credit: bool = False) -> dict[str, Any]:
        if tier is _HOST:
            client.pins.add(res.rid, name, int(res.slots.size))
        out = {"rid": res.rid, "slots": res.slots.astype(_I4).tobytes()}   # P.arr's bytes
        if credit:                  # the writer uses it well before it expires
            out["expires_s"] = self.settings.reserve_timeout
        return out

    def op_commit(self, client: ClientInfo, req: dict[str, Any]
                  ) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        sums = P.array_arg(req, "checksums", _U8, None)
        rid = P.arg(req, "rid", int)
        trusted = P.arg(req, "trusted", bool, False)
        # A credit's commit names its keys (Puts._bind).
        keys, parents = P.arg(req, "keys", bytes, None), P.arg(req, "parents", bytes, None)
        client.pins.end([rid])              # committed or refused, the reservation has ended
        if (trusted and sums is not None and sums.size <= INLINE_PUT_KEYS
                and self.engine.lock.acquire(blocking=False)):
            # Inline only with the writer's checksums (otherwise the commit hashes every
            # byte), and when it touches no disk (Puts.commit_inline).
            try:
                versions = self.engine.puts.commit_inline(rid, client.cid, sums, keys, parents)
            finally:
                self.engine.lock.release()
            if versions is not None:
                return {"versions": P.arr(versions, "<u8")}
        return self._commit_slow(rid, client.cid, sums, trusted, keys, parents)

    async def _commit_slow(self, rid: int, owner: int, sums: np.ndarray | None,
                           trusted: bool, keys: bytes | None = None,
                           parents: bytes | None = None) -> dict[str, Any]:
        versions = await self._run(self.engine.commit, rid, owner, sums, trusted, keys, parents)
        return {"versions": P.arr(versions, "<u8")}

    async def op_abort(self, client: ClientInfo, req: dict[str, Any]) -> dict[str, Any]:
        rid = P.arg(req, "rid", int)
        client.pins.end([rid])
        await self._run(self.engine.abort, rid, client.cid)
        return {}

    async def op_put(self, client: ClientInfo, req: dict[str, Any]) -> dict[str, Any]:
        ns = self.engine.namespace(P.arg(req, "ns", str))
        keys = P.arg(req, "keys", bytes)
        data = P.arg(req, "data", bytes)
        n = len(keys) // ns.key_width if ns.key_width else 0
        if len(data) != n * ns.block_bytes or len(keys) % ns.key_width:
            raise BadRequest(f"inline put of {len(keys)} key bytes and {len(data)} data bytes; "
                             f"expected n x {ns.key_width} and n x {ns.block_bytes}")
        blocks = np.frombuffer(data, dtype=np.uint8).reshape(n, ns.block_bytes)
        versions = await self._run(self.engine.put, ns.name, keys, blocks,
                                   P.arg(req, "parents", bytes, None), Tier.HOST, client.cid)
        return {"versions": P.arr(versions, "<u8")}

    def op_get(self, client: ClientInfo, req: dict[str, Any]
               ) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        name = P.arg(req, "ns", str)
        keys = P.arg(req, "keys", bytes)
        if not req.get("inline") and req.get("tier", "host") == "host":
            out = self._get_one_resident(client, name, keys)
            if out is not None:
                return out
        inline = P.arg(req, "inline", bool, False)
        tier = _slot_tier(req)
        if inline:
            quota.inline_size(self.engine.namespace(name), keys, self.settings.max_frame)
        elif tier is Tier.HOST:
            client.pins.check(self.engine.namespace(name), keys, self.settings.max_client_share)
        if inline and tier is not Tier.HOST:
            raise BadRequest("inline gets are served from the host tier; drop tier or inline")
        if tier is Tier.HOST:
            # A batch marked NEEDS_DISK was refused by try_get in data_received: straight
            # to its steps.
            if not req.get(NEEDS_DISK):
                # try_get first where the lock is free: a batch that must read the disk is
                # refused after its one lookup (as looks_resident's), and a resident one is
                # leased with no second lookup of its keys (looks_resident was 25% of a
                # 1,024-key get's dispatch on the dev VM: 40 of 158 us). Only a get that would
                # wait for the lock asks the unlocked hint first, so that one needing the disk
                # never waits on the loop.
                done, res = self._fast(self.engine.try_get, name, keys, client.cid)
                if done and res is not None:
                    return self._get_reply(client, name, keys, res, inline)
                if not done and self.engine.looks_resident(name, keys):
                    return self._get_waiting(client, name, keys, inline)
        else:
            out = self._get_resident(client, name, keys, tier)
            if out is not None:
                return out
        return self._get_slow(client, name, keys, inline, tier, P.arg(req, "device", int, None))

    async def _get_waiting(self, client: ClientInfo, name: str, keys: bytes,
                           inline: bool) -> dict[str, Any]:
        """A host get that found the lock taken: tried again once the lock is free, on the
        loop when its holder is brief (steps.LOOP_WAIT_S), else on the memory lane, and only
        when it must move bytes between tiers sent on to the I/O pool."""
        if self.engine.lock.acquire(timeout=LOOP_WAIT_S):
            try:
                res = self.engine.try_get(name, keys, client.cid)
            finally:
                self.engine.lock.release()
        else:
            res = await self._run_mem(self.engine.try_get, name, keys, client.cid)
        if res is not None:
            return self._get_reply(client, name, keys, res, inline)
        return await self._get_slow(client, name, keys, inline)

    async def _get_slow(self, client: ClientInfo, name: str, keys: bytes, inline: bool,
                        tier: Tier = Tier.HOST, device: int | None = None,
                        releases: list[int] | None = None) -> dict[str, Any]:
        """releases: piggybacked leases still to end before the get (_dispatch_req left
        them to its steps' first locked step); ended on the memory lane first where the
        get cannot run as steps or must wait for a stage (never held through that wait)."""
        staging = self._staging.get(name)
        by_steps = self._by_steps(name, tier)
        if releases and (staging is not None or not by_steps):
            client.errors += await self._run_mem(self.engine.release_many, releases,
                                                 client.cid)
            releases = None
        if staging is not None:
            # A get of blocks a lookup is staging (the engine's load, a few ms after its
            # lookup) would read them from disk a second time, beside the stage's read: let
            # the stage finish first, and the get then copies memory.
            await asyncio.wait({staging}, timeout=STAGE_WAIT_S)
            by_steps = self._by_steps(name, tier)
        if by_steps:
            steps = self.engine.get_steps(name, keys, client.cid, tier)
            if releases:
                steps = released_first(partial(self._release_step, client, releases), steps)
            res = await self.steps.drive(steps, partial(self._dropped_get, client))
        else:
            # A get from HBM may copy host blocks up to the GPU (the worker's first), a host
            # get's decide may copy HBM blocks down (GPU work), and its install may fill
            # misses from the remote tier (network I/O under the lock): off the loop, on a
            # thread (in the device's context).
            res = await self._run(on_device, device, self.engine.get, name, keys, client.cid,
                                  tier)
        out = self._get_reply(client, name, keys, res, inline)
        # The reply is written in a loop iteration of its own, after a poll: building it and
        # writing it (Connection._write: the pack and the socket's send) in one task step
        # made the loop's longest slice (stall12, bench/stall_dispatch.py --task-steps: ~74
        # us CPU p50 in process, against ~50 for the longest of the steps).
        try:
            await asyncio.sleep(0)
        except BaseException:
            # (stop() cancels no reply task; were one cancelled here, the lease made for it
            # would never be sent: it ends now, not at lease_timeout, as in _get_reply.)
            if out["lease"]:
                client.pins.end([out["lease"]])
                self.engine.release(out["lease"], client.cid)
            raise
        return out

    def _dropped_get(self, client: ClientInfo, res: Any) -> None:
        """A get's result its cancelled task will never send (StepRunner.drive's dropped): its
        lease ends, on the memory lane (the loop does not wait for the lock)."""
        if res.lease_id:
            self._spawn(self._run_mem(self.engine.release_many, [res.lease_id], client.cid),
                        name="release-dropped")

    def _by_steps(self, name: str, tier: Tier) -> bool:
        """Whether a get that must move bytes runs as steps on the loop (kvtier.api.steps):
        a host get with no remote tier and no HBM tier in its namespace. (A namespace not
        there: the steps raise its error.)"""
        ns = self.engine.namespaces.get(name)
        return (tier is Tier.HOST and self.engine.remote is None
                and (ns is None or Tier.HBM not in ns.slots))

    def _get_reply(self, client: ClientInfo, name: str, keys: bytes, res: Any,
                   inline: bool) -> dict[str, Any]:
        try:
            if res.found[-1]:
                # The chain's next blocks (after the batch's last key), one tier up, off the
                # request's path; a task only when there is something to move or the engine
                # is too busy to tell now.
                if self.engine.wants_prefetch(name, keys) is not False:
                    self._spawn(self._run(self.engine.prefetch_after, name, keys))
            out = {"lease": res.lease_id, "found": P.arr(res.found, "u1"),
                   "slots": P.arr(res.slots, "<i4"), "versions": P.arr(res.versions, "<u8"),
                   "checksums": P.arr(res.checksums, "<u8")}
            if inline:
                # The inline fallback copies the bytes into the reply and ends the lease at
                # once.
                ns = self.engine.namespace(name)
                idx = np.flatnonzero(res.found)
                data = np.zeros((res.found.size, ns.block_bytes), dtype=np.uint8)
                data[idx] = ns.slots[Tier.HOST].pool.read(res.slots[idx])
        except BaseException:
            # The client gets an error, never the lease's id: it ends now, not at
            # lease_timeout (fix9).
            self.engine.release(res.lease_id, client.cid)
            raise
        if inline:
            self.engine.release(res.lease_id, client.cid)
            out["data"] = data.tobytes()
            out["lease"] = 0
        elif res.tier is Tier.HOST:
            client.pins.add(res.lease_id, name, int(res.found.sum()))
        return out

    def op_release(self, client: ClientInfo, req: dict[str, Any]
                   ) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        lid = P.arg(req, "lease", int)
        slots = P.array_arg(req, "slots", "<i4", None)
        if slots is None:
            client.pins.end([lid])
        else:
            client.pins.shrink(lid, int(slots.size))
        done, _ = self._fast(self.engine.release, lid, client.cid, slots)
        if done:
            return {}
        return self._empty_after(self._run_mem(self.engine.release, lid, client.cid, slots))

    def op_match_prefix(self, client: ClientInfo, req: dict[str, Any]
                        ) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        args = (P.arg(req, "ns", str), P.arg(req, "keys", bytes))
        stage = P.arg(req, "stage", bool, False)
        if self.engine.remote is None:          # the remote tier is network I/O: never inline
            done, hit = self._fast(self.engine.lookup_prefix, *args)
            if done:
                return self._match_reply(args, hit, stage)
        return self._match_slow(args, stage)

    async def _match_slow(self, args: tuple[str, bytes], stage: bool) -> dict[str, Any]:
        # Memory only unless a remote tier is asked: then it is network I/O, on the I/O pool.
        run = self._run if self.engine.remote is not None else self._run_mem
        return self._match_reply(args, await run(self.engine.lookup_prefix, *args), stage)

    def _match_reply(self, args: tuple[str, bytes], hit: tuple[int, int],
                     stage: bool) -> dict[str, Any]:
        n, below = hit
        if stage and below:
            # The matched keys that only NVMe holds, up to host off the request's path, so
            # that the engine's load of them (a few milliseconds later) is a memory copy.
            name, keys = args
            width = self.engine.namespace(name).key_width
            task = self._spawn(self._run(self.engine.stage, name, keys[:n * width]),
                               name=f"stage {name}")
            self._staging[name] = task
            task.add_done_callback(lambda t: self._stage_done(name, t))
        return {"n": n, "below": below}

    def _stage_done(self, name: str, task: asyncio.Task) -> None:
        if self._staging.get(name) is task:
            del self._staging[name]

    @staticmethod
    async def _empty_after(fut: Awaitable[Any]) -> dict[str, Any]:
        await fut
        return {}

    async def op_delete(self, client: ClientInfo, req: dict[str, Any]) -> dict[str, Any]:
        n = await self._run(self.engine.delete, P.arg(req, "ns", str), P.arg(req, "keys", bytes))
        return {"deleted": n}

    async def op_flush(self, client: ClientInfo, req: dict[str, Any]) -> dict[str, Any]:
        n = await self._run(self.engine.flush, P.arg(req, "ns", str, None))
        return {"flushed": n}

    async def op_stats(self, client: ClientInfo, req: dict[str, Any]) -> dict[str, Any]:
        return await self._run(self.stats)

    def op_report(self, client: ClientInfo, req: dict[str, Any]) -> dict[str, Any]:
        self.reports.update(P.arg(req, "engine", str), P.arg(req, "part", str),
                            P.arg(req, "counters", dict))
        return {}

    def stats(self) -> dict[str, Any]:
        """The engine's statistics, the socket loop's busy polling and the engine connectors'
        reports (any thread)."""
        s = self.engine.stats()
        s["busy_poll"] = self.busy.stats()
        s["connectors"] = self.reports.totals()
        return s


def _slot_tier(req: dict[str, Any]) -> Tier:
    """The tier whose slots a get leases or a reserve hands out: host (default) or hbm."""
    tier = Tier.parse(P.arg(req, "tier", str, "host"))
    if tier not in (Tier.HOST, Tier.HBM):
        raise BadRequest(f"slots come from the host or hbm tier, not {tier.label}")
    return tier


async def _awaited(aw: Awaitable[Any]) -> Any:
    return await aw
