"""The asyncio client: ``kvtier.AsyncClient``, the same calls as kvtier.Client, awaitable.

    async with kvtier.AsyncClient() as c:
        ns = await c.namespace("llama3-8b/tp0", block_bytes=65536)
        await ns.put(keys, blocks)
        found, data = await ns.get(keys)

Requests are pipelined: every call gets an id and a future, one reader task resolves them, so
many coroutines can share one connection (``asyncio.gather`` of gets costs one round trip's
latency, not one each). The data path is the sync client's: the namespace's shared segment is
mapped once (its fd fetched over SCM_RIGHTS by a short-lived synchronous connection, since
asyncio streams carry no ancillary data) and blocks are copied straight in and out of leased
slots; ``inline=True`` sends bytes inside frames instead. Restarts are handled as in
kvtier.Client: each call first checks that the service has not closed the connection and
reconnects if it has (namespaces remap on their next use); a connection lost during a call is
retried once where kvtier.api.reconnect allows it, and a put whose reply was lost raises
PutOutcomeUnknown.
"""

from __future__ import annotations

import asyncio
import os
import select
from typing import Any

import numpy as np

from kvtier.api import protocol as P
from kvtier.api.buffers import blocks_view, checksums, pack_keys
from kvtier.api.client import (Client, GetReply, NamespaceHandle, PrefixHit, copy_out,
                               default_socket)
from kvtier.api.reconnect import PUT_OPS, connection_lost, hung_up, retry_safe
from kvtier.errors import ChecksumError, PutOutcomeUnknown, ServiceUnavailable


class AsyncNamespace(NamespaceHandle):
    """A namespace handle of an AsyncClient: the same calls as kvtier.api.client.Namespace."""

    async def _view(self) -> np.ndarray:
        if self._stale():
            c = self._client
            size, fd = await asyncio.get_running_loop().run_in_executor(
                None, _fetch_fd, c.path, self.name, c.timeout)
            return self._attach(size, fd)
        return self._arr

    async def put(self, keys: Any, blocks: Any, parents: Any = None,
                  verify: bool = True) -> np.ndarray:
        kb = pack_keys(keys, self.key_width)
        n = len(kb) // self.key_width
        src = blocks_view(blocks, n, self.block_bytes)
        pb = None if parents is None else pack_keys(parents, self.key_width)
        c = self._client
        await c._ensure()
        if self.inline:
            r = await c._call("put", ns=self.name, keys=kb, data=src.tobytes(), parents=pb)
            return np.frombuffer(r["versions"], "<u8")
        await self._view()
        r = await c._call("reserve", ns=self.name, keys=kb, parents=pb)
        try:
            self._write(np.frombuffer(r["slots"], "<i4"), src)
            sums = P.arr(checksums(src), "<u8") if verify else None
        except BaseException:
            await c._call("abort", rid=r["rid"])
            raise
        r = await c._call("commit", rid=r["rid"], checksums=sums)
        return np.frombuffer(r["versions"], "<u8")

    async def get(self, keys: Any, out: Any = None, verify: bool = False
                  ) -> tuple[np.ndarray, np.ndarray]:
        kb = pack_keys(keys, self.key_width)
        n = len(kb) // self.key_width
        dst = (np.empty((n, self.block_bytes), dtype=np.uint8) if out is None
               else blocks_view(out, n, self.block_bytes, writable=True))
        c = self._client
        await c._ensure()
        if self.inline:
            r = await c._call("get", ns=self.name, keys=kb, inline=True)
            rep = GetReply.decode(r)
            dst[:] = np.frombuffer(r["data"], np.uint8).reshape(n, self.block_bytes)
            idx = np.flatnonzero(rep.found)
            if verify and idx.size and (checksums(dst[idx]) != rep.checksums[idx]).any():
                raise ChecksumError("inline blocks did not match their checksums")
            return rep.found, dst
        view = await self._view()
        rep = GetReply.decode(await c._call("get", ns=self.name, keys=kb))
        try:
            copy_out(view, rep, dst, verify)
        finally:
            c._pending.append(rep.lease)        # released by the next request
        return rep.found, dst

    async def match_prefix(self, keys: Any) -> int:
        return (await self.lookup(keys)).n

    async def lookup(self, keys: Any, stage: bool = False) -> PrefixHit:
        """As kvtier.Client's Namespace.lookup."""
        await self._client._ensure()
        r = await self._client._call("match_prefix", ns=self.name,
                                     keys=pack_keys(keys, self.key_width), stage=stage)
        return PrefixHit(int(r["n"]), int(r["below"]))

    async def delete(self, keys: Any) -> int:
        await self._client._ensure()
        r = await self._client._call("delete", ns=self.name, keys=pack_keys(keys, self.key_width))
        return int(r["deleted"])

    async def flush(self) -> int:
        await self._client._ensure()
        return int((await self._client._call("flush", ns=self.name))["flushed"])


