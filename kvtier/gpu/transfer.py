"""Asynchronous gets and puts between kvtier and CUDA memory, on the caller's stream.

    h = ns.get_async(keys, out=pages, rows=block_ids, stream=s, layers=32)
    ...                                # the model runs; layer i computes after h.wait_layer(i)
    found = h.wait()                   # or poll h.done() from the engine's step loop

Lifecycle of a get (the rules of DESIGN.md, "Inside an inference engine"):

    1. lease the blocks (one request, or pipelined chunks: kvtier.api.pipeline.chunks)
    2. enqueue the copies on the caller's stream, page group by page group (a layer, or all),
       recording an event after each group; nothing on the host waits for the GPU
    3. the leases end only once the last event has completed, seen by a poll (done(), wait(),
       or the namespace's next CUDA call): a slot is never handed back while a copy may read it

and of a put:

    1. reserve slots, in chunks (kvtier.api.pipeline.cuda_put_chunks), all requests sent at once
    2. enqueue each chunk's copies into its slots on the caller's stream as its reserve reply
       arrives (the service reserves the next chunk meanwhile), recording an event after each;
       where the layout allows (kvtier.gpu.xxh3.supported), a hash kernel on a side stream
       computes each block's checksum from the source, and the caller's stream waits for it, so
       the last event covers both (the engine may reuse its tensor once that event has completed)
    3. commit each chunk, with the GPU's checksums (the service hashes no byte), once its event
       and the hash have completed, seen by done(), wait() or a poll: the service commits chunk
       k while chunk k + 1 moves. A reserve refused launches nothing more, waits for what was
       launched, and aborts every chunk; a transfer that fails on the GPU (a CUDA error, an
       exception while enqueueing) commits no chunk after the failure: the rest are aborted,
       after their launched copies have finished, and the error says how many blocks were
       stored (each chunk is whole blocks: nothing is torn).

Never a stream or device synchronisation: host waits are on the transfer's own events only,
and once per page table on its small upload to the device (device.on_device, on a stream of
kvtier's own).
Not thread-safe, like the Client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from kvtier.api import pipeline
from kvtier.errors import KvtierError, ServiceUnavailable
from kvtier.gpu import probe
from kvtier.gpu.device import Mover, Staging, copy_one, target_table
from kvtier.gpu.streams import Stream, own, settle
from kvtier.gpu.plan import PageTable, TransferPolicy, check_rows, page_groups

if TYPE_CHECKING:
    from kvtier.api.client import GetReply, Namespace

_policy: TransferPolicy | None = None
# bench/gpu.py's chunk timeline: where a list, each get_async appends {"t0": perf_counter at
# entry, "start": (timing event, host times) on its stream at entry, "chunks": [(host time
# the reply was read, Mover.mark() before its move, Mover.mark() after it, host time the move
# returned)], "ret": perf_counter on return}. None: nothing recorded (the default).
TRACE: list[dict[str, Any]] | None = None


def policy() -> TransferPolicy:
    """The transfer settings of this process (KVTIER_GPU_* variables, kvtier.config)."""
    global _policy
    if _policy is None:
        from kvtier.config import load
        _policy = TransferPolicy.from_settings(load())
    return _policy


def set_policy(p: TransferPolicy | None) -> None:
    """Replace the process's transfer settings (None: read them again); bench/gpu.py compares."""
    global _policy
    _policy = p


