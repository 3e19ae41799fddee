"""Large gets and puts in pipelined chunks, so that the service's control path for one chunk
overlaps the byte moves of another.

A get of 4,096 keys is one control step (decode, page-table lookup, leases, reply: ~0.2-0.5 ms)
and one transfer (a gather launch moving 64 MiB: ~1.2 ms at the H200's 55 GB/s). Done one
after the other, the control step is a third of the time (bench/gpu.py: onboard 16 KiB at 0.33
of the pinned ceiling). Here a batch of more than CHUNK keys is cut into chunks whose requests
are all sent at once; each reply's transfer is started as it arrives (a CUDA launch returns at
once), so the service works on chunk k+1 while chunk k moves.

    get:  send get(c1) .. get(cN) | for each reply: move(c)            | finish | releases
          (releases queued by earlier calls ride on the last request, not the first)
    put:  send reserve(c1) .. (cN) | for each reply: write(c), sync,    | commit replies
                                   |   send commit(c) (not waited for)  |
          (from CUDA tensors: cuda_put_chunks, each chunk's copies enqueued as its reserve
           reply arrives, each commit sent once that chunk's copies have completed)

A put's chunks commit one by one: if one fails, the chunks before it stay committed (each block
is its own entry; nothing is torn), the rest are aborted, and the error says how many blocks
were stored. Every reply is read, even after a failure, so the connection stays in step and no
lease or reservation is left behind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from kvtier.errors import KvtierError, ProtocolError, ServiceUnavailable

if TYPE_CHECKING:
    from kvtier.api.client import GetReply, Namespace

CHUNK = 1024
# Puts from CUDA tensors: chunks of at most CUDA_PUT_CHUNK keys. Each chunk's reserve and commit
# are requests that the service answers one after the other. While they ran on a thread (a hop
# and a reply task each) that cost more than the overlap bought for small blocks, so up to
# 4,096 keys went as one request (H200, commits hashed on threads: 4,096 x 16 KiB 8.2 ms as one
# request against 14.9-15.5 ms in chunks of 1,024). With the writer's checksums the service
# runs them inline on its loop (Server.op_reserve, op_commit), and every chunk's copies then overlap the
# service's reserves and commits of the others: bench/gpu.py offload_ratio_16k_chunks_4096 is
# the one request, measured beside the default in the same run. Host puts keep CHUNK: there
# the client's copy and hash of one chunk overlap the service's commit of the one before.
# Chunks also bound a single commit (and its hold of the engine lock) for huge puts.
CUDA_PUT_CHUNK = 1024
# ... and cut by bytes where the copies outlast the control path: a chunk's copies are enqueued
# as soon as its reserve reply arrives and its commit is sent as soon as its copies (and the GPU
# hash) have completed (kvtier.gpu.transfer), so the service reserves and commits other chunks
# while one moves. A chunk's reserve and commit cost ~0.5-1.2 ms each whatever its size
# (bench/gpu.py offload_reserve_ms_* and offload_commit_ms_*, H200 runs 10-11), so chunks pay only
# where each chunk's copy takes longer and chunks stay few. H200 run 10, ratio to pinned D2H:
# 4,096 x 64 KiB 0.647 in chunks of 1,024 against 0.540 as one request; 4,096 x 16 KiB 0.176 in
# chunks of 1,024 against 0.260 as one; 1,024 x 2 MiB 0.721 in chunks of 64 against 0.865 as one
# (run 11: 0.730 in chunks of 64 and 0.824 in chunks of 256 against 0.872; not the GPU hash that
# every chunk's commit waits for, 6 ms; the cause is not established). Hence chunks of at least
# CUDA_PUT_CHUNK_MIN keys and CUDA_PUT_CHUNK_BYTES: 64 KiB blocks in chunks of 1,024, 2 MiB
# batches up to 2,048 keys as one request. With batched copies (run 12) a 2 MiB put is 0.93 of
# D2H as one request; short edge chunks (16-128 keys first and last, to start the copies sooner
# and leave less commit after them) measured 0.91.
CUDA_PUT_CHUNK_BYTES = 64 << 20
CUDA_PUT_CHUNK_MIN = 1024

def cuda_put_chunks(n: int, block_bytes: int) -> list[tuple[int, int]]:
    """The chunks of a put from CUDA memory: CUDA_PUT_CHUNK_BYTES of blocks, at least
    CUDA_PUT_CHUNK_MIN and at most CUDA_PUT_CHUNK keys (chunks() cuts them). (A short last
    chunk as well, to leave less commit after the last copy, measured no gain on the H200:
    4,096 x 64 KiB 0.826 against 0.816, 16 KiB 0.463 against 0.533, medians of three.)"""
    size = min(CUDA_PUT_CHUNK, max(CUDA_PUT_CHUNK_MIN, CUDA_PUT_CHUNK_BYTES // max(1, block_bytes)))
    return chunks(n, size)


def chunks(n: int, size: int | None = None, ramp: tuple[int, ...] = ()
           ) -> list[tuple[int, int]]:
    """[lo, hi) ranges covering n keys: one range up to 2 x size keys (default CHUNK), else a
    first range of size / 4 (or the ranges of ramp's sizes) and then ranges of size. The
    first is short because nothing moves until its reply is in: on the H200 a first chunk of
    1,024 keys came back 0.5 ms into a 2.0 ms onboard get (bench/gpu.py onboard_timeline_ms)."""
    size = size or CHUNK
    if n <= 2 * size:
        return [(0, n)]
    out, lo = [], 0
    for k in ramp or (max(1, size // 4),):
        if lo + k >= n:
            break
        out.append((lo, lo + k))
        lo += k
    return out + [(a, min(a + size, n)) for a in range(lo, n, size)]


def lease(ns: "Namespace", kb: bytes, n: int, on_reply: Callable[["GetReply", int], None],
          extra: dict[str, Any] | None = None, size: int | None = None,
          prepare: Callable[[], None] | None = None, ramp: tuple[int, ...] = ()
          ) -> tuple[np.ndarray, list[int], BaseException | None, bool]:
    """Lease keys' blocks chunk by chunk (chunks(n, size, ramp)), calling on_reply(reply, lo) as
    each reply arrives (until something fails). Every reply is read, so no lease is left
    unknown. prepare() runs once every request is sent, before the first reply is read (the
    caller's set-up, while the service answers; a failure there is the get's failure, after
    the replies are read). Returns (found mask, leases, the first failure or None, whether
    on_reply was called at all); the caller ends the leases once nothing started by on_reply
    reads their slots."""
    c = ns._client
    w = ns.key_width
    parts = chunks(n, size, ramp)
    last = len(parts) - 1
    ids = [c._send("get", {"ns": ns.name, "keys": kb[lo * w:hi * w], **(extra or {})},
                   piggyback=i == last)
           for i, (lo, hi) in enumerate(parts)]
    error: BaseException | None = None
    if prepare is not None:
        try:
            prepare()
        except BaseException as exc:      # keep reading: the replies hold leases
            error = exc
    return _read_replies(c, parts, ids, n, on_reply, _chunk_at, error)


def _chunk_at(raw: dict[str, Any], rep: "GetReply", lo: int, hi: int) -> int:
    """lease()'s locate: a chunk's reply answers its hi - lo keys, in their order, at lo."""
    if rep.found.size != hi - lo or rep.slots.size != hi - lo:
        raise ProtocolError(f"a get's chunk of {hi - lo} keys came back with "
                            f"{rep.found.size} found and {rep.slots.size} slots: nothing of "
                            "it is used")
    return lo


def _read_replies(c: Any, parts: list[tuple[int, int]], ids: list[int], n: int,
                  on_reply: Callable[["GetReply", Any], None],
                  locate: Callable[[dict[str, Any], "GetReply", int, int], Any],
                  error: BaseException | None = None
                  ) -> tuple[np.ndarray, list[int], BaseException | None, bool]:
    """Read the reply of every request of ids (one per part, in order), so that no lease is
    left unknown; on_reply(reply, locate(...)) for each until something fails. locate gives
    where a part's keys are in the batch: an int (the first of hi - lo in order) or their
    positions; it raises ProtocolError for a reply that cannot be placed (nothing of it is
    used). lease()'s returns."""
    from kvtier.api.client import GetReply
    found = np.zeros(n, dtype=bool)
    leases: list[int] = []
    moving = False
    for (lo, hi), rid in zip(parts, ids):
        try:
            raw = c._reply(rid)
        except ServiceUnavailable:
            raise                    # the connection is gone, and its leases with it
        except KvtierError as exc:
            error = error or exc
            continue
        try:
            rep = GetReply.decode(raw)
        except (KeyError, TypeError, ValueError) as exc:
            # A reply without its arrays (a service bug): its lease, if it names one, is
            # ended with the others; nothing of it is used.
            lid = raw.get("lease") if isinstance(raw, dict) else None
            if type(lid) is int:
                leases.append(lid)
            error = error or ProtocolError(f"a get's reply does not decode ({exc!r}): "
                                           "nothing of it is used")
            continue
        leases.append(rep.lease)
        try:
            at = locate(raw, rep, lo, hi)
        except ProtocolError as exc:
            error = error or exc
            continue
        if type(at) is int:
            found[at:at + rep.found.size] = rep.found
        else:
            found[at] = rep.found
        if error is None:
            try:
                moving = True
                on_reply(rep, at)
            except BaseException as exc:      # keep reading: the other replies hold leases
                error = exc
    return found, leases, error, moving


def lease_sorted(ns: "Namespace", kb: bytes, n: int,
                 on_reply: Callable[["GetReply", np.ndarray], None],
                 extra: dict[str, Any] | None = None, size: int | None = None
                 ) -> tuple[np.ndarray, list[int], BaseException | None, bool]:
    """lease() in the service's slot order (kvtier.api.sortedgets): the first request carries
    piece 0's keys and the pieces' ends (chunks(n, size)), each later one names it and its
    piece, piece 1's with the other keys; all are sent before the first reply is read. on_reply(reply, at) gets 0 for piece 0 (the first
    keys in their order, as lease's first chunk) and the positions in kb of the keys of each
    later piece. The positions of all pieces must make a permutation of the keys, each piece's
    as many as its reply's blocks, piece 0's the first keys: anything else is a ProtocolError
    (a block put in another key's place would be a wrong block), raised once every reply is
    read. Returns what lease() returns."""
    c = ns._client
    parts = chunks(n, size)
    last = len(parts) - 1
    ends = np.array([hi for _lo, hi in parts], dtype="<u4").tobytes()
    # The first request carries piece 0's keys alone, and piece 1's the others: the service
    # answers piece 0 as soon as a frame of a chunk's size is in, as it answers a chunked
    # get's first chunk (with every key in it, the first reply waited for the whole batch's
    # frame and its decode: lease13, bench/get_control.py --serve).
    split = parts[0][1] * ns.key_width
    head = c._send("get", {"ns": ns.name, "keys": kb[:split], "sort": ends, **(extra or {})},
                   piggyback=last == 0)
    ids = [head] + [c._send("get", {"ns": ns.name, "of": head, "piece": i,
                                    **({"keys": kb[split:]} if i == 1 else {}),
                                    **(extra or {})},
                            piggyback=i == last)
                    for i in range(1, len(parts))]
    seen = np.zeros(n, dtype=bool)
    count = 0                              # positions seen so far

    def locate(raw: dict[str, Any], rep: "GetReply", lo: int, hi: int) -> Any:
        nonlocal count
        order = raw.get("order", b"")
        # Anything but whole "<u4" positions is the ProtocolError below, not a raise that
        # would leave the later replies, and their leases, unread.
        whole = type(order) is bytes and len(order) % 4 == 0
        at = np.frombuffer(order if whole else b"", "<u4")
        ok = whole and at.size == hi - lo == rep.found.size == rep.slots.size and (
            not at.size or int(at.max()) < n) and (
            lo or (at == np.arange(hi, dtype=np.uint32)).all())
        if ok:
            seen[at] = True
            now = int(np.count_nonzero(seen))
            ok, count = now - count == at.size, now
        if not ok:
            raise ProtocolError(
                f"a sorted get's piece came back with {at.size} positions for {hi - lo} keys "
                "(or positions outside the batch, or repeated, or another number of slots): "
                "nothing of it is used")
        return at if lo else 0
    return _read_replies(c, parts, ids, n, on_reply, locate)


def get(ns: "Namespace", kb: bytes, n: int, move: Callable[["GetReply", int], None],
        finish: Callable[[], None] = lambda: None,
        extra: dict[str, Any] | None = None) -> np.ndarray:
    """Lease and move keys' blocks chunk by chunk; move(reply, lo) starts one chunk's move,
    finish() waits for all of them; extra goes into every request (tier). Returns the found
    mask. Leases are released (piggybacked on the next request) once finish() has returned."""
    c = ns._client
    found, leases, error, moving = lease(ns, kb, n, move, extra)
    try:
        if moving:
            # Even after an error: a lease may end only once no launched copy reads its slots.
            try:
                finish()
            except BaseException as exc:
                error = error or exc
    finally:
        for lease_id in leases:
            c._release_later(lease_id)
    if error is not None:
        raise error
    return found


def put(ns: "Namespace", kb: bytes, n: int, parents: bytes | None,
        write: Callable[[np.ndarray, int, int], bytes | None],
        sync: Callable[[], None] = lambda: None,
        extra: dict[str, Any] | None = None, size: int | None = None) -> np.ndarray:
    """Reserve, fill and commit keys' blocks chunk by chunk. write(slots, lo, hi) fills the
    reserved slots of keys lo..hi and returns their packed checksums (or None: the service
    hashes); sync() waits until written bytes are in the slots; extra goes into every reserve
    (tier); size: the chunk size (default CHUNK). Returns the new versions."""
    c = ns._client
    w = ns.key_width
    size = size or CHUNK
    parts = chunks(n, size)
    last = len(parts) - 1
    reserve_ids = [c._send("reserve", {"ns": ns.name, "keys": kb[lo * w:hi * w],
                                       "parents": None if parents is None
                                       else parents[lo * w:hi * w], **(extra or {})},
                           piggyback=i == last)
                   for i, (lo, hi) in enumerate(parts)]
    commit_ids: list[tuple[int, int, int]] = []       # (lo, hi, request id)
    error: BaseException | None = None
    for (lo, hi), rid in zip(parts, reserve_ids):
        try:
            r = c._reply(rid)
        except ServiceUnavailable:
            raise                    # the service ends the connection's reservations
        except KvtierError as exc:
            error = error or exc
            continue
        if error is not None:
            c._send_nowait("abort", rid=r["rid"])
            continue
        try:
            sums = write(np.frombuffer(r["slots"], "<i4"), lo, hi)
            sync()               # the bytes are in the slots before the commit checksums them
        except BaseException as exc:
            error = exc
            try:
                sync()           # no launched write may land in slots an abort hands back
            except BaseException:
                pass             # the first failure is the one raised, after every reply is read
            c._send_nowait("abort", rid=r["rid"])
            continue
        commit_ids.append((lo, hi, c._send("commit", {"rid": r["rid"], "checksums": sums})))
    versions, stored, failed = commit_replies(ns, commit_ids, n)
    error = error or failed
    if error is not None:
        if len(parts) > 1 and isinstance(error, KvtierError):
            raise type(error)(f"{error} ({stored} of {n} blocks were stored, in whole "
                              f"chunks of up to {size})") from None
        raise error
    return versions


def commit_replies(ns: "Namespace", commit_ids: list[tuple[int, int, int]], n: int
                   ) -> tuple[np.ndarray, int, KvtierError | None]:
    """Read every commit reply of (lo, hi, request id): the versions, how many blocks were
    stored, and the first failure (None when all were)."""
    c = ns._client
    versions = np.zeros(n, dtype=np.uint64)
    stored = 0
    error: KvtierError | None = None
    for lo, hi, cid in commit_ids:
        try:
            versions[lo:hi] = np.frombuffer(c._reply(cid)["versions"], "<u8")
            stored += hi - lo
        except ServiceUnavailable:
            raise
        except KvtierError as exc:
            error = error or exc
    return versions, stored, error
