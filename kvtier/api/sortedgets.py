"""Gets answered in slot order, piece by piece, as a part of the Server (a mixin).

Why (issue 16's small-page onboards). A GPU get of thousands of 16 or 64 KiB blocks moves
fastest as a few large copies: one copy-engine copy of a range of consecutive slots into device
staging, and a placement kernel from there (gpu.device.Mover.stage_sorted: 0.96 of H2D for
64 KiB blocks alone on the H200, against 0.87 for one copy per block). That needs each reply's
slots dense, and a worker asks in its own order (a request's blocks, not the service's slots),
so a chunk of its keys is a scatter over the whole pool. Leasing the whole batch in one request
and sorting it on the client put all of the control path (~0.7 ms for 4,096 keys) before the
first byte moved. Here the first request carries piece 0's keys and the cuts of the pieces;
the service answers piece 0 at once, in the keys' own order (the client moves it as a chunk),
and at piece 1 (already sent, with the other keys) orders those keys by their host slot (one
lookup and one C call, no lease: ~40 us for 3,840 keys on the dev VM, while piece 0's copies
run); each later request gets the next piece of that order. So the later pieces are dense
ranges of slots, and the first byte moves as soon as a chunked get's would.

lease13 (issue 16, bench/get_control.py --serve): the order was numpy's, ~90 us in process
and ~0.25 ms of piece 1's ~0.37 in the service (dev VM); and the first request carried every
key, so piece 0's reply waited for the whole batch's frame and its decode.

Protocol (a "get" with these fields; every other field as a get's):

- first request: ``keys`` (piece 0's, or all of them), ``sort`` (the pieces' ends, "<u4",
  strictly increasing, the last the number of keys in all); its reply is piece 0, the first
  keys in order.
- later requests: ``of`` (the first request's id) and ``piece`` (1, 2, ... in order); no keys,
  but piece 1's carry the keys after piece 0's where the first request had piece 0's alone.
- every reply is a get's reply for its piece's keys, plus ``order`` ("<u4"): the positions in
  the first request's keys of the piece's keys, in the order of found, slots and the rest.
- releases piggybacked on any of them (``release_first``) end as on any request, also when
  the request is refused (a later piece of a refused first request is).

The order is a hint taken under the engine lock, or the keys' own order when the lock is busy:
each piece is leased by the get path as any get, so a block moved or rewritten between the
order and its piece is served from where it is then (its piece is less dense, never wrong). The
state of a sorted get lives on the connection until its last piece is asked (at most
MAX_SORTED at once), and goes with the connection.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Awaitable

import numpy as np

from kvtier.api import protocol as P
from kvtier.api.connection import Reply, failed_reply
from kvtier.api.quota import ClientInfo
from kvtier.coherence.fastpath import _fast
from kvtier.errors import BadRequest
from kvtier.types import Tier

MAX_SORTED = 8          # sorted gets in flight on one connection
_HOST = int(Tier.HOST)


@dataclass(slots=True)
class SortedGet:
    """A sorted get between its first and its last piece."""

    name: str
    # The keys after piece 0 (V{key_width}): the first request's, or None until piece 1
    # brings them (a first request of piece 0's keys alone).
    keys: np.ndarray | None
    order: np.ndarray | None    # uint32 positions in keys, by host slot (taken at piece 1)
    ends: list[int]         # 0 and the pieces' ends: piece i >= 1 is order[ends[i] - ends[1]:
    next: int = 1           # ends[i + 1] - ends[1]] + ends[1]; the piece to ask next


def slot_order(engine: Any, name: str, karr: np.ndarray) -> np.ndarray:
    """Positions of karr's keys by their host slot: the keys with a current host copy first,
    by slot, then the others in their own order. Under the engine lock (the caller's). One
    lookup and one C call (_fast.slot_order) where the module is built and the slots are
    dense; else numpy's order, the same positions (slot_order_numpy)."""
    table = engine.namespace(name).table
    rows = table.lookup(karr)
    if _fast is not None:
        out = np.empty(rows.size, dtype=np.uint32)
        cols = table.cols
        if _fast.slot_order(cols["version"], cols["copy_ver"], cols["slot"], rows,
                            table.n_rows, _HOST, out) >= 0:
            return out
    return slot_order_numpy(table, rows)


def slot_order_numpy(table: Any, rows: np.ndarray) -> np.ndarray:
    """slot_order over a lookup's rows, in numpy (the reference, and the sparse case)."""
    n = rows.size
    cols = table.cols
    live = np.flatnonzero(rows >= 0)
    r = rows[live]
    ver = cols["version"][r]
    cur = np.zeros(n, dtype=bool)
    cur[live] = (ver > 0) & (cols["copy_ver"][r, Tier.HOST] == ver)
    at = np.flatnonzero(cur)
    if at.size == 0:
        return np.arange(n, dtype=np.uint32)
    slot = cols["slot"][rows[at], Tier.HOST].astype(np.int64)
    smin = int(slot.min())
    span = int(slot.max()) - smin + 1
    pick = None
    if span <= 4 * slot.size:
        # Dense (a batch put together): the order by one scatter over the span, O(n), unless
        # a slot repeats (a key asked twice), which the scatter would drop.
        by = np.full(span, -1, np.int64)
        by[slot - smin] = np.arange(slot.size)
        pick = by[by >= 0]
    if pick is None or pick.size != slot.size:
        pick = np.argsort(slot, kind="stable")
    order = at[pick]
    if at.size < n:
        order = np.concatenate([order, np.flatnonzero(~cur)])
    return order.astype(np.uint32)


class SortedGets:
    """Server's sorted gets (self is the Server: engine, _fast, _dispatch_req, _release_first,
    _run_mem)."""

    def _sorted_get(self, client: ClientInfo, req: dict[str, Any], req_id: Any
                    ) -> Reply | Awaitable[Reply]:
        """A get of a sorted get's piece: its keys put into req, the get dispatched as any,
        and its positions added to the reply."""
        try:
            at = self._sorted_piece(client, req, req_id)
        except Exception as exc:
            return self._sorted_refused(client, req, req_id, exc)
        out = self._dispatch_req(client, req, req_id, "get")
        order = P.arr(at, "<u4")
        if inspect.isawaitable(out):
            return _with_order_later(out, order)
        return _with_order(out, order)

    def _sorted_refused(self, client: ClientInfo, req: dict[str, Any], req_id: Any,
                        exc: Exception) -> Reply | Awaitable[Reply]:
        """A refused sorted request's error reply. The releases piggybacked on it end all the
        same, as any request's do (Server._dispatch_req): lease_sorted puts them on the last
        piece, which is refused whenever the first request was."""
        try:
            left = self._release_first(client, req) if "release_first" in req else []
        except Exception as bad:
            return failed_reply(bad, req_id, "get")
        if left:
            return self._sorted_refused_after(client, left, exc, req_id)
        return failed_reply(exc, req_id, "get")

    async def _sorted_refused_after(self, client: ClientInfo, leases: list[int],
                                    exc: Exception, req_id: Any) -> Reply:
        """_sorted_refused where the releases had to wait for the engine lock."""
        client.errors += await self._run_mem(self.engine.release_many, leases, client.cid)
        return failed_reply(exc, req_id, "get")

    def _sorted_piece(self, client: ClientInfo, req: dict[str, Any], req_id: Any
                      ) -> np.ndarray:
        """Put this piece's keys into req (and pop the sorted get's fields); its positions."""
        name = P.arg(req, "ns", str)
        if req.get("inline") or req.get("tier", "host") != "host":
            raise BadRequest("a sorted get is served from the host tier, not inline")
        if "of" in req:
            return self._sorted_later(client.sorted_gets, name, req)
        return self._sorted_first(client.sorted_gets, name, req, req_id)

    def _sorted_first(self, gets: dict[int, SortedGet], name: str, req: dict[str, Any],
                      req_id: Any) -> np.ndarray:
        """The first request: piece 0's keys stay in req, the sorted get is kept."""
        keys = P.arg(req, "keys", bytes)
        ends = P.array_arg(req, "sort", "<u4")
        req.pop("sort")
        if "piece" in req:
            raise BadRequest("a sorted get's first request has no 'piece'")
        karr = self.engine.namespace(name).table.keys_array(keys)
        got = karr.shape[0]
        ends_l = [0, *ends.tolist()]
        n = ends_l[-1]
        if not _rising(ends_l, n) or got not in (n, ends_l[1]):
            raise BadRequest(f"sort: the pieces' ends must rise strictly from above 0 to the "
                             f"number of keys ({got}), or to more when the first end is "
                             "that number (piece 1 then carries the other keys)")
        if len(ends_l) > 2:
            if type(req_id) is not int or req_id in gets:
                raise BadRequest("a sorted get of several pieces needs an integer request id "
                                 "not in use by another sorted get of this connection")
            if len(gets) >= MAX_SORTED:
                raise BadRequest(f"{MAX_SORTED} sorted gets are in flight on this connection: "
                                 "ask their pieces first")
            gets[req_id] = SortedGet(name, karr[ends_l[1]:] if got == n else None, None,
                                     ends_l)
        if got != ends_l[1]:
            req["keys"] = karr[:ends_l[1]].tobytes()
        return np.arange(ends_l[1], dtype=np.uint32)

    def _sorted_later(self, gets: dict[int, SortedGet], name: str, req: dict[str, Any]
                      ) -> np.ndarray:
        """A later piece: its keys, by the order taken at piece 1, put into req."""
        head = req.pop("of")
        piece = req.pop("piece", None)
        if type(head) is not int or type(piece) is not int:
            raise BadRequest("a sorted get's later piece needs integers 'of' and 'piece'")
        st = gets.get(head)
        brings = st is not None and st.keys is None and piece == st.next == 1
        if ("keys" in req and not brings) or "sort" in req:
            raise BadRequest("a sorted get's later piece carries no keys and no sort (only "
                             "piece 1 carries the keys after piece 0's, where the first "
                             "request had piece 0's alone)")
        if st is None:
            raise BadRequest(f"no sorted get {head} in flight on this connection (its "
                             "first request failed, or its last piece was asked)")
        if piece != st.next or st.name != name:
            del gets[head]
            raise BadRequest(f"sorted get {head}: piece {piece} of {name!r} asked where "
                             f"piece {st.next} of {st.name!r} was next; the get is ended")
        if st.order is None:
            self._sorted_order(gets, head, st, req)
        lo, hi = st.ends[piece] - st.ends[1], st.ends[piece + 1] - st.ends[1]
        st.next += 1
        if st.next == len(st.ends) - 1:
            del gets[head]
        at = st.order[lo:hi]
        req["keys"] = st.keys[at].tobytes()
        return at + np.uint32(st.ends[1])

    def _sorted_order(self, gets: dict[int, SortedGet], head: int, st: SortedGet,
                      req: dict[str, Any]) -> None:
        """At piece 1: the keys after piece 0 (piece 1's own, where the first request had
        piece 0's alone) and their order, taken now: piece 0's reply is out and its copies
        run while this sorts (one lookup and one C call, _fast.slot_order)."""
        if st.keys is None:
            want = st.ends[-1] - st.ends[1]
            try:
                rest = self.engine.namespace(st.name).table.keys_array(
                    P.arg(req, "keys", bytes, b""))
                if rest.shape[0] != want:
                    raise BadRequest(f"sorted get {head}: piece 1 carries {rest.shape[0]} keys "
                                     f"where the pieces' ends leave {want} after piece 0's")
            except BadRequest as exc:
                del gets[head]
                raise BadRequest(f"{exc}; the get is ended") from None
            st.keys = rest
        done, order = self._fast(slot_order, self.engine, st.name, st.keys)
        st.order = order if done else np.arange(st.keys.shape[0], dtype=np.uint32)


def _rising(ends: list[int], n: int) -> bool:
    """Whether ends (0, then the pieces' ends) rise strictly to n. On Python ints: a sorted
    get has a handful of pieces, and numpy's scalar compares and diff over them cost the
    first request ~15 us in the service's context (dev VM), ahead of piece 0's reply."""
    if len(ends) < 2 or ends[-1] != n:
        return False
    if len(ends) > 64:                  # many pieces: one vector compare
        e = np.asarray(ends, dtype=np.int64)
        return bool((e[1:] > e[:-1]).all())
    return all(a < b for a, b in zip(ends, ends[1:]))


def _with_order(out: Reply, order: bytes) -> Reply:
    if out[0].get("ok"):
        out[0]["order"] = order
    return out


async def _with_order_later(out: Awaitable[Reply], order: bytes) -> Reply:
    return _with_order(await out, order)