class Transfer:
    """A get or put in flight on a CUDA stream. events[i] completes when page group i (layer i
    with ``layers``) has moved; the last one when everything has."""

    def __init__(self, ns: "Namespace", events: list[Any], staging: Staging,
                 methods: set[Any]) -> None:
        self._ns = ns
        self.events = events
        self.methods = {m.value for m in methods}
        self._staging = staging
        self.one_launch = False         # every layer of a per-layer get moved by one launch
        self.staged = False             # host->GPU through device staging (device.Mover)
        self.batched = False            # copies through cuMemcpyBatchAsync (device.copy_batch)
        self._finished = False
        self._error: BaseException | None = None
        self.result: Any = None

    @property
    def event(self) -> Any:
        """The cupy Event of the whole transfer."""
        return self.events[-1]

    def wait_layer(self, i: int, stream: Any = None) -> None:
        """Make stream (default: torch's current stream) wait, on the GPU, for page group i;
        the host does not wait."""
        Stream.resolve(stream, self._device()).wait(self.events[i])

    def synchronize_layer(self, i: int) -> None:
        """The host waits for page group i only."""
        self.events[i].synchronize()

    def done(self) -> bool:
        """True once the transfer has completed, finishing it (leases released, or the put
        committed) the first time; never blocks on the GPU. Raises the transfer's failure."""
        if not self._finished:
            if not self._events_done():
                return False
            self._finish()
        if self._error is not None:
            raise self._error
        return True

    def wait(self) -> Any:
        """Wait (on this transfer's events) and finish: the found mask of a get, the versions
        of a put."""
        if not self._finished:
            try:
                self._sync()
            except BaseException as exc:
                self._error = exc
                self._settle()
            self._finish()
        if self._error is not None:
            raise self._error
        return self.result

    def _device(self) -> int:
        return int(self._device_id)

    def _sync(self) -> None:
        for ev in self.events:
            ev.synchronize()

    def _settle(self) -> None:
        """After a failure: the host waits until nothing launched may still run (a CUDA error
        of the stream ends that wait too)."""
        if self.events:
            try:
                self.events[-1].synchronize()
            except BaseException:
                pass

    def _events_done(self) -> bool:
        try:
            return all(ev.done for ev in self.events)
        except BaseException as exc:       # a CUDA error of the stream: the transfer failed
            self._error = exc
            return True

    def _finish(self) -> None:
        self._finished = True
        try:
            self._complete()
        except BaseException as exc:
            self._error = self._error or exc
        finally:
            self._staging.release()
            inflight = self._ns._inflight
            if self in inflight:
                inflight.remove(self)

    def _complete(self) -> None:
        raise NotImplementedError


class GetTransfer(Transfer):
    """A get in flight; result: the found mask (rows of missing blocks are left as they were)."""

    def __init__(self, ns: "Namespace", events: list[Any], staging: Staging, methods: set[Any],
                 found: np.ndarray, leases: list[int], device: int) -> None:
        super().__init__(ns, events, staging, methods)
        self.result = found
        self._leases = leases
        self._device_id = device

    def _complete(self) -> None:
        c = self._ns._client
        for lease in self._leases:
            c._release_later(lease)
        self._leases = []


class PutTransfer(Transfer):
    """A put in flight; result: the new versions, once committed. parts: (lo, hi, reservation
    id, the event after that chunk's copies); hashed: the event after the GPU's checksums have
    reached host memory (None: no GPU checksums)."""

    def __init__(self, ns: "Namespace", events: list[Any], staging: Staging, methods: set[Any],
                 parts: list[tuple[int, int, int, Any]], n: int,
                 send_commit: Callable[[int, int, int], int], hashed: Any, device: int,
                 commits: list[tuple[int, int, int]], ask_credit: bool = False) -> None:
        super().__init__(ns, events, staging, methods)
        self._parts = parts
        self._n = n
        self._commit_of = send_commit     # (lo, hi, reservation id) -> request id
        self._ask_credit = ask_credit and ns._credits is not None
        self._hashed = hashed
        self._device_id = device
        self._commits = commits      # (lo, hi, request id) sent, the first chunks' in order

    def _sync(self) -> None:
        """Wait for each chunk in turn and send its commit at once: the service commits chunk
        k while chunk k + 1 still moves."""
        for _lo, _hi, _rid, ev in self._parts[len(self._commits):]:
            ev.synchronize()
            if self._hashed is not None:
                self._hashed.synchronize()
            self._send_commit()
        super()._sync()

    def _events_done(self) -> bool:
        """Send the commits of the chunks that have completed; True once every event has."""
        try:
            for _lo, _hi, _rid, ev in self._parts[len(self._commits):]:
                if not (ev.done and (self._hashed is None or self._hashed.done)):
                    break
                self._send_commit()
            return all(ev.done for ev in self.events)
        except BaseException as exc:       # a CUDA error, or the connection lost
            self._error = exc
            self._settle()
            return True

    def _send_commit(self) -> None:
        lo, hi, rid, _ev = self._parts[len(self._commits)]
        self._commits.append((lo, hi, self._commit_of(lo, hi, rid)))

    def _complete(self) -> None:
        c = self._ns._client
        if self._error is None:
            while len(self._commits) < len(self._parts):
                self._send_commit()
            if self._ask_credit:
                # The next put's credit, asked behind this put's commits (off their path);
                # its reply is read by the next put's take().
                self._ns._credits.ask()
        versions, stored, error = pipeline.commit_replies(self._ns, self._commits, self._n)
        for _lo, _hi, rid, _ev in self._parts[len(self._commits):]:
            c._send_nowait("abort", rid=rid)
        failure = self._error or error
        if failure is not None:
            if self._ns._credits is not None:
                self._ns._credits.drop(wait=True)    # a failed writer holds nothing after
            if error is not None and self._error is None:
                raise type(error)(f"{error} ({stored} of {self._n} blocks were stored)") from None
            if stored:
                failure.add_note(f"kvtier: {stored} of {self._n} blocks were stored")
            self._error = failure
            raise failure
        self.result = versions


