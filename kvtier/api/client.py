"""The synchronous client: ``kvtier.Client``.

    with kvtier.Client() as c:
        ns = c.namespace("llama3-8b/tp0", block_bytes=65536)
        ns.put(keys, blocks, parents=parents)       # keys: n x 16 bytes packed, or a list
        found, data = ns.get(keys)                   # data: (n, block_bytes) uint8
        n = ns.match_prefix(keys)

Data path. ``namespace()`` maps the namespace's shared host segment once (its fd arrives over
SCM_RIGHTS); from then on put writes straight into reserved slots and get copies straight out of
leased slots, and only keys, slot numbers, versions and checksums cross the socket. Where the
service refuses the mapping (another uid) or ``inline=True`` is asked for, bytes travel inside
the frames instead: correct, but each byte is copied twice more and msgpack-framed, so expect a
third or less of the mapped throughput (bench/api.py measures both).

Verification. The service hashes every block (xxh3-64) at commit and checks that hash on every
read from NVMe or Redis. Workers map committed slots read-only (kvtier.api.segment), so a
stray write in a worker faults instead of changing another's block. Hence:

- put, ``verify=True`` (the default): the worker sends the hash of each block it wrote, and the
  service refuses the commit if a slot does not hash to it (a torn or short write);
- get, ``verify=False`` (the default): the copy is not re-hashed; ``verify=True`` re-hashes it
  and raises ChecksumError on a mismatch, which only a process that maps the segment afresh
  and writes it on purpose could cause. It costs about a fifth of a mapped get's throughput
  on the dev VM (bench/api.py get_gbps against get_verify_gbps).

Leases. ``get`` releases its lease once the bytes are copied (the release is pipelined, not
waited for). ``get_leased`` returns a Lease whose ``views`` point into shared memory, valid until
``release()`` or the end of a ``with`` block.

Failures raise kvtier.errors types. Restarts: each call first checks that the service has not
closed the connection (one poll(0)) and reconnects if it has, so the first call after a
``kvtier serve`` restart succeeds, and namespaces remap on their next use. A connection lost
during a call is retried once, on a new connection, for the ops that allow it
(kvtier.api.reconnect); the others raise ServiceUnavailable (the next call reconnects), or
PutOutcomeUnknown where a put had been sent and not answered: those blocks may or may not be
stored, and are never put again blindly. Not thread-safe: use one Client per thread.
"""

from __future__ import annotations

import array
import logging
import os
import select
import socket
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.api import hostpages, pipeline
from kvtier.api import protocol as P
from kvtier.api.buffers import blocks_view, checksums, pack_keys
from kvtier.api.handles import GetReply, Lease, NamespaceHandle, PrefixHit, copy_out
from kvtier.api.layouts import Pages
from kvtier.api.reconnect import PUT_OPS, connection_lost, hung_up, retry_safe
from kvtier.config import Settings
from kvtier.errors import (BadRequest, ChecksumError, KvtierError, PutOutcomeUnknown,
                           ServiceUnavailable)
from kvtier.gpu.device import is_cuda_target

_RECV = 1 << 20
_CMSG = socket.CMSG_SPACE(4 * array.array("i").itemsize)   # room for the fds of one reply

log = logging.getLogger("kvtier.client")

# Replies read past (an earlier request's, read while a later one's was waited for) kept for a
# reader that asks later: a CUDA put reads its commits' replies only at wait() (kvtier.gpu.
# transfer.PutTransfer), so any call made meanwhile reads them first. The oldest go beyond this.
READ_PAST_KEEP = 1024


def default_socket() -> str:
    env = os.environ.get("KVTIER_SOCKET")
    if env:
        return env
    data_dir = os.environ.get("KVTIER_DATA_DIR", Settings().data_dir)
    return str(Path(data_dir) / "run" / "kvtier.sock")