class AsyncClient:
    """A pipelined asyncio connection to `kvtier serve`. Use ``async with`` or connect()."""

    def __init__(self, path: str | os.PathLike | None = None, timeout: float = 30.0,
                 name: str = "") -> None:
        self.path = str(path or default_socket())
        self.timeout = timeout
        self.name = name or f"pid-{os.getpid()}-async"
        self.generation = 0
        self.server_info: dict[str, Any] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._waiting: dict[int, asyncio.Future] = {}
        self._puts_sent: set[int] = set()   # ids of put/commit requests not answered yet
        self._hup: Any = None               # a poll on the connection's socket (hung_up)
        self._next = 0
        self._pending: list[int] = []
        self._namespaces: dict[str, AsyncNamespace] = {}

    async def connect(self) -> None:
        await self._close_connection()
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(self.path, limit=1 << 20), self.timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise ServiceUnavailable(f"cannot connect to kvtier at {self.path}: {exc}; is "
                                     "`kvtier serve` running?") from None
        self._writer = writer
        self._hup = select.poll()
        self._hup.register(writer.get_extra_info("socket").fileno(), select.POLLIN)
        self._reader_task = asyncio.get_running_loop().create_task(self._read_loop(reader))
        self.generation += 1
        self.server_info = await self._request(
            "hello", {"version": P.PROTOCOL_VERSION, "client": self.name})

    async def _ensure(self) -> None:
        """Reconnect if the connection was lost or the service closed it since the last call
        (the reader task may not have run since: a restart seen from a loop that was busy)."""
        if self._writer is not None and (self._writer.is_closing() or hung_up(self._hup)):
            await self._close_connection()
        if self._writer is None:
            await self.connect()

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                head = await reader.readexactly(4)
                body = await reader.readexactly(P.LENGTH.unpack(head)[0])
                reply = P.unpack(body)
                self._puts_sent.discard(reply.get("id"))
                fut = self._waiting.pop(reply.get("id"), None)
                if fut is not None and not fut.done():
                    fut.set_result(reply)
        except (asyncio.IncompleteReadError, ConnectionError, P.ProtocolError):
            pass
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            for rid, fut in self._waiting.items():
                if not fut.done():
                    fut.set_exception(connection_lost(self.path, "it closed the connection",
                                                      int(rid in self._puts_sent)))
            self._waiting.clear()
            self._puts_sent.clear()

    async def _call(self, op: str, **args: Any) -> dict[str, Any]:
        """One request and its reply; sent once more, on a new connection, if the connection
        is lost during the call and the op allows it (kvtier.api.reconnect)."""
        generation = self.generation
        try:
            return await self._request(op, args)
        except ServiceUnavailable as exc:
            if (self._writer is not None or not retry_safe(op, args)
                    or isinstance(exc, PutOutcomeUnknown)):
                raise
        if self.generation == generation:          # no other call has reconnected meanwhile
            await self.connect()
        return await self._request(op, args)

    async def _request(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if self._writer is None:
            raise ServiceUnavailable(f"not connected to kvtier at {self.path}")
        self._next += 1
        req_id = self._next
        body = {"id": req_id, "op": op, **{k: v for k, v in args.items() if v is not None}}
        if self._pending:
            body["release_first"] = P.arr(np.asarray(self._pending), "<u8")
            self._pending.clear()
        fut = asyncio.get_running_loop().create_future()
        self._waiting[req_id] = fut
        try:
            self._writer.write(P.pack(body))
            if op in PUT_OPS:
                self._puts_sent.add(req_id)
            await self._writer.drain()
            reply = await asyncio.wait_for(fut, self.timeout)
        except asyncio.TimeoutError:
            self._waiting.pop(req_id, None)
            lost = connection_lost(self.path, f"no reply within {self.timeout} s",
                                   int(req_id in self._puts_sent))
            await self._close_connection()          # as the sync client: the next call reconnects
            raise lost from None
        except ConnectionError as exc:
            self._waiting.pop(req_id, None)
            self._writer = None
            raise connection_lost(self.path, str(exc), int(req_id in self._puts_sent)) from None
        finally:
            self._puts_sent.discard(req_id)
        return P.raise_for(reply)

    async def namespace(self, name: str, block_bytes: int | None = None, key_width: int = 16,
                        layout: dict[str, Any] | None = None,
                        inline: bool = False) -> AsyncNamespace:
        await self._ensure()
        if block_bytes is not None:
            info = await self._call("ns_create", name=name, block_bytes=block_bytes,
                                    key_width=key_width, layout=layout)
        else:
            info = await self._call("ns_open", name=name, layout=layout)
        ns = AsyncNamespace(self, info, inline)
        if not inline:
            await ns._view()
        self._namespaces[name] = ns
        return ns

    async def stats(self) -> dict[str, Any]:
        await self._ensure()
        return await self._call("stats")

    async def flush(self) -> int:
        await self._ensure()
        return int((await self._call("flush"))["flushed"])

    async def _close_connection(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except ConnectionError:
                pass
            self._writer = None
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)
            self._reader_task = None
        self._pending.clear()
        self._puts_sent.clear()

    async def close(self) -> None:
        if self._pending and self._writer is not None:
            try:
                await self._request("hello", {"version": P.PROTOCOL_VERSION,  # no reconnect
                                              "client": self.name})
            except ServiceUnavailable:
                pass            # the service ends the leases when the connection goes
        for ns in self._namespaces.values():
            ns.close()
        await self._close_connection()

    async def __aenter__(self) -> "AsyncClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def _fetch_fd(path: str, name: str, timeout: float) -> tuple[int, int]:
    """(map size, fd) of a namespace's segment, through a short synchronous connection."""
    with Client(path, timeout=timeout, name="kvtier-async-map") as c:
        info, fd = c._open_mapped(name)
        return int(info["map_bytes"]), fd