def _commit(c: Any, sums_addr: int, lo: int, hi: int, rid: int, keys: bytes | None = None,
            parents: bytes | None = None) -> int:
    """Send the commit of reservation rid, keys lo..hi, with the GPU's checksums of those
    keys (pinned, at sums_addr; 0: none, the service hashes); keys (and parents): a credit's,
    named at its commit. Returns the request id."""
    sums = None
    if sums_addr:
        import ctypes
        sums = np.ctypeslib.as_array((ctypes.c_uint64 * (hi - lo)).from_address(
            sums_addr + 8 * lo)).astype("<u8").tobytes()
    return c._send("commit", {"rid": rid, "checksums": sums, "trusted": True if sums else None,
                              "keys": keys, "parents": parents})


def _credit(ns: "Namespace", tier: str, pol: TransferPolicy) -> Any:
    """The namespace's credit for this put (kvtier.api.credits), or None. (Made here, not
    with the handle: a handle that never puts from CUDA memory never asks for one.)"""
    if tier != "host" or not pol.put_credits:
        return None
    if ns._credits is None:
        from kvtier.api.credits import Credits
        ns._credits = Credits(ns)
    return ns._credits.take(wait=True)


def poll(ns: "Namespace") -> None:
    """Finish the namespace's completed transfers (release leases, commit puts). Their failures
    are raised by their own done()/wait()."""
    for t in list(ns._inflight):
        if not t._finished and t._events_done():
            t._finish()


def drain(ns: "Namespace") -> None:
    """Wait for every transfer of the namespace (before its memory is unregistered)."""
    for t in list(ns._inflight):
        try:
            t.wait()
        except BaseException:
            pass        # the failure belongs to its handle's owner, who may never ask
    ns._inflight.clear()


def _target(ns: "Namespace", x: Any, rows: np.ndarray | None, n: int,
            layers: int | None) -> tuple[PageTable, list[tuple[int, int]], np.ndarray]:
    """The device side of a transfer: its page table (a row split into ``layers`` pages when
    the tensor is rows), its page groups, and the engine block of each key."""
    table = target_table(x, ns.block_bytes)
    if layers and table.pages == 1:
        table = table.split_rows(layers)
    groups = page_groups(table.pages, layers)
    return table, groups, check_rows(np.arange(n) if rows is None else rows, n,
                                     table.num_blocks)


class _GetSide:
    """The device side of a get: its page table, page groups and rows (_target), the stream,
    the staging of its indices and its Mover."""

    def __init__(self, ns: "Namespace", out: Any, rows: np.ndarray | None, n: int,
                 layers: int | None, stream: Any, tier: str, pol: TransferPolicy) -> None:
        import cupy
        self.table, self.groups, self.rows = _target(ns, out, rows, n, layers)
        self.seg = ns._gpu(tier)
        with cupy.cuda.Device(self.table.device):
            self.stream = Stream.resolve(stream, self.table.device)
            self.staging = Staging(self.stream)
            self.mover = Mover(self.seg, self.table, self.stream, pol, self.staging)


def _chunked_first(pol: TransferPolicy, tier: str, n: int, layers: int | None) -> bool:
    """Whether a get is leased in chunks whatever its tensor, so that its requests can go
    before its device side is built: from the host tier (the HBM tier's requests name the
    device), where no sorted get can take it (_whole decides on the table otherwise): per
    layer, too few or too many keys, or no device prefers sorted gets (kvtier.gpu.probe)."""
    if tier != "host":
        return False
    return bool(layers and layers > 1) or not _sortable(pol, n) or not probe.any_sorted(pol)