class Namespace(NamespaceHandle):
    """A handle on one namespace of a Client. Batch calls; keys packed or as a list."""

    def _view(self) -> np.ndarray:
        if self._stale():
            info, fd = self._client._open_mapped(self.name)
            self._hbm_info = info.get("hbm")
            return self._attach(info["map_bytes"], fd)
        return self._arr

    def _gpu(self, tier: str = "host") -> Any:
        """The device-side view of tier's slots: the mapped, registered host segment, or the
        service's HBM pool opened by CUDA IPC (tier="hbm")."""
        self._view()
        if tier == "host" and self._mapped is not None:
            return self._mapped          # the latency case: no import, no checks
        from kvtier.gpu.slots import IpcPool, MappedSegment
        if tier == "hbm":
            if not self._hbm_info:
                raise BadRequest(f"namespace {self.name!r} has no HBM tier on this service; "
                                 "start it with hbm_capacity on a CUDA host, or use tier='host'")
            if self._ipc is None:        # _attach drops it with the mapping of its connection
                self._ipc = IpcPool(self._hbm_info, self.block_bytes)
            return self._ipc
        if tier != "host":
            raise BadRequest(f"tier must be 'host' or 'hbm', not {tier!r}")
        if self._mapped is None:         # _attach drops it with the mapping it registered
            self._mapped = MappedSegment(self._seg.gpu_view())
        return self._mapped

    def put(self, keys: Any, blocks: Any, parents: Any = None, verify: bool = True,
            rows: np.ndarray | None = None, tier: str = "host") -> np.ndarray:
        """Store blocks under keys (two-phase: reserve, write, commit). Returns new versions.

        ``blocks`` may be CUDA memory (a tensor of rows, ``rows[i]`` for key i, default
        0..n-1, or Pages over CUDA tensors): put_async, waited; the checksums are computed on
        the GPU and sent with the commit (``verify`` applies to host inputs). With tier="hbm"
        the slots are in the service's HBM pools (device to device); the service writes the
        blocks through to host memory at commit.
        """
        kb = pack_keys(keys, self.key_width)
        n = len(kb) // self.key_width
        if is_cuda_target(blocks):
            return self._put_cuda(kb, n, blocks, parents, rows, tier)
        if tier != "host":
            raise BadRequest("tier='hbm' takes CUDA tensors; host data goes to the host tier")
        if rows is not None or isinstance(blocks, Pages):
            return hostpages.put(self, kb, n, blocks, parents, rows, verify)
        src = blocks_view(blocks, n, self.block_bytes)
        pb = None if parents is None else pack_keys(parents, self.key_width)
        c = self._client
        c._ensure()
        if self.inline:
            r = c._call("put", ns=self.name, keys=kb, data=src.tobytes(), parents=pb)
            return np.frombuffer(r["versions"], "<u8")
        self._view()                     # mapped (and remapped after a restart) before reserve
        if len(pipeline.chunks(n)) > 1:
            def write(slots: np.ndarray, lo: int, hi: int) -> bytes | None:
                self._write(slots, src[lo:hi])
                return P.arr(checksums(src[lo:hi]), "<u8") if verify else None
            return pipeline.put(self, kb, n, pb, write)
        r = c._call("reserve", ns=self.name, keys=kb, parents=pb)
        rid = r["rid"]
        try:
            self._write(np.frombuffer(r["slots"], "<i4"), src)
            sums = P.arr(checksums(src), "<u8") if verify else None
        except BaseException:
            c._call("abort", rid=rid)
            raise
        r = c._call("commit", rid=rid, checksums=sums)
        return np.frombuffer(r["versions"], "<u8")

    def _put_cuda(self, kb: bytes, n: int, blocks: Any, parents: Any,
                  rows: np.ndarray | None, tier: str = "host") -> np.ndarray:
        """The blocking put from CUDA memory: put_async on torch's current stream, waited."""
        from kvtier.gpu.transfer import put_async
        pb = None if parents is None else pack_keys(parents, self.key_width)
        return put_async(self, kb, n, blocks, pb, rows, None, tier, None).wait()

    def _get_cuda(self, kb: bytes, n: int, out: Any, rows: np.ndarray | None,
                  tier: str = "host") -> np.ndarray:
        """The blocking get into CUDA memory: get_async on torch's current stream, waited
        (one block from the host tier: get_one, the latency case)."""
        from kvtier.gpu.transfer import get_async, get_one
        if n == 1 and tier == "host":
            found = get_one(self, kb, out, rows)
            if found is not None:
                return found
        return get_async(self, kb, n, out, rows, None, tier, None).wait()

    def get_async(self, keys: Any, out: Any, rows: np.ndarray | None = None,
                  stream: Any = None, tier: str = "host", layers: int | None = None) -> Any:
        """Enqueue a get into CUDA memory on ``stream`` and return at once (kvtier.gpu.transfer).

        ``out``: a CUDA tensor of rows (block i into row rows[i]; vLLM's BLHNC buffer) or a
        kvtier.api.layouts.Pages over CUDA tensors (block i into engine block rows[i] of every
        page: vLLM's per-layer caches). ``stream``: torch or cupy stream, or a cudaStream_t
        (default: torch's current stream). ``layers``: complete in that many page groups, each
        with its own event (``handle.wait_layer(i)``). Returns a handle whose ``wait()`` gives the
        found mask; rows of missing blocks are left untouched. The leases end once the copies
        have completed, seen by ``done()``, ``wait()`` or this namespace's next CUDA call.
        """
        from kvtier.gpu.transfer import get_async
        kb = pack_keys(keys, self.key_width)
        if not is_cuda_target(out):
            raise BadRequest("get_async fills CUDA memory: a CUDA tensor or Pages of CUDA "
                             "tensors; use get() for host memory")
        return get_async(self, kb, len(kb) // self.key_width, out, rows, stream, tier, layers)

    def put_async(self, keys: Any, blocks: Any, parents: Any = None,
                  rows: np.ndarray | None = None, stream: Any = None, tier: str = "host",
                  layers: int | None = None) -> Any:
        """Enqueue a put from CUDA memory on ``stream`` and return at once; the same ``blocks``
        forms as get_async's ``out``. The blocks must not change until the handle's last event
        has completed. The commit is sent once the copies have completed (``done()``,
        ``wait()`` or this namespace's next CUDA call); ``wait()`` returns the new versions. A
        transfer that fails never commits."""
        from kvtier.gpu.transfer import put_async
        kb = pack_keys(keys, self.key_width)
        if not is_cuda_target(blocks):
            raise BadRequest("put_async reads CUDA memory: a CUDA tensor or Pages of CUDA "
                             "tensors; use put() for host memory")
        pb = None if parents is None else pack_keys(parents, self.key_width)
        return put_async(self, kb, len(kb) // self.key_width, blocks, pb, rows, stream, tier,
                         layers)

    def get(self, keys: Any, out: Any = None, verify: bool = False,
            rows: np.ndarray | None = None, tier: str = "host") -> tuple[np.ndarray, Any]:
        """Copy the blocks of keys into out (or a new (n, block_bytes) array).

        Returns (found mask, out as a uint8 array view). Missing blocks leave zeroed rows.
        ``out`` may be CUDA memory (a tensor of rows or Pages, as get_async takes): get_async,
        waited (``rows[i]`` for key i, default 0..n-1; missing blocks leave their rows
        untouched).
        The slots were checksummed at commit and cannot change while leased; ``verify=True``
        re-hashes the copy (host outputs only; see the module docstring). With tier="hbm" (CUDA
        outputs) the service leases the blocks in its HBM pool, bringing up the ones that are
        not there yet, and the gather runs device to device.
        """
        kb = pack_keys(keys, self.key_width)
        n = len(kb) // self.key_width
        if out is not None and is_cuda_target(out):
            return self._get_cuda(kb, n, out, rows, tier), out
        if tier != "host":
            raise BadRequest("tier='hbm' fills CUDA tensors; host outputs come from the host "
                             "tier")
        if rows is not None or isinstance(out, Pages):
            if out is None:
                raise BadRequest("rows= names rows of out: pass out as well")
            return hostpages.get(self, kb, n, out, rows, verify), out
        dst = (np.empty((n, self.block_bytes), dtype=np.uint8) if out is None
               else blocks_view(out, n, self.block_bytes, writable=True))
        c = self._client
        c._ensure()
        if self.inline:
            r = c._call("get", ns=self.name, keys=kb, inline=True)
            rep = GetReply.decode(r)
            dst[:] = np.frombuffer(r["data"], np.uint8).reshape(n, self.block_bytes)
            if verify and rep.found.any():
                idx = np.flatnonzero(rep.found)
                if (checksums(dst[idx]) != rep.checksums[idx]).any():
                    raise ChecksumError("inline blocks did not match their checksums")
            return rep.found, dst
        view = self._view()
        if len(pipeline.chunks(n)) > 1:
            def move(rep: GetReply, lo: int) -> None:
                copy_out(view, rep, dst[lo:lo + rep.found.size], verify)
            return pipeline.get(self, kb, n, move), dst
        rep = GetReply.decode(c._call("get", ns=self.name, keys=kb))
        try:
            copy_out(view, rep, dst, verify)
        finally:
            c._release_later(rep.lease)
        return rep.found, dst

    def get_leased(self, keys: Any) -> Lease:
        """Lease the blocks in place (zero-copy): read lease.views, then release()."""
        if self.inline:
            raise BadRequest("get_leased needs the mapped data path; this handle is inline")
        self._client._ensure()
        self._view()
        kb = pack_keys(keys, self.key_width)
        return Lease(self, GetReply.decode(self._client._call("get", ns=self.name, keys=kb)))

    def match_prefix(self, keys: Any) -> int:
        """How many leading keys are held (in any tier)."""
        return self.lookup(keys).n

    def lookup(self, keys: Any, stage: bool = False) -> "PrefixHit":
        """match_prefix, and how many of the hit only NVMe or Redis hold (a get of those
        reads the disk or the network). stage=True: the service starts bringing those up to
        its host tier at once, in the background, so that a get soon after copies memory."""
        self._client._ensure()
        r = self._client._call("match_prefix", ns=self.name,
                               keys=pack_keys(keys, self.key_width), stage=stage)
        return PrefixHit(int(r["n"]), int(r["below"]))

    def delete(self, keys: Any) -> int:
        self._client._ensure()
        return int(self._client._call("delete", ns=self.name,
                                      keys=pack_keys(keys, self.key_width))["deleted"])

    def flush(self) -> int:
        self._client._ensure()
        return int(self._client._call("flush", ns=self.name)["flushed"])

class Client:
    """A connection to `kvtier serve`. See the module docstring."""

    def __init__(self, path: str | os.PathLike | None = None, timeout: float = 30.0,
                 name: str = "", connect: bool = True, spin_us: float = 1000.0) -> None:
        self.path = str(path or default_socket())
        self.timeout = timeout
        self.spin_us = spin_us
        self._recent_wait_us = spin_us / 2
        self.name = name or f"pid-{os.getpid()}"
        self.generation = 0
        self.release_errors = 0
        self.orphaned_replies = 0       # replies read before their caller asked (_orphan)
        self._sock: socket.socket | None = None
        self._buf = bytearray()
        self._rview = memoryview(bytearray(_RECV))
        self._fds: list[int] = []
        self._next = 0
        self._discard: set[int] = set()
        self._pending: list[int] = []
        self._puts_sent: set[int] = set()   # ids of put/commit requests not answered yet
        self._stash_ids: set[int] = set()   # requests whose replies are kept when read past
        self._stashed: dict[int, dict[str, Any]] = {}    # ... and those replies (credits)
        self._read_past: dict[int, dict[str, Any]] = {}  # replies read before asked (_orphan)
        self._namespaces: dict[str, Namespace] = {}
        self.server_info: dict[str, Any] = {}
        if connect:
            self.connect()

    # ------------------------------------------------------------------ connection

    def connect(self) -> None:
        self.close_socket()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise ServiceUnavailable(f"cannot connect to kvtier at {self.path}: {exc.strerror}; "
                                     "is `kvtier serve` running?") from None
        sock.setblocking(False)            # waits are ours: a short spin, then poll (_wait)
        self._sock = sock
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self.generation += 1
        self.server_info = self._reply(self._send(
            "hello", {"version": P.PROTOCOL_VERSION, "client": self.name}))

    def close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._buf.clear()
        self._discard.clear()
        # Replies read past stay for their readers (a reply read is what the service did; ids
        # are not reused), and a put left unanswered tells a reader that asks later that its
        # outcome is unknown (a CUDA put's commits: kvtier.gpu.transfer.PutTransfer.wait).
        for pid in self._puts_sent:
            self._keep(pid, P.error_reply(pid, connection_lost(
                self.path, f"the connection went before request {pid}'s reply", 1)))
        self._puts_sent.clear()
        self._stash_ids.clear()
        self._stashed.clear()
        self._pending.clear()           # the service ends them when the connection goes
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def close(self) -> None:
        if self._pending and self._sock is not None:
            try:                        # not _call: a lost connection is not worth a new one
                self._reply(self._send("hello", {"version": P.PROTOCOL_VERSION,
                                                 "client": self.name}))
            except KvtierError:
                pass                    # closing anyway; the service releases on disconnect
        for ns in self._namespaces.values():
            ns.close()
        self.close_socket()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ frames

    def _ensure(self) -> None:
        """Reconnect if the connection was lost or the service closed it (it stopped or
        restarted since the last call). Here, before a call, since a namespace's mapping must
        be refreshed (Namespace._view) before slots of a new service are used; inside a call
        only the ops kvtier.api.reconnect allows reconnect (_call)."""
        if self._sock is not None and hung_up(self._poll):
            self.close_socket()
        if self._sock is None:
            self.connect()

    def _lost(self, why: str) -> ServiceUnavailable:
        """Close the lost connection; the error to raise for it (connection_lost)."""
        puts = len(self._puts_sent)
        self.close_socket()
        return connection_lost(self.path, why, puts)

    def _send(self, op: str, args: dict[str, Any], piggyback: bool = True) -> int:
        """Send one request; returns its id. Queued releases ride on it unless piggyback is
        False (the service ends them before the op, so a pipelined batch puts them on its
        last request, behind the chunks the caller waits for first)."""
        if self._sock is None:
            raise ServiceUnavailable(f"not connected to kvtier at {self.path}")
        self._next += 1
        body = {"id": self._next, "op": op, **{k: v for k, v in args.items() if v is not None}}
        if self._pending and piggyback:
            body["release_first"] = struct.pack(f"<{len(self._pending)}Q", *self._pending)
            self._pending.clear()
        self._sendall(P.pack(body))
        if op in PUT_OPS:
            self._puts_sent.add(self._next)
        return self._next

    def _sendall(self, frame: bytes) -> None:
        try:
            sent = self._sock.send(frame)      # a request fits the socket's buffer: one call
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise self._lost(str(exc)) from None
        if sent == len(frame):
            return
        view = memoryview(frame)[sent:]
        deadline = time.monotonic() + self.timeout
        try:
            while view:
                try:
                    view = view[self._sock.send(view):]
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    out = select.poll()       # poll, not select: no FD_SETSIZE limit
                    out.register(self._sock, select.POLLOUT)
                    if left <= 0 or not out.poll(left * 1000):
                        raise self._lost(f"it did not take a request within "
                                         f"{self.timeout} s") from None
        except OSError as exc:
            raise self._lost(str(exc)) from None

    def _wait(self) -> None:
        """Until the socket is readable. Spins first: on the dev VM a reply that wakes a
        sleeping client costs ~30 us more than one it is spinning for (a hello round trip of
        48 us against 18 us), and a worker waiting on its KV blocks has nothing else to run.
        The spin lasts twice the recent waits (at least 50 us, at most spin_us): long enough
        for the reply that is on its way, not a millisecond of a core for a slow one, where
        30 us matter less. Then poll() with the call's timeout. Returns at once, counting no
        wait, when the socket is readable already (pipelined replies)."""
        if self._poll.poll(0):
            return
        t0 = time.perf_counter()
        if self.spin_us > 0:
            end = t0 + min(self.spin_us, max(50.0, 2.0 * self._recent_wait_us)) * 1e-6
            while time.perf_counter() < end:
                if self._poll.poll(0):
                    self._note_wait(t0)
                    return
        if not self._poll.poll(self.timeout * 1000):
            raise self._lost(f"no reply within {self.timeout} s")
        self._note_wait(t0)

    def _note_wait(self, t0: float) -> None:
        waited = (time.perf_counter() - t0) * 1e6
        self._recent_wait_us = 0.8 * self._recent_wait_us + 0.2 * waited

    def _send_nowait(self, op: str, **args: Any) -> None:
        """Send a request whose reply is read and dropped later (pipelined)."""
        self._discard.add(self._send(op, args))

    def _stash(self, req_id: int) -> None:
        """Keep req_id's reply when a later reply is waited for (pipelined, read in order):
        _stashed_reply() hands it over, ok or not (a credit's ask, kvtier.api.credits)."""
        self._stash_ids.add(req_id)

    def _stashed_reply(self, req_id: int, wait: bool = False) -> dict[str, Any] | None:
        """The stashed reply of req_id; when it has not been read yet, None, or with wait the
        reply itself, read now (the replies before it read as _reply reads them)."""
        if req_id in self._stashed or not wait:
            return self._stashed.pop(req_id, None)
        self._stash_ids.discard(req_id)
        return self._reply(req_id, raw=True)

    def _release_later(self, lease: int) -> None:
        """Queue a lease to be released by the next request (``release_first``), saving the
        service one op per get. Sent at once when many are queued, and on close."""
        self._pending.append(lease)
        if len(self._pending) >= 64:
            self._send_nowait("release", lease=self._pending.pop(0))

    def _recv_frame(self) -> dict[str, Any]:
        ready = False
        while True:
            if len(self._buf) >= 4:
                (n,) = P.LENGTH.unpack_from(self._buf)
                if len(self._buf) >= 4 + n:
                    body = bytes(self._buf[4:4 + n])
                    del self._buf[:4 + n]
                    frame = P.unpack(body)
                    if self._puts_sent:
                        self._puts_sent.discard(frame.get("id"))
                    return frame
            if not ready:
                # Wait first, then read: a reply is never there the moment a request went out,
                # and a recv that finds nothing raises BlockingIOError (a few us of Python).
                self._wait()
            try:
                # Into a buffer kept across calls: recvmsg(1 MiB) allocates a fresh 1 MiB
                # object per call, which cost ~30 us a call on the dev VM (a 12 us round trip
                # became 42 us).
                got, anc, _flags, _addr = self._sock.recvmsg_into([self._rview], _CMSG)
            except BlockingIOError:
                ready = False
                continue
            except OSError as exc:
                raise self._lost(str(exc)) from None
            ready = got == len(self._rview)     # a full buffer: more may be waiting at once
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                    self._fds.extend(fds)
            if not got:
                raise self._lost("it closed the connection")
            self._buf += self._rview[:got]

    def _call(self, op: str, **args: Any) -> dict[str, Any]:
        """One request and its reply; RETRY_SAFE ops are sent once more, on a new connection,
        if the connection is lost during the call."""
        try:
            return self._reply(self._send(op, args))
        except ServiceUnavailable as exc:
            # A reply that says unavailable leaves the connection up: not a lost connection.
            if (self._sock is not None or not retry_safe(op, args)
                    or isinstance(exc, PutOutcomeUnknown)):
                raise
        self.connect()
        return self._reply(self._send(op, args))

    def _reply(self, req_id: int, raw: bool = False) -> dict[str, Any]:
        """The reply to request req_id (sent earlier, pipelined or not), re-raised as its
        kvtier exception if it is an error (raw: returned as it is). Replies come in request
        order."""
        if self._read_past:
            early = self._read_past.pop(req_id, None)
            if early is not None:           # read past by an earlier call (_orphan)
                return early if raw else P.raise_for(early)
        if self._sock is None:              # a reader after the connection went
            raise ServiceUnavailable(f"not connected to kvtier at {self.path}: the connection "
                                     f"went before request {req_id}'s reply was read")
        while True:
            try:
                reply = self._recv_frame()
            except ServiceUnavailable:
                self._read_past.pop(req_id, None)   # (close_socket's note: this call raises)
                raise
            rid = reply.get("id")
            if raw and rid == req_id:
                return reply
            if rid in self._discard:
                self._discard.discard(rid)
                if not reply.get("ok"):
                    self.release_errors += 1
                continue
            if rid in self._stash_ids:
                self._stash_ids.discard(rid)
                self._stashed[rid] = reply
                continue
            if isinstance(rid, int) and rid < req_id:
                self._orphan(rid, reply)
                continue
            if rid != req_id:
                raise P.raise_for(reply) if not reply.get("ok") else KvtierError(
                    f"reply for request {rid} while waiting for {req_id}")
            return P.raise_for(reply)

    def _orphan(self, rid: int, reply: dict[str, Any]) -> None:
        """An earlier request's reply, read while a later one's is waited for (replies come in
        order, so it is not the awaited one). Its reader may still ask (a CUDA put reads its
        commits' replies at wait()): the reply is kept for it (READ_PAST_KEEP). What it grants
        goes back at once instead of at its timeout (a lease released, a reservation or
        credit aborted, a mapped open's fd closed), since a caller that left it unread may
        never come (a bug); a reader that does come then gets an error, never slots that are
        no longer its own."""
        self.orphaned_replies += 1
        held = self._give_back(reply)
        if held:
            log.warning("kvtier: reply to request %d read with no caller waiting for it; its "
                        "%s is given back", rid, held)
            reply = P.error_reply(rid, KvtierError(
                f"the reply to request {rid} was read before this call asked for it, and its "
                f"{held} was given back then"))
        self._keep(rid, reply)

    def _keep(self, rid: int, reply: dict[str, Any]) -> None:
        """Keep rid's reply for its reader (_reply looks here first), at most READ_PAST_KEEP."""
        self._read_past[rid] = reply
        if len(self._read_past) > READ_PAST_KEEP:
            old = next(iter(self._read_past))
            lost = self._read_past.pop(old)
            log.warning("kvtier: reply to request %d (%s) was never asked for; dropped", old,
                        "ok" if lost.get("ok") else "error")

    def _give_back(self, reply: dict[str, Any]) -> str:
        """End what an ok reply grants (_orphan); what it was, or "" for nothing."""
        if not reply.get("ok"):
            return ""
        if "map_bytes" in reply:
            # Its memory fd came with it (the same sendmsg), first in _fds: _open_mapped pops
            # them in reply order, so one left there would map the next namespace's view on
            # this one's memory.
            if self._fds:
                os.close(self._fds.pop(0))
            return "memory fd"
        lease, rid = reply.get("lease"), reply.get("rid")
        if type(lease) is int and lease:
            self._release_later(lease)
            return "lease"
        if type(rid) is int and "slots" in reply:            # a reservation or a credit
            self._send_nowait("abort", rid=rid)
            return "reservation"
        return ""

    def _open_mapped(self, name: str) -> tuple[dict[str, Any], int]:
        info = self._call("ns_open", name=name, map=True)
        if not self._fds:
            # The fd travels in the same sendmsg as the reply, so it is here by now.
            raise ServiceUnavailable("the namespace's memory fd did not arrive with the reply")
        return info, self._fds.pop(0)

    # ------------------------------------------------------------------ API

    def namespace(self, name: str, block_bytes: int | None = None, key_width: int = 16,
                  layout: dict[str, Any] | None = None, inline: bool = False) -> Namespace:
        """Open (with block_bytes: create or open) a namespace. inline=True: no shared memory.
        A layout, where given, must equal the stored one (NamespaceError otherwise)."""
        self._ensure()
        if block_bytes is not None:
            info = self._call("ns_create", name=name, block_bytes=block_bytes,
                              key_width=key_width, layout=layout)
        else:
            info = self._call("ns_open", name=name, layout=layout)
        ns = Namespace(self, info, inline)
        if not inline:
            ns._view()
        self._namespaces[name] = ns
        return ns

    def stats(self) -> dict[str, Any]:
        self._ensure()
        return self._call("stats")

    def flush(self) -> int:
        self._ensure()
        return int(self._call("flush")["flushed"])

    def ping(self) -> float:
        """Seconds for one hello round trip."""
        self._ensure()
        t0 = time.perf_counter()
        self._call("hello", version=P.PROTOCOL_VERSION, client=self.name)
        return time.perf_counter() - t0
