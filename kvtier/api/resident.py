"""The gets the socket loop answers at once, as a part of the Server (a mixin): blocks already
where the get asks for them, leased inline with the engine lock free, and the piggybacked
releases such a get carries ended after its reply.

Why. A one-key resident host get is the worker API's latency figure (issue 16: a single-block
CUDA get <= 100 us). On the H200 host the general path's glue around the engine cost more than
the engine itself (bench/single_split.py, the same run: the service's dispatch of a one-key get
66-70 us, of which the engine's lease and release 17-22 us; with this path 35-36 us), and the
release of the previous get's lease was part of every reply. An HBM-tier get went to a thread
(its general path may copy host blocks up to the GPU): ~0.1 ms a request there.

Rules kept: replies are the general path's (the same fields and encodings, so no protocol
change); anything these paths do not serve returns None with nothing changed, and the general
path answers; releases are deferred past a reply only behind gets that allocate and evict
nothing, and end after it: on the loop's next iteration (call_soon) when the engine lock is
free then, else on the memory lane, whenever it gets the lock. So they may end after later
requests (see _get_resident_first): a lease held longer keeps its slots from reuse and
eviction, never serves a wrong block; at worst a later allocation finds less room.
"""

from __future__ import annotations

import asyncio
import select
import struct
from typing import Any, Awaitable

from kvtier.api import protocol as P
from kvtier.api.quota import ClientInfo
from kvtier.types import Tier

_I32, _U64 = struct.Struct("<i"), struct.Struct("<Q")

# Set in a get's request by _get_resident when try_get refused its batch (it must read NVMe),
# so that op_get neither looks again nor tries it on the loop. An object, not a string: no
# decoded frame can carry it (and a get marked wrongly would only take its steps).
NEEDS_DISK = object()