def _sortable(pol: TransferPolicy, n: int) -> bool:
    """Enough keys for a sorted get to differ from a chunked one (more than one of
    pipeline.lease_sorted's pieces: the first is leased in key order), and no more than it
    takes."""
    return n <= pol.whole_onboard_keys and len(pipeline.chunks(n, pol.sorted_piece_keys)) > 1


def get_async(ns: "Namespace", kb: bytes, n: int, out: Any, rows: np.ndarray | None,
              stream: Any, tier: str, layers: int | None) -> GetTransfer:
    """A chunked get from the host tier sends its requests first and builds its device side
    (_GetSide: the tensor's table, the stream, the Mover; then Mover.prepare) while the service
    answers the first chunk: bench/gpu_probe.py on an H100 host found 50-85 us of the client's
    before the first send, and the first reply 0.1-0.2 ms after it. A bad tensor, rows or
    stream then raises once every reply is read and its leases ended (one round trip), as a
    failure while enqueueing does; other gets check the tensor first."""
    import contextlib
    import cupy
    poll(ns)
    ns._client._ensure()
    pol = policy()
    first = _chunked_first(pol, tier, n, layers)
    side = None if first else _GetSide(ns, out, rows, n, layers, stream, tier, pol)
    with contextlib.ExitStack() as ctx:
        events: list[Any] = []
        replies: list[tuple["GetReply", int]] = []
        trace = None
        if TRACE is not None:
            import time
            trace = {"t0": time.perf_counter(), "chunks": []}
            TRACE.append(trace)

        def build() -> _GetSide:
            """The device side, entered: its device current until get_async returns."""
            nonlocal side
            if side is None:
                side = _GetSide(ns, out, rows, n, layers, stream, tier, pol)
            ctx.enter_context(cupy.cuda.Device(side.table.device))
            if trace is not None:
                trace["start"] = side.mover.mark()
            return side

        if not first:
            build()
        whole = not first and _whole(ns, pol, side.table, side.groups, n, tier)

        def prepare() -> None:
            s = build() if first else side
            if len(s.groups) == 1:
                s.mover.prepare(0, s.table.pages, n)

        def launch(rep: "GetReply", at: Any) -> None:
            if trace is not None:
                import time
                t_reply, before = time.perf_counter(), side.mover.mark()
                _launch(rep, at)
                trace["chunks"].append((t_reply, before, side.mover.mark(), time.perf_counter()))
            else:
                _launch(rep, at)

        def _launch(rep: "GetReply", at: Any) -> None:
            # at: the chunk's first key (lease), or its keys' positions (lease_sorted).
            mover, dst_rows = side.mover, side.rows
            if len(side.groups) == 1:        # one event: move each chunk as its reply arrives
                rows_at = (dst_rows[at:at + rep.slots.size] if type(at) is int
                           else dst_rows[at])
                if rep.found.all():
                    slots, rows_ = rep.slots, rows_at
                else:
                    idx = np.flatnonzero(rep.found)
                    slots, rows_ = rep.slots[idx], rows_at[idx]
                # A sorted get's piece 0 is its first keys in their order (at 0: a chunk).
                sorted_piece = whole and type(at) is not int
                if not (sorted_piece and mover.stage_sorted(slots, rows_, 0, side.table.pages)):
                    if sorted_piece and slots.size:
                        ns._whole_skip = SPARSE_RETRY   # sparse: the next gets in chunks
                    mover.move(slots, rows_, 0, side.table.pages, False)
            else:
                replies.append((rep, at))
        extra = {"tier": tier, "device": side.table.device if tier == "hbm" else None}
        if whole:        # in the service's slot order, piece by piece (api.sortedgets)
            found, leases, error, _moved = pipeline.lease_sorted(
                ns, kb, n, launch, extra, pol.sorted_piece_keys)
        else:
            found, leases, error, _moved = pipeline.lease(
                ns, kb, n, launch, extra, None, prepare, pol.get_ramp)
        if side is None:                 # the device side failed to build: nothing launched
            for lease in leases:
                ns._client._release_later(lease)
            raise error or KvtierError("a get's device side was never built")
        table, groups, mover = side.table, side.groups, side.mover
        try:
            if error is None and len(groups) > 1:
                found_at = [(rep, lo, np.flatnonzero(rep.found)) for rep, lo in replies]
                slots = np.concatenate([rep.slots[i] for rep, _lo, i in found_at])
                rows_ = np.concatenate([side.rows[lo + i] for _rep, lo, i in found_at])
                events = (mover.stage_layers(slots, rows_, groups)
                          or mover.move_layers(slots, rows_, groups, False) or [])
                for g_lo, g_hi in groups if not events else ():
                    mover.move(slots, rows_, g_lo, g_hi, False)      # a launch per layer
                    events.append(mover.event())
            elif error is None:
                events.append(mover.event())
        except BaseException as exc:
            error = exc
        if error is not None:
            # Launched copies may still read the leased slots: wait for them (this transfer's
            # own event), then end the leases.
            mover.settle()
            if mover.one_launch:              # its layer waits read counters in the staging
                settle(own(table.device, "layers-0"))
            GetTransfer(ns, [], side.staging, mover.methods, found, leases,
                        table.device)._finish()
            raise error
        t = GetTransfer(ns, events, side.staging, mover.methods, found, leases, table.device)
        t.one_launch, t.staged, t.batched = mover.one_launch, mover.staged, mover.batched
        if trace is not None:
            import time
            trace["ret"] = time.perf_counter()
    ns._inflight.append(t)
    return t


