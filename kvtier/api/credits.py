"""Credits: host slots a writer holds before it knows its next put's keys (issue 16).

A put from CUDA memory cannot start a copy before it knows where the bytes go, and on the
H200 the first reserve's reply came ~0.5 ms after its send (bench/put_timeline.py: the first
copy at 0.79 ms of a 6.2 ms put of 4,096 x 64 KiB; 0.76 of 2.4 ms at 16 KiB). A credit is a
reservation made by count (``reserve {ns, count}``, Puts.reserve_credit), asked for during one
put and used by the next: its first copies go into the credit's slots at once, while the
service answers the reserves of the rest, and the commit of that first chunk names its keys
(``commit {rid, keys, parents?}``; the credit's slots it does not use go back then).

Nothing about the rules changes: a credit is a reservation (fresh slots, pinned, invisible to
readers, counted in the connection's share, expired after reserve_timeout, ended with the
connection), and its commit checks what any commit checks. The writer uses a credit only on
the connection that got it and within half its life, so that the service never reclaims
slots a copy may still be writing; one it will not use it aborts.

Off by default (kvtier.gpu.plan.TransferPolicy.put_credits): on an H100 they bought no offload
throughput at 64 KiB and lost some at 16 KiB (docs/DESIGN-NOTES.md, "Put credits measured").

Memory, where on: one credit per namespace and connection, at most CREDIT_BYTES (and CREDIT_KEYS slots)
pinned in the host tier while the writer is idle. A refused ask (no room, the share) is
tried again only every REFUSED_BACKOFF puts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvtier.errors import KvtierError, ServiceUnavailable

if TYPE_CHECKING:
    from kvtier.api.client import Namespace

CREDIT_BYTES = 64 << 20     # the first chunk's copy (~1.2 ms at 55 GB/s) outlasts a reply
CREDIT_KEYS = 1024          # ... and no more slots than a put's chunk (pipeline.CUDA_PUT_CHUNK)
REFUSED_BACKOFF = 16


@dataclass(slots=True)
class Credit:
    rid: int
    slots: np.ndarray           # int32, the reservation's slots in order
    generation: int             # the client connection it belongs to
    use_by: float               # monotonic: half its life after it was asked for


class Credits:
    """One namespace handle's credit: at most one held and one asked for."""

    def __init__(self, ns: "Namespace") -> None:
        self._ns = ns
        self._held: Credit | None = None
        self._asked: tuple[int, int, float] | None = None    # (request id, generation, sent)
        self._skip = 0

    def size(self) -> int:
        """Slots to ask for: CREDIT_BYTES of blocks, at most CREDIT_KEYS and an eighth of the
        namespace's host slots (the mapped segment's rows)."""
        ns = self._ns
        rows = ns._arr.shape[0] if ns._arr is not None else CREDIT_KEYS
        return max(1, min(CREDIT_KEYS, CREDIT_BYTES // max(1, ns.block_bytes), rows // 8))

    def take(self, wait: bool = False) -> Credit | None:
        """The credit to use now (it is then no longer held), or None: none asked for or
        answered yet (wait: the one asked for, its reply read now), refused, of an earlier
        connection, or past its use-by time (then aborted)."""
        self._collect(wait)
        credit, self._held = self._held, None
        if credit is None:
            return None
        c = self._ns._client
        if credit.generation != c.generation:
            return None                 # its connection went: the service ended it
        if time.monotonic() > credit.use_by:
            c._send_nowait("abort", rid=credit.rid)
            return None
        return credit

    def ask(self) -> None:
        """Ask for the next put's credit, its reply read whenever a later reply is (the
        client stashes it), unless one is held or asked for already."""
        c = self._ns._client
        if self._held is not None or self._asked is not None:
            return
        if self._skip > 0:
            self._skip -= 1
            return
        rid = c._send("reserve", {"ns": self._ns.name, "count": self.size()}, piggyback=False)
        c._stash(rid)
        self._asked = (rid, c.generation, time.monotonic())

    def drop(self, wait: bool = False) -> None:
        """Give the held credit back (the namespace is closed, or a put failed); wait: the
        one asked for too, its reply read now if it has not been."""
        self._collect(wait)
        c = self._ns._client
        if self._held is not None and self._held.generation == c.generation and c._sock:
            try:
                c._send_nowait("abort", rid=self._held.rid)
            except KvtierError:
                pass                    # the connection went: the service ended it
        self._held = None

    def _collect(self, wait: bool = False) -> None:
        """Turn the asked-for credit's stashed reply, if it has come (wait: reading it now),
        into the held one."""
        if self._asked is None:
            return
        rid, gen, sent = self._asked
        c = self._ns._client
        if gen != c.generation or c._sock is None:
            self._asked = None
            return
        while True:
            try:
                reply = c._stashed_reply(rid, wait)
                break
            except ServiceUnavailable:
                self._asked = None      # the connection went: the service ended it
                return
            except KvtierError:
                # An earlier request's error reply, read on the way to this one's and
                # raised (rev11): this reply is still to come, so stash it again (else it
                # breaks a later call, and the credit stays reserved until it expires). Each
                # such error took a frame, so this ends.
                if c._sock is None or c.generation != gen:
                    self._asked = None
                    return
                c._stash(rid)
        if reply is None:
            return                      # not read yet: asked still
        self._asked = None
        if not reply.get("ok"):
            self._skip = REFUSED_BACKOFF
            return
        self._held = Credit(int(reply["rid"]), np.frombuffer(reply["slots"], "<i4"), gen,
                            sent + float(reply["expires_s"]) / 2)