class ResidentGets:
    """Server's resident-get paths (self is the Server: engine, settings, _fast, _spawn,
    _run, _run_mem, _get_reply)."""

    def _get_resident_first(self, client: ClientInfo, req: dict[str, Any]
                            ) -> dict[str, Any] | None:
        """A get whose blocks are all where it asks for them (host or HBM tier, any number
        of keys) and that carries piggybacked releases (a worker's steady state: each get
        ends the leases of the one before): answered first, and the engine's part of the
        releases runs after the reply is written. Not before every later request: frames of
        this connection already buffered are answered first (an explicit release of one of
        those leases then succeeds, and the piggybacked one is counted as an error), as are
        other connections' frames read in the same loop iteration (all inline, so none
        allocates or evicts); and when the lock is taken by then, the releases wait on the
        memory lane, where any later request, a put's eviction included, may run first and
        find those blocks still leased. Safe for the data because this get evicts and
        allocates nothing, so it cannot need what they hold, and a lease held longer only
        keeps its slots from reuse; the connection's quota count of them ends before it, as
        before. On the H200 host a 1,024-block HBM get
        that carried the release of the one before waited ~0.35 ms for its reply, the same
        get alone 0.11 ms (one run; the release's share was not measured alone). None
        (nothing done) for any other get: then the releases come first, as the protocol
        says."""
        name, keys = req.get("ns"), req.get("keys")
        tier = req.get("tier", "host")
        if (type(name) is not str or type(keys) is not bytes or req.get("inline")
                or tier not in ("host", "hbm")):
            return None
        ids = P.array_arg(req, "release_first", "<u8").tolist()
        client.pins.end(ids)
        try:
            out = self._get_resident(client, name, keys, Tier.HBM if tier == "hbm"
                                     else Tier.HOST, req)
        except BaseException:
            self._end_leases(client, ids)      # the request fails; its releases still count
            raise
        if out is not None:
            asyncio.get_running_loop().call_soon(self._end_leases, client, ids)
        return out

    def _get_resident(self, client: ClientInfo, name: str, keys: bytes, tier: Tier,
                      req: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The reply of a get answered on the loop from blocks resident in tier, or None
        (nothing changed) where the general path must run. A host batch that try_get refused
        (it must move bytes between tiers: an NVMe reader's) is marked NEEDS_DISK in req, so
        that op_get sends it to its steps without looking again (looks_resident: 15-20 us of
        such a reader's frame on the H200 host, in data_received, ahead of any resident get
        read in the same poll: issue 17's stall)."""
        if tier is Tier.HOST:
            out = self._get_one_resident(client, name, keys)
            if out is not None:
                return out
            ns = self.engine.namespaces.get(name)
            if ns is None:
                return None
            client.pins.check(ns, keys, self.settings.max_client_share)
            done, res = self._fast(self.engine.try_get, name, keys, client.cid)
            if done and res is None and req is not None:
                req[NEEDS_DISK] = True
        else:
            done, res = self._fast(self.engine.try_get_resident, name, keys, client.cid, tier)
        if not done or res is None:
            return None
        return self._get_reply(client, name, keys, res, False)

    # ------------------------------------------------------------------ frames waiting
    # StepRunner's frames_waiting: whether a request is waiting in a connection's socket, by
    # one epoll of the connections (level-triggered, zero timeout: ~1 us), so that a get's
    # next locked step lets the loop read it first (kvtier.api.steps).

    def _watch_frames(self, conn: Any) -> None:
        if getattr(self, "_frame_poll", None) is None:
            self._frame_poll = select.epoll()
            self._frame_fds: dict[int, Any] = {}
        fd = conn.transport.get_extra_info("socket").fileno()
        try:
            self._frame_poll.register(fd, select.EPOLLIN)
        except OSError:
            return                  # not watched: its frames only lose their head start
        self._frame_fds[fd] = conn
        conn.fd = fd

    def _unwatch_frames(self, conn: Any) -> None:
        fds = getattr(self, "_frame_fds", {})
        for fd in [fd for fd, c in fds.items() if c is conn]:
            del fds[fd]
            try:
                self._frame_poll.unregister(fd)
            except OSError:
                pass                # closed already: epoll forgot it with the socket

    def _frames_waiting(self, own: int = -1) -> bool:
        """Whether a frame waits in the socket of a connection other than own's (an fd): the
        dispatching connection's own next frames cannot go before it (its replies keep their
        order), so they are no reason to defer it. A GPU put's or get's chunks are sent
        together: its first reserve, which gates the first copy, was deferred a poll in 17-29
        of 40 puts on the dev VM (22-42 us p50 each; off7, bench/put_control.py --later)."""
        poll = getattr(self, "_frame_poll", None)
        if poll is None:
            return False
        return any(fd != own for fd, _ev in poll.poll(0))

    def _close_frames(self) -> None:
        """At the server's shutdown, after its tasks: the frame poll, and the step runner's C
        reader threads (kvtier.api.steps.ReadThreads; no read is in flight by then)."""
        if getattr(self, "_frame_poll", None) is not None:
            self._frame_poll.close()
            self._frame_poll = None
            self._frame_fds = {}
        steps = getattr(self, "steps", None)
        if steps is not None:
            steps.close()

    def _end_leases(self, client: ClientInfo, ids: list[int]) -> None:
        """The engine's part of piggybacked releases, inline when the lock is free, else on
        the memory lane; unknown ids are counted as the connection's errors."""
        done, bad = self._fast(self.engine.release_many, ids, client.cid)
        if done:
            client.errors += bad
            return
        self._spawn(self._count_bad(client, self._run_mem(self.engine.release_many, ids,
                                                          client.cid)), name="release-piggybacked")

    @staticmethod
    async def _count_bad(client: ClientInfo, fut: Awaitable[int]) -> None:
        client.errors += await fut

    def _get_one_resident(self, client: ClientInfo, name: str, keys: bytes
                          ) -> dict[str, Any] | None:
        """The latency case: one key whose block is resident in the host tier, leased inline
        with no numpy array built for the reply (the same reply as _get_reply's). None, with
        nothing changed, for anything else (the general path then answers). On the H200 host
        the general path's glue around the engine cost more than the engine itself
        (bench/single_split.py: dispatch of a one-key get 66 us, the engine's part 22)."""
        ns = self.engine.namespaces.get(name)
        if ns is None or len(keys) != ns.key_width:
            return None
        client.pins.check(ns, keys, self.settings.max_client_share)
        done, hit = self._fast(self.engine.lease_one, ns, keys, client.cid)
        if not done or hit is None:
            return None
        lid, slot, version, checksum = hit
        try:
            if self.engine.wants_prefetch(name, keys) is not False:
                self._spawn(self._run(self.engine.prefetch_after, name, keys))
        except BaseException:
            self.engine.release(lid, client.cid)     # as _get_reply: the id is never sent
            raise
        client.pins.add(lid, name, 1)
        return {"lease": lid, "found": b"\x01", "slots": _I32.pack(slot),
                "versions": _U64.pack(version), "checksums": _U64.pack(checksum)}