# After a whole get found a sorted piece's slots sparse, this many gets of the namespace go in
# chunks (the service's order costs a lookup of the batch, which only dense pieces make up
# for) before a whole one is tried again.
SPARSE_RETRY = 16


def _whole(ns: "Namespace", pol: TransferPolicy, table: PageTable,
           groups: list[tuple[int, int]], n: int, tier: str) -> bool:
    """Whether a get is leased in the service's slot order (pipeline.lease_sorted) and its
    pieces moved by Mover.stage_sorted (the policy's sorted_gets): _sortable's keys, one page
    group of pages under copy_engine_bytes from the host tier ("auto": rows of one page
    under onboard_copy_engine_bytes, where it was measured, on a device whose probe prefers
    it), the namespace's last whole get not sparse within SPARSE_RETRY gets."""
    biggest = int(table.size.max())
    if (not pol.staged or len(groups) != 1 or tier != "host" or not _sortable(pol, n)
            or biggest >= pol.copy_engine_bytes or pol.sorted_gets == "off"):
        return False
    if pol.sorted_gets == "auto" and (
            table.pages != 1
            or (pol.onboard_copy_engine_bytes and biggest >= pol.onboard_copy_engine_bytes)
            or not probe.prefers_sorted(table.device, pol)):
        return False
    if ns._whole_skip:
        ns._whole_skip -= 1
        return False
    return True


_events: dict[tuple[int, int], Any] = {}


