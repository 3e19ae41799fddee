"""The worker protocol: length-prefixed msgpack frames over a Unix socket.

    frame   = u32 little-endian body length, then the body
    request = {"id": int, "op": str, ...arguments}
    reply   = {"id": int, "ok": True, ...results}
            | {"id": int, "ok": False, "error": {"code": str, "message": str}}

Batches travel as packed arrays, never lists of small objects: ``keys`` is one bytes value of
n x key_width bytes; ``slots`` int32, ``versions`` and ``checksums`` uint64 and ``found`` uint8
are raw little-endian arrays. Replies carry the request's id, so a client may pipeline.

Operations (PROTOCOL_VERSION 1):

    hello          {version, client?}                  -> {version, server, pid, uid}
    ns_create      {name, block_bytes, key_width?, layout?} -> namespace info
    ns_open        {name, map?, layout?}               -> info, and with map=True the host
                                                          segment's fd over SCM_RIGHTS and,
                                                          on GPU hosts, hbm: {ipc, slots,
                                                          device} (CUDA IPC of the HBM pool)
    reserve        {ns, keys, parents?, tier?}         -> {rid, slots}
                   {ns, count}                         -> {rid, slots, expires_s}  a credit:
                                                          host slots before their keys
    commit         {rid, checksums?, trusted?,         -> {versions}  keys (and parents):
                    keys?, parents?}                      a credit's, for its first slots
    abort          {rid}                               -> {}
    put            {ns, keys, data, parents?}          -> {versions}       (inline fallback)
    get            {ns, keys, inline?, tier?}          -> {lease, found, slots, versions,
                                                           checksums, data?}

``tier`` ("host" by default, or "hbm") names the pool whose slots a reserve hands out and a get
leases: "hbm" slots index the HBM pool a worker opened from ns_open's hbm handle.
    release        {lease, slots?}                     -> {}
    match_prefix   {ns, keys, stage?}                  -> {n, below}  n leading keys held;
                                                          below of them only on NVMe/Redis;
                                                          stage=True starts bringing those
                                                          up to host in the background
    delete         {ns, keys}                          -> {deleted}
    flush          {ns?}                               -> {flushed}
    stats          {}                                  -> engine statistics
    report         {engine, part, counters}            -> {}  an engine connector's totals
                                                          (kvtier.integrations), shown in
                                                          stats["connectors"] and /metrics

A layout given to ns_create or ns_open must equal the namespace's stored one (NamespaceError).

Any request may carry ``release_first`` (uint64 lease ids): the service ends those leases before
the op, which saves the client a round trip per get.

A malformed body, an unknown op or bad arguments get an error reply; only broken framing (a
length over max_frame, or a body that is not a msgpack map) closes the connection.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack
import numpy as np

from kvtier.errors import BY_CODE, BadRequest, KvtierError, ProtocolError

PROTOCOL_VERSION = 1
LENGTH = struct.Struct("<I")
OPS = ("hello", "ns_create", "ns_open", "reserve", "commit", "abort", "put", "get", "release",
       "match_prefix", "delete", "flush", "stats", "report")


# msgpack.packb makes a Packer, with a buffer of 256 KiB by default, on every call; `kvtier serve`
# pins glibc's mmap threshold at 128 KiB (kvtier.memory.tune_malloc), so in the service every
# reply's pack mapped, faulted in and unmapped that buffer: 12.5 us a pack on the dev VM against
# 0.9 with 64 KiB, ~20-30 us of each reply's write under load (a GPU put's ten replies, a
# chunked get's five: bench/put_control.py --serve, svc12). The buffer grows for larger frames.
_PACK_BUF = 64 << 10


def pack(obj: dict[str, Any]) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True, buf_size=_PACK_BUF)
    return LENGTH.pack(len(body)) + body


def unpack(body: bytes) -> dict[str, Any]:
    """Decode a body; ProtocolError when it is not a msgpack map."""
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError,
            UnicodeDecodeError) as exc:
        raise ProtocolError(f"frame body is not valid msgpack: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame body must be a msgpack map")
    return obj


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    """The next frame of a blocking socket, decoded (tests and benches that speak the
    protocol by hand); ProtocolError when the peer closes mid-frame."""
    def exactly(n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                raise ProtocolError("the peer closed the socket mid-frame")
            out += chunk
        return bytes(out)
    return unpack(exactly(LENGTH.unpack(exactly(4))[0]))


def error_reply(req_id: Any, exc: KvtierError) -> dict[str, Any]:
    return {"id": req_id, "ok": False, "error": {"code": exc.code, "message": str(exc)}}


def raise_for(reply: dict[str, Any]) -> dict[str, Any]:
    """Re-raise an error reply as its kvtier exception type; return ok replies."""
    if reply.get("ok"):
        return reply
    err = reply.get("error") or {}
    cls = BY_CODE.get(err.get("code", ""), KvtierError)
    raise cls(err.get("message", "unknown error"))


# ---------------------------------------------------------------------- argument helpers

def arg(req: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """A typed argument; BadRequest naming it when missing or of the wrong type."""
    if name not in req:
        if default is ...:
            raise BadRequest(f"missing argument {name!r}")
        return default
    value = req[name]
    if isinstance(value, bool) and kind is int:
        raise BadRequest(f"argument {name!r} must be an integer")
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise BadRequest(f"argument {name!r} must be {names}, got {type(value).__name__}")
    return value


def array_arg(req: dict[str, Any], name: str, dtype: str, default: Any = ...) -> np.ndarray | None:
    raw = arg(req, name, bytes, default)
    if raw is None:
        return None
    dt = np.dtype(dtype)
    if len(raw) % dt.itemsize:
        raise BadRequest(f"argument {name!r} is {len(raw)} bytes, not a whole number of "
                         f"{dt.itemsize}-byte items")
    return np.frombuffer(raw, dtype=dt)


def arr(a: np.ndarray, dtype: str) -> bytes:
    return np.ascontiguousarray(a, dtype=np.dtype(dtype)).tobytes()
