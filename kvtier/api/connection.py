"""One worker's connection to the service: frames cut from the byte stream, answered in order.

The server (kvtier.api.server) dispatches each frame; this module owns the transport: framing,
backpressure, the reply written (with a namespace's fd passed by SCM_RIGHTS where the reply
carries one) and the error reply of an op that raised.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from kvtier.api import protocol as P
from kvtier.api.quota import ClientInfo
from kvtier.errors import BadRequest, KvtierError, ProtocolError

if TYPE_CHECKING:
    from kvtier.api.server import Server

log = logging.getLogger("kvtier.server")
# A parked connection (an op on a thread) stops reading beyond this many buffered bytes.
PARK_BYTES = 4 << 20

Reply = tuple[dict[str, Any], "int | None", str]


class Later:
    """Server._dispatch's answer for a long request (Server._long): its dispatch, to be run as
    a slice of the server's step queue rather than at once."""

    __slots__ = ("dispatch",)

    def __init__(self, dispatch: Callable[[], "Reply | Awaitable[Reply]"]) -> None:
        self.dispatch = dispatch


def ok_reply(result: dict[str, Any], req_id: Any, op: str) -> Reply:
    fd = result.pop("_fd", None)
    return {**result, "id": req_id, "ok": True}, fd, op


def failed_reply(exc: Exception, req_id: Any, op: str) -> Reply:
    """The error reply for an op that raised. kvtier errors keep their type; arguments that
    decode but make no sense (negative counts, wrong shapes) are bad requests; anything else is
    a bug of ours, logged, and answered as an internal error rather than killing the
    connection."""
    if isinstance(exc, KvtierError):
        return P.error_reply(req_id, exc), None, op
    if isinstance(exc, (ValueError, TypeError, OverflowError)):
        return P.error_reply(req_id, BadRequest(f"bad arguments for {op}: {exc}")), None, op
    log.error("op %s failed", op, exc_info=exc)
    return P.error_reply(req_id, KvtierError(f"internal error in {op}: {exc!r}; the service "
                                             "logged it, please report it")), None, op