class _Current:
    """A context that makes nothing current (the device already is)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_CURRENT = _Current()


def _on(device: int) -> Any:
    """cupy.cuda.Device(device) as a context, or nothing where it is current already (a
    device switch and back is ~1 us a call on the H200 host)."""
    import cupy
    if cupy.cuda.runtime.getDevice() == device:
        return _CURRENT
    return cupy.cuda.Device(device)


def get_one(ns: "Namespace", kb: bytes, out: Any, rows: np.ndarray | None) -> np.ndarray | None:
    """The blocking get of one block from the host tier into CUDA memory on torch's current
    stream, the latency case: the request goes out first and the copy's set-up is done while
    the service answers; one copy-engine call per page, then the host waits on an event kept
    for that stream (reused: nothing else waits on it), then the lease ends (piggybacked on
    the next request). The found mask; None (nothing sent) where the general path must run."""
    import cupy
    if ns._inflight:
        poll(ns)
    c = ns._client
    c._ensure()
    table = target_table(out, ns.block_bytes)
    row = 0 if rows is None and table.num_blocks else int(check_rows(
        np.zeros(1, np.int64) if rows is None else rows, 1, table.num_blocks)[0])
    seg = ns._gpu("host")
    if len(seg.ranges) != 1 or table.pages > policy().small_batch_copies:
        return None
    rid = c._send("get", {"ns": ns.name, "keys": kb})
    dev = table.device
    with _on(dev):
        st = Stream.resolve(None, dev)
        ev = _events.get((dev, st.ptr))
        if ev is None:
            ev = _events[(dev, st.ptr)] = cupy.cuda.Event(block=False, disable_timing=True)
        r = c._reply(rid)
        found = bool(r["found"][0])
        try:
            if found:
                copy_one(seg, table, st, int(np.frombuffer(r["slots"], "<i4")[0]), row, 0,
                         table.pages, False)
                ev.record(st.cupy)
                ev.synchronize()
        except BaseException:
            settle(st)                         # no launched copy reads the slot any more
            raise
        finally:
            c._release_later(int(r["lease"]))
    return np.array([found])


def put_async(ns: "Namespace", kb: bytes, n: int, blocks: Any, parents: bytes | None,
              rows: np.ndarray | None, stream: Any, tier: str,
              layers: int | None) -> PutTransfer:
    import cupy
    poll(ns)
    c = ns._client
    c._ensure()
    table, groups, src_rows = _target(ns, blocks, rows, n, layers)
    seg = ns._gpu(tier)
    w = ns.key_width
    pol = policy()
    with cupy.cuda.Device(table.device):
        # The stream before any request: a bad one raises with nothing reserved and no reply
        # left unread on the connection.
        st = Stream.resolve(stream, table.device)
    credit = _credit(ns, tier, pol) if n else None
    k = 0 if credit is None else min(n, credit.slots.size)     # keys 0..k go into the credit
    chunks = [(k + lo, k + hi) for lo, hi in pipeline.cuda_put_chunks(n - k, ns.block_bytes)
              ] if n > k else []
    ids = [c._send("reserve", {"ns": ns.name, "keys": kb[lo * w:hi * w], "tier": tier,
                               "device": table.device if tier == "hbm" else None,
                               "parents": None if parents is None else parents[lo * w:hi * w]},
                   piggyback=i == len(chunks) - 1) for i, (lo, hi) in enumerate(chunks)]
    with cupy.cuda.Device(table.device):
        try:
            staging = Staging(st)
            mover = Mover(seg, table, st, pol, staging)
        except BaseException:
            # The reserves' replies are read past by the next call and their reservations
            # aborted then (Client._orphan); the credit is no reply: abort it here.
            if credit is not None:
                c._send_nowait("abort", rid=credit.rid)
            raise
        side, sums, hashed, error = None, 0, None, None
        parts: list[tuple[int, int, int, np.ndarray]] = []
        ends: list[Any] = []
        if credit is not None:            # its copies first: no reply to wait for
            parts.append((0, k, credit.rid, credit.slots[:k]))
            if len(groups) == 1:
                try:
                    mover.move(credit.slots[:k], src_rows[:k], groups[0][0], groups[0][1], True)
                    ends.append(mover.event())
                except BaseException as exc:
                    error = exc
        # The hash before the first chunk's copies. Launched after them instead (forked from
        # an event taken first, uploading on its own stream), the 16 KiB offload read 0.634 /
        # 0.608 of D2H against 0.662 / 0.680 and the 64 KiB one 0.846 / 0.856 against 0.830 /
        # 0.843 (one H100 call, with the session's other changes; docs/DESIGN-NOTES.md,
        # session 37): not shown to pay, so not kept.
        try:
            side, sums, hashed = _hash(ns, mover, table, src_rows, n)
        except BaseException as exc:
            error = error or exc
        commits: list[tuple[int, int, int]] = []          # (lo, hi, request id) sent
        credit_rid = -1 if credit is None else credit.rid

        def send_commit(lo: int, hi: int, rid: int) -> int:
            """The commit of chunk lo..hi; a credit's names its keys (kvtier.api.credits)."""
            if rid != credit_rid:
                return _commit(c, sums, lo, hi, rid)
            return _commit(c, sums, lo, hi, rid, kb[lo * w:hi * w],
                           None if parents is None else parents[lo * w:hi * w])

        def early(parts: list[tuple[int, int, int, np.ndarray]], ends: list[Any]) -> None:
            """Commit the leading chunks whose copies and hash have completed, while later
            reserve replies are still to be read: the service, which answers in order, then
            finds them queued behind the last reserve instead of waiting for the client."""
            while len(commits) < len(ends) and ends[len(commits)].done and (
                    hashed is None or hashed.done):
                lo, hi, rid, _s = parts[len(commits)]
                commits.append((lo, hi, send_commit(lo, hi, rid)))
        parts, ends, error = _reserved(c, mover, chunks, ids, src_rows, groups, error,
                                       early if mover.policy.early_commits else None,
                                       parts, ends)
        events: list[Any] = []
        try:
            for g, (g_lo, g_hi) in enumerate(groups if error is None else ()):
                if len(groups) > 1:          # page group by page group, once all are reserved
                    for lo, hi, _rid, slots in parts:
                        mover.move(slots, src_rows[lo:hi], g_lo, g_hi, True)
                if side is not None and g == len(groups) - 1:
                    st.wait(side.event())    # the last event covers the hash's reads too
                events.append(mover.event())
        except BaseException as exc:
            error = exc
        if error is not None:
            mover.settle()                    # no launched write may land in aborted slots
            if side is not None:
                settle(side)                  # nor the hash's output in a reused buffer
            for _lo, _hi, rid, _s in parts[len(commits):]:
                c._send_nowait("abort", rid=rid)
            staging.release()
            if commits:            # whole chunks committed early stay committed, as after a
                _v, stored, _failed = pipeline.commit_replies(ns, commits, n)   # GPU failure
                if stored:
                    error.add_note(f"kvtier: {stored} of {n} blocks were stored")
            raise error
        if len(groups) > 1:                   # every chunk completes with the last group
            ends = [events[-1]] * len(parts)
        t = PutTransfer(ns, events, staging, mover.methods,
                        [(lo, hi, rid, ev) for (lo, hi, rid, _s), ev in zip(parts, ends)],
                        n, send_commit, hashed, table.device, commits,
                        ask_credit=tier == "host" and pol.put_credits)
        t.batched = mover.batched
    ns._inflight.append(t)
    return t


def _hash(ns: "Namespace", mover: Mover, table: PageTable, src_rows: np.ndarray,
          n: int) -> tuple[Any, int, Any]:
    """The GPU checksums of a put's blocks, where the layout allows: (the side stream, the
    pinned address of the n sums, the event after they have reached it), else (None, 0, None)."""
    from kvtier.gpu import xxh3
    if not (n and xxh3.supported(ns.block_bytes, tuple(table.size.tolist()))
            and not (table.base.astype(np.int64) % 16).any() and not (table.stride % 16).any()):
        return None, 0, None
    side = own(table.device, "checksums")
    sums = mover.checksums(src_rows, side)
    return side, sums, side.event()


def _reserved(c: Any, mover: Mover, chunks: list[tuple[int, int]], ids: list[int],
              src_rows: np.ndarray, groups: list[tuple[int, int]],
              error: BaseException | None, early: Any = None,
              parts: list[tuple[int, int, int, np.ndarray]] | None = None,
              ends: list[Any] | None = None
              ) -> tuple[list[tuple[int, int, int, np.ndarray]], list[Any], BaseException | None]:
    """Read every reserve reply of a put; with one page group, enqueue each chunk's copies as
    its reply arrives and record an event after them (the chunk's end), then early(parts,
    ends) (commits what has completed). Returns (the parts as (lo, hi, reservation id,
    slots), the chunks' end events, the first failure), after those given (a credit's
    chunk, moved already); after a failure nothing more is launched or committed. Where the
    connection is lost, the launched copies are waited for before ServiceUnavailable is
    raised, since the service frees the connection's reserved slots."""
    parts = [] if parts is None else parts
    ends = [] if ends is None else ends
    for (lo, hi), rid in zip(chunks, ids):
        try:
            r = c._reply(rid)
        except ServiceUnavailable:
            mover.settle()
            raise
        except KvtierError as exc:
            error = error or exc
            continue
        slots = np.frombuffer(r["slots"], "<i4")
        parts.append((lo, hi, int(r["rid"]), slots))
        if error is None and len(groups) == 1:
            try:
                mover.move(slots, src_rows[lo:hi], groups[0][0], groups[0][1], True)
                ends.append(mover.event())
                if early is not None:
                    early(parts, ends)
            except BaseException as exc:
                error = exc
    return parts, ends, error