class Connection(asyncio.Protocol):
    """One worker's connection. Frames are cut from the byte stream in data_received and
    answered in order: an op that completes inline is answered before the next frame is read;
    one that needs a thread parks the connection (later frames wait in the buffer, and reading
    pauses beyond PARK_BYTES) until its reply is written. A long request (Server._long: a get,
    reserve, commit or lookup of more than a few keys) parks it too, until its dispatch's turn
    in the server's step queue (kvtier.api.steps): so the short requests of every connection
    read in the same poll are answered first (issue 17's stall: beside 8 NVMe readers the
    probe's single get waited ~90 us for the readers' frames read ahead of it). An
    asyncio.Protocol rather than streams: a single-block get then costs no coroutine, task or
    future on the loop (bench/api.py: p50 of a single get, docs/DESIGN-NOTES.md)."""

    def __init__(self, server: "Server") -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.client: ClientInfo | None = None
        self.buf = bytearray()
        self.task: asyncio.Task | Later | None = None    # a reply in flight, or a turn
        self.write_paused = False
        self.read_paused = False
        self.closed = False
        self.eof = False
        self.fd = -1                    # the socket's (Server._watch_frames), -1 unwatched

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport            # type: ignore[assignment]
        self.client = self.server._connection_made(self)

    def connection_lost(self, exc: Exception | None) -> None:
        # A reply in flight is not cancelled: it finishes (its engine call holds or releases
        # what it must, its error is retrieved) and _finish drops it unwritten.
        self.closed = True
        self.server.buffered -= len(self.buf)
        self.buf.clear()
        self.server._connection_lost(self)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._process()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.buf += data
        server = self.server
        server.buffered += len(data)
        server.busy.touch(frame=True)
        self._process()
        if server.buffered > server.settings.max_buffered and self.buf and not self.closed:
            # Half-sent frames of every connection together stay under max_buffered: the one
            # that passes it goes (issue 20: each could hold max_frame).
            self._refuse(f"partly received frames of all connections exceed max_buffered "
                         f"({server.settings.max_buffered} bytes); closing this one: send "
                         "smaller frames or raise max_buffered")

    def _refuse(self, message: str) -> None:
        self.transport.write(P.pack(P.error_reply(None, ProtocolError(message))))
        self.closed = True
        self.server.buffered -= len(self.buf)
        self.buf.clear()
        self.transport.close()

    def eof_received(self) -> bool:
        """The peer shut its write side: answer what it sent, then close (True keeps the
        transport open until then)."""
        self.eof = True
        self._process()
        return True

    def _busy(self) -> bool:
        return self.task is not None or self.write_paused or self.closed

    def _process(self) -> None:
        buf = self.buf
        max_frame = self.server.settings.max_frame
        while not self._busy() and len(buf) >= 4:
            (n,) = P.LENGTH.unpack_from(buf)
            if n > max_frame:
                self._refuse(f"frame of {n} bytes exceeds max_frame {max_frame}; closing")
                return
            if len(buf) < 4 + n:
                break
            body = bytes(buf[4:4 + n])
            del buf[:4 + n]
            self.server.buffered -= 4 + n
            t0 = time.perf_counter()
            out = self.server._dispatch(self.client, body, self.fd)
            if type(out) is Later:
                # A long request: dispatched as a slice of the server's step queue, after the
                # frames of this poll (short ones are answered here) and the slices queued
                # before it. The connection stays busy until then: its replies keep their
                # order.
                self.task = out
                self.server.steps.later(partial(self._later, out, t0))
            else:
                self._answer(out, t0)
        if self.eof and not self._busy():
            self.closed = True
            self.transport.close()            # after the replies already written
            return
        # Backpressure: stop reading while parked with a full buffer, or while the peer is not
        # reading its replies.
        want_pause = self._busy() and len(buf) > PARK_BYTES
        if want_pause != self.read_paused and not self.closed:
            self.read_paused = want_pause
            (self.transport.pause_reading if want_pause else self.transport.resume_reading)()

    def _answer(self, out: Reply | Awaitable[Reply], t0: float) -> None:
        if isinstance(out, tuple) and (out[1] is None
                                       or not self.transport.get_write_buffer_size()):
            self._write(out, t0)
        else:
            self.task = self.server._spawn(self._finish(out, t0),
                                           name=f"reply-{self.client.cid}")

    def _later(self, later: "Later", t0: float) -> None:
        """A long request's turn (StepRunner.later). It runs even when its peer went
        meanwhile, as it would have in data_received (a commit the worker sent before it
        closed still lands); _finish then ends what it made (release_owner) unwritten."""
        self.task = None
        out = later.dispatch()
        if self.closed:
            self.task = self.server._spawn(self._finish(out, t0),
                                           name=f"reply-{self.client.cid}")
            return
        self._answer(out, t0)
        self._process()

    async def _finish(self, out: Reply | Awaitable[Reply], t0: float) -> None:
        try:
            reply = out if isinstance(out, tuple) else await out
            if reply[1] is not None:
                while self.transport.get_write_buffer_size() and not self.closed:
                    await asyncio.sleep(0.001)    # the fd must follow the bytes before it
            if self.closed:
                # The peer went before its reply (a worker that died mid-get resets the
                # socket): connection_lost's release_owner may have run before this op made
                # its lease, which would pin its slots until lease_timeout. End it now.
                await self.server._run(self.server.engine.release_owner, self.client.cid)
                return
            self._write(reply, t0)
        except asyncio.CancelledError:
            return
        except Exception:
            log.exception("request failed; closing the connection")
            self.transport.close()
            return
        finally:
            self.task = None
        self._process()

    def _write(self, reply: Reply, t0: float) -> None:
        body, fd, op = reply
        self.server._finished(self.client, op, t0, bool(body.get("ok")))
        self.server.busy.touch()              # the worker's next request follows this reply
        data = P.pack(body)
        if fd is None:
            self.transport.write(data)
            return
        # asyncio's transports have no ancillary-data API: sendmsg on a dup of the socket, with
        # the transport's buffer empty (_finish waited for it) so that bytes stay in order.
        raw = socket.socket(fileno=os.dup(self.transport.get_extra_info("socket").fileno()))
        try:
            sent = socket.send_fds(raw, [data], [fd])
        except (BlockingIOError, InterruptedError):
            sent = 0
            log.warning("could not pass a namespace fd: the socket was full")
        except OSError:
            self.transport.close()
            return
        finally:
            raw.close()
        if sent < len(data):
            self.transport.write(data[sent:])
