"""Gets: the part of the engine that serves get batches (each public method takes the engine
lock itself; the steps' locked functions run under it).

A get is decided under the lock: the batch is looked up, the copies already in the wanted tier
are pinned, HBM or host copies are brought up, and NVMe copies are planned into pinned slots
(coherence.persist.ReadPlan). The NVMe read runs with the lock released, so that other
clients' gets of resident blocks never wait for the disk; _finish_get then installs, under the
lock, the copies whose row is still at the version that was read (a block rewritten meanwhile
is a miss, never its old bytes as the new version), and makes the lease. Versions and checksums
in the reply are the ones the copies were pinned at.

A get is written once, as steps (get_steps: a generator of locked and unlocked steps), and
run by a driver: Engine.get runs them on the caller's thread; the socket server runs the
locked ones on its event loop and the read on a worker thread (kvtier.api.steps, issue 17:
a resident get beside NVMe readers). The steps split at the same lock boundaries as before,
with the eviction for the bring-ups as a step of its own ahead of the decide.

Interface. Owns nothing but the gets in flight (their _PendingGet). Public: get, drive,
get_steps, try_get, looks_resident, read (the engine's methods of those names are these,
bound). Calls: the fast path (resident batches and single keys), the transfers (bring-ups, NVMe
installs, the remote tier), the NVMe store (reads without the lock, drains), the holds' release
and lease table, and through ``GetOwner`` the engine's key checks, room making, unpinning, lease
ids and touch; the namespaces, counters and settings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
import threading
from typing import TYPE_CHECKING, Any, Callable, Generator, Protocol, cast

import numpy as np

from kvtier.coherence.fastpath import _fast as _fast_built
from kvtier.coherence.leases import count_readers
from kvtier.coherence.namespace import GetResult, Lease, Namespace, add_one
from kvtier.coherence.persist import ReadPlan
from kvtier.errors import BadRequest
from kvtier.tiers.reads import record_batch, run_batch, verdicts

try:
    from kvtier.coherence._gets import lease_current as _lease_current
    from kvtier.coherence._gets import must_bring as _must_bring
    from kvtier.coherence._gets import read_installable as _read_installable
    from kvtier.coherence._gets import read_shares as _read_shares
    from kvtier.coherence._gets import room_rows as _room_rows
    from kvtier.coherence._gets import split_rows as _split
except ImportError:             # not built: the numpy split in Gets._get, the numpy install
    _split = _read_installable = _lease_current = _room_rows = _must_bring = None
    _read_shares = None
if _fast_built is None:
    _split = None               # (the split follows lease_native's refusal: both in C or neither)
from kvtier.types import Tier

if TYPE_CHECKING:
    from kvtier.coherence.fastpath import FastPath
    from kvtier.coherence.namespace import EngineCounters
    from kvtier.coherence.persist import NvmeStore
    from kvtier.coherence.transfers import Transfers
    from kvtier.config import Settings

# The fewest evictions a get's room step splits into two slices (Gets._room_steps): below
# it the second step's own cost (~10-20 us in the service) would be more than it moves.
ROOM_SPLIT_MIN = 32


@dataclass(slots=True)
class Step:
    """One step of a get (get_steps): fn, run with the engine lock held (locked) or with it
    released (an NVMe read, a write-down). A driver runs it and sends back its result."""

    locked: bool
    fn: Callable[[], Any]
    # An NVMe read as a tiers.reads Batch: a driver with C reader threads may run it there
    # (kvtier.api.steps: the loop learns of its end by an eventfd) instead of calling fn,
    # which reads the same batch on the calling thread.
    read: Any = None


GetSteps = Generator[Step, Any, GetResult]


def advance(steps: GetSteps, value: Any, exc: BaseException | None
            ) -> tuple[Step | None, GetResult | None]:
    """Send a step's value (or throw its exception) into steps: (the next step, None), or
    (None, the get's result) when they are done."""
    try:
        return (steps.throw(exc) if exc is not None else steps.send(value)), None
    except StopIteration as stop:
        return None, stop.value


class GetOwner(Protocol):
    """What a get needs of the engine itself (the caller holds the lock)."""

    def check_keys(self, ns: Namespace, keys: Any, zero_check: bool = True) -> np.ndarray: ...
    def make_room(self, ns: Namespace, tier: Tier, n: int) -> None: ...
    def room_short(self, ns: Namespace, tier: Tier, n: int) -> int: ...
    def set_copy(self, ns: Namespace, rows: np.ndarray, tier: Tier, slots: np.ndarray,
                 versions: np.ndarray) -> None: ...
    def unpin_slots(self, ns: Namespace, tier: Tier, slots: np.ndarray) -> None: ...
    def new_id(self) -> int: ...
    def touch(self, ns: Namespace, rows: np.ndarray) -> None: ...


class Gets:
    def __init__(self, lock: threading.RLock, settings: Settings, counters: EngineCounters,
                 namespaces: dict[str, Namespace], namespace: Callable[[str], Namespace],
                 leases: dict[int, Lease], release: Callable[..., None], fast: FastPath,
                 transfers: Transfers, nvme: NvmeStore, remote: Any, owner: GetOwner) -> None:
        self.lock, self.settings, self.counters = lock, settings, counters
        self.namespaces, self.namespace = namespaces, namespace     # the engine's lookup
        # The holds' lease table (a get adds its lease to it) and Holds.release.
        self.leases, self.release = leases, release
        self.fast, self.transfers, self.nvme = fast, transfers, nvme
        self.remote, self.owner = remote, owner      # remote: the remote tier, or None
        self.check_keys = owner.check_keys       # bound once: each get checks its keys

    def get(self, namespace: str, keys: Any, owner: int = 0, tier: Tier = Tier.HOST) -> GetResult:
        """Lease the current version of each key in ``tier``, bringing it up if needed. NVMe
        reads run with the lock released (decide and pin, read, install with versions
        checked), so that other clients' gets of resident blocks do not wait for the disk."""
        return self.drive(self.get_steps(namespace, keys, owner, tier, room_first=False))

    def drive(self, steps: GetSteps) -> GetResult:
        """Run a get's steps on this thread, taking the lock for the locked ones."""
        step, out = advance(steps, None, None)
        while step is not None:
            try:
                if step.locked:
                    with self.lock:
                        value = step.fn()
                else:
                    value = step.fn()
            except BaseException as exc:        # back into the steps: their finally runs
                step, out = advance(steps, None, exc)
            else:
                step, out = advance(steps, value, None)
        return out

    def get_steps(self, namespace: str, keys: Any, owner: int = 0,
                  tier: Tier = Tier.HOST, room_first: bool = True) -> GetSteps:
        """get() as steps, for a driver: drive() here, or the socket server, which runs the
        locked steps on its event loop (no other thread then holds the GIL while it decides:
        issue 17, a resident get beside NVMe readers waited for the lock and the GIL that the
        readers' threads held) and the unlocked ones on its I/O threads. Every step's
        result is sent back into the generator; an exception is thrown back into it.

        room_first: evict for the bring-ups in a locked step ahead of the decide. It only
        shortens each locked step for a driver that answers other requests between them (the
        server's loop); the decide evicts whatever is still missing itself, so drive() on a
        caller's thread skips it (one lookup less per get: kvtier replay's CPU, issue 18)."""
        attempt = 0
        while True:
            # Eviction for the bring-ups first, as a step of its own: each step is shorter
            # (the server answers resident gets between two steps), and the decide then
            # finds the room made (or evicts again, if other gets took it meanwhile).
            if room_first:
                yield from self._room_steps(namespace, keys, tier)
            res, p = yield Step(True, partial(self._get_decide, namespace, keys, owner, tier,
                                              room_first))
            if p is not None and p.todo is not None:    # its bring-ups: a step of their own
                res, p = yield from self._steps_holding(
                    p, partial(self._bring_up_step, p, namespace, keys, owner, tier))
            if p is None:
                return res
            raced = False
            if res is None:                     # an NVMe read is planned: read it unlocked
                # The read's segment pins end in the install step, not on the I/O thread
                # after the read: the loop's decides pin segments under the log's lock, and
                # an I/O thread that held it in unpin while it waited for the GIL blocked
                # them (bench/stall_trace.py, H200 beside 8 readers: pin p90 129 us against
                # p50 33). A pin held a step longer only keeps a segment's file longer.
                held, p.plan.pins = p.plan.pins, []
                try:
                    try:
                        # The read's C batch is made in a step of its own, not in the
                        # decide's slice (~25 us of it on the dev VM: stall10).
                        yield (yield Step(True, partial(self._read_step, p, held)))
                        if p.batch is not None:     # the C read's verdicts (tiers.reads)
                            p.plan.ok = verdicts(p.ns.log, p.batch)
                    except BaseException:
                        # Its slots go back, and the lease made for the blocks already here
                        # ends with the error: the caller never sees it, so nobody would
                        # release it.
                        res = yield Step(True, partial(self._finish_get, p, held))
                        yield Step(True, partial(self.release, res.lease_id, owner))
                        raise
                    # The install, then the lease: between them the get pins every slot
                    # it serves, so nothing it installed is evicted or reused; a rewrite
                    # between is as one right after the lease (the lease serves the version
                    # read, and counts no reader on a row that moved on).
                    res = yield from self._steps_holding(
                        p, partial(self._finish_get, p, held, False),
                        partial(self._lease_step, p))
                finally:
                    if held:                    # steps abandoned before their install
                        p.ns.log.unpin(held)
                if p.plan.drop_keys:            # records that failed: deleted unlocked
                    yield from self._unlocked_or_release(partial(self.nvme.after_read, p.plan),
                                                         res, owner)
                # Read and verified, yet not installed: the block was rewritten meanwhile.
                # Its new version is in the host tier now (a put lands there), so one more try
                # serves it rather than a miss (issue 17: randrw jobs, rewrites beside reads).
                raced = p.plan.ok is not None and not res.found[p.plan_pos[p.plan.ok]].all()
            wanted = self.nvme.wanted()
            if wanted:
                yield from self._unlocked_or_release(self.nvme.drain, res, owner)
            if attempt or not (raced or (p.short and wanted)):
                return res
            # Room for the bring-up needed dirty blocks written down first (now they are), or
            # a block moved on under the read: again, once.
            yield Step(True, partial(self.release, res.lease_id, owner))
            attempt += 1

    def _steps_holding(self, p: "_PendingGet", *fns: Callable[[], Any]
                       ) -> Generator[Step, Any, Any]:
        """fns as locked steps in turn, p holding its pins across them (each a slice of the
        server's loop, with a poll between: issue 17's stall, stall10); the last one's value.
        Thrown in before one ran (a cancel: the step did not run), p's pins end in a locked
        step of their own (before, a cancel thrown in at the install step left them pinned
        for good). A step that raised ended them itself (p.abandoned)."""
        value = None
        try:
            for fn in fns:
                value = yield Step(True, fn)
            return value
        except GeneratorExit:
            raise                       # closed, not driven: no step can run any more
        except BaseException:
            if not p.abandoned:
                yield Step(True, partial(self._abandon, p))
            raise

    def _bring_up_step(self, p: "_PendingGet", namespace: str, keys: Any, owner: int,
                       tier: Tier) -> "tuple[GetResult | None, _PendingGet | None]":
        """Under the lock: the bring-ups of p.todo, which the decide's split left to this
        step; _get_decide's answers. Other requests ran since the split: each position to
        bring up must still be its key's row, at the version the split took, with no copy
        current in tier (coherence/_gets.c read_installable, which writes nothing); else the
        get's pins end and it is decided again, whole, here (a put, a delete or another
        get's install of one of these blocks came between). The copies the split found are
        pinned: nothing between could evict them."""
        todo, p.todo = p.todo, None
        ns = p.ns
        cols = ns.table.cols
        if self.namespaces.get(namespace) is not ns or not _read_installable(
                cols["version"], cols["copy_ver"], cols["key"], ns.table.n_rows, int(tier),
                np.ones(todo.size, dtype=bool), p.rows[todo], p.karr[todo], p.versions[todo]):
            self._abandon(p)
            return self._get_decide(namespace, keys, owner, tier)
        self._bring_ups(p, todo, p.todo_repeats)
        if p.plan is None:
            return self._finish_get(p), p
        return None, p

    def _lease_step(self, p: "_PendingGet") -> GetResult:
        """Under the lock: the lease of a get installed by _finish_get(lease=False); when it
        raises, the get's pins end (as in _finish_get)."""
        try:
            return self._lease_get(p)
        except BaseException:
            self._abandon(p)
            raise

    def _read_step(self, p: "_PendingGet", held: list[Any]) -> Step:
        """The NVMe read of p's plan, unlocked: the C read where it applies (one GIL-free
        call, or the driver's C threads: tiers.reads, issue 17), else run_read."""
        pool = p.ns.slots[p.tier].pool
        plan = p.plan
        p.batch = record_batch(p.ns.log, pool.array, plan.dst, plan.segs, plan.offs,
                               plan.sums, held)
        if p.batch is None:
            return Step(False, partial(self.nvme.run_read, plan, pool))
        return Step(False, partial(run_batch, p.ns.log, p.batch), read=p.batch)

    def _unlocked_or_release(self, fn: Callable[[], Any], res: GetResult,
                             owner: int) -> Generator[Step, Any, None]:
        """An unlocked step after the get's lease was made (record deletes, a write-down):
        when it raises, the lease ends with the error, since the caller never sees it."""
        try:
            yield Step(False, fn)
        except BaseException:
            yield Step(True, partial(self.release, res.lease_id, owner))
            raise

    def _room_steps(self, namespace: str, keys: Any, tier: Tier
                    ) -> Generator[Step, Any, None]:
        """The room step; and where it left the second half of a large eviction
        (ROOM_SPLIT_MIN), that half as a locked step of its own, the batch's copies pinned
        across the two (stall12: the room step, ~75 us CPU p50 in the dev VM's service, its
        eviction ~25-50 of it, was the loop's longest slice once the dispatch and the reply
        were split). Thrown in before the second ran (a cancel), the pins end in a step of
        their own; closed undriven (GeneratorExit), nothing runs, as in _steps_holding."""
        rest = yield Step(True, partial(self._room_for_get, namespace, keys, tier))
        if rest is None:
            return
        ns, rows, want, later, keep = rest
        try:
            yield Step(True, partial(self._room_rest, ns, tier, rows, want, later, keep))
        except GeneratorExit:
            raise
        except BaseException:
            if keep:                    # (not run: _room_rest ends them, raising or not)
                yield Step(True, partial(self.owner.unpin_slots, ns, tier, keep.pop()))
            raise

    def _room_for_get(self, namespace: str, keys: Any, tier: Tier
                      ) -> "tuple[Namespace, np.ndarray, int, int, list[np.ndarray]] | None":
        """Under the lock: evict for the blocks of keys that are not current in tier (those
        the decide will bring up). Only a head start, never a promise: the decide checks
        everything again, evicting what is still missing; a block this evicts that the get
        wanted is brought up again (the victims are the policy's coldest). An eviction of
        ROOM_SPLIT_MIN blocks or more is made half here, and (ns, rows, want, the evictions
        left, [the pinned slots]) returned for _room_rest to make the rest; else None, every
        pin ended."""
        ns = self.namespace(namespace)
        if tier not in ns.slots:
            return None                         # the decide raises the error
        rows = ns.table.lookup(self.check_keys(ns, keys, zero_check=False))
        # The batch's own copies in tier are pinned while the room is made: evicting one
        # would only make the decide bring it up again and evict once more (bench/stall.py
        # in process: half the decides evicted a second time without the pins).
        want, keep = _room_count(ns, rows, tier)
        if not want:
            return None
        short = self.owner.room_short(ns, tier, want)
        later = short // 2 if short >= ROOM_SPLIT_MIN else 0
        try:
            # (make_room's evictions grow by one with each block asked for: want - later
            # leaves later of them to the next step.)
            self.owner.make_room(ns, tier, want - later)
        except BaseException:
            self.owner.unpin_slots(ns, tier, keep)
            raise
        if not later:
            self.owner.unpin_slots(ns, tier, keep)
            return None
        return ns, rows, want, later, [keep]

    def _room_rest(self, ns: Namespace, tier: Tier, rows: np.ndarray, want: int,
                   later: int, keep: list[np.ndarray]) -> None:
        """Under the lock: the rest of _room_for_get's eviction (later blocks, unless what
        ran in between changed it), then the batch's pins it held end (keep is emptied).
        Where more than later would be evicted, the room was taken in between, maybe by a
        get that brought up blocks of this batch: for want alone make_room then evicted
        that many blocks more than the decide needs (rev13: 48 where 24 were missing), so
        the blocks still missing are counted again (~6-18 us for 64 rows on the dev VM, a
        third of the slice: only then). On the first slice's rows, never more than its
        want: a row removed and reused in between only makes this head start less exact
        (the decide evicts what is missing)."""
        try:
            if self.owner.room_short(ns, tier, want) > later:
                want = min(want, _missing_count(ns, rows, tier))
            if want:
                self.owner.make_room(ns, tier, want)
        finally:
            self.owner.unpin_slots(ns, tier, keep.pop())

    def _get_decide(self, namespace: str, keys: Any, owner: int, tier: Tier,
                    split: bool = False) -> "tuple[GetResult | None, _PendingGet | None]":
        """Under the lock: (result, None) when nothing had to move; (result, pending) when
        it was finished here with copies from memory; (None, pending) when pending.plan
        must be read from NVMe first. split: the bring-ups may be left to a step of their
        own (_bring_up_step), pending.todo then naming them, pending.plan None."""
        out = self._get(namespace, keys, owner, tier, io=True, split=split)
        if isinstance(out, GetResult):
            return out, None
        p = cast(_PendingGet, out)
        if p.todo is not None:
            return None, p
        if p.plan is None:
            return self._finish_get(p), p
        return None, p

    def try_get(self, namespace: str, keys: Any, owner: int = 0) -> GetResult | None:
        """get() when every found block is already in the host tier; None when it would have
        to move bytes between tiers (the caller then runs get() off the event loop)."""
        with self.lock:
            out = self._get(namespace, keys, owner, Tier.HOST, io=False)
            return self._finish_get(out) if isinstance(out, _PendingGet) else out

    def looks_resident(self, namespace: str, keys: Any) -> bool:
        """Unlocked and racy: whether a host get of keys looked memory-only a moment ago
        (every key found is current in the host tier, and no miss needs the remote tier).

        Only for choosing where a get waits (the server sends one that looks like it needs
        the disk straight to the I/O pool, not through the loop's try_get and the memory
        lane, where the batches of workers reading NVMe queued in front of resident gets:
        issue 17). Every decision is made again under the lock, so a wrong answer costs
        time, never a wrong block. Reads the table without the lock: each C or numpy call
        sees a consistent array (the GIL), a concurrent change at worst a stale one."""
        ns = self.namespaces.get(namespace)
        if ns is None or Tier.HOST not in ns.slots:
            return True                 # the locked path gives the error
        if isinstance(keys, (bytes, bytearray)) and len(keys) <= ns.key_width:
            return True                 # one key: try_get's fast path costs less than this
        table = ns.table
        try:
            rows = table.lookup(table.keys_array(keys))
        except (BadRequest, ValueError, RuntimeError):
            # Bad keys (the locked path says so), or an index caught mid-rebuild.
            return True
        hit = rows[rows >= 0]
        if hit.size < rows.size and self.remote is not None:
            return False
        if hit.size == 0:
            return True
        version, copy_ver = table.cols["version"], table.cols["copy_ver"]
        if int(hit.max()) >= min(version.size, copy_ver.shape[0]):   # columns mid-growth
            return True
        return bool((copy_ver[hit, Tier.HOST] == version[hit]).all())

    def _get(self, namespace: str, keys: Any, owner: int, tier: Tier,
             io: bool, split: bool = False) -> "GetResult | _PendingGet | None":
        ns = self.namespace(namespace)
        if tier not in ns.slots:
            raise BadRequest(f"namespace {ns.name!r} has no {tier.label} tier to serve from")
        karr = self.check_keys(ns, keys, zero_check=False)
        if karr.size == 1:
            res = self.fast.get_one(ns, karr, owner, tier)
            if res is not None:
                return res
        cols = ns.table.cols
        n = karr.size
        rows = ns.table.lookup(karr)
        res = self.fast.lease_native(ns, rows, owner, tier)
        if res is not None:
            return res
        if io and _split is not None:
            return self._split_native(ns, karr, rows, owner, tier, split)
        if not io:
            # try_get of a batch that must read the disk (an NVMe reader's, tried on the loop
            # before its steps: issue 17's stall): refused after one check, not after the
            # dozen numpy calls below (86 -> 53 us a 64-key batch, dev VM, one pair); the
            # check in one C call where _gets is built (stall8).
            if _must_bring is not None:
                if _must_bring(cols["version"], cols["copy_ver"], rows, ns.table.n_rows,
                               int(tier)):
                    return None
            else:
                f = rows[rows >= 0]
                v = cols["version"][f]
                if ((cols["copy_ver"][f, tier] != v) & (v > 0)).any():
                    return None
        found = rows >= 0
        if found.all():
            ver = cols["version"][rows]
            if ver.all() and (cols["copy_ver"][rows, tier] == ver).all():
                return self.fast.lease_resident(ns, rows, ver, owner, tier)
        else:
            _refuse_zero_key(karr[~found])      # never stored, so only a missing key can be it
        fr = rows[found]
        found[found] = cols["version"][fr] > 0
        st = ns.slots[tier]
        slots = np.full(n, -1, dtype=np.int64)
        idx = np.flatnonzero(found)
        r = rows[idx]
        ready = cols["copy_ver"][r, tier] == cols["version"][r]
        if not io and (not ready.all() or (self.remote is not None and not found.all())):
            return None
        ri = idx[ready]
        slots[ri] = cols["slot"][rows[ri], tier]
        # Pin what is already here before anything else can evict it.
        add_one(st.leases, slots[ri])
        self.counters.tiers[tier].hits += int(ri.size)
        safe = np.maximum(rows, 0)
        p = _PendingGet(ns, karr, rows, found, slots, tier, owner,
                        np.where(found, cols["version"][safe], 0).astype(np.uint64),
                        np.where(found, cols["checksum"][safe], 0).astype(np.uint64))
        todo = idx[~ready]
        if todo.size:
            # (Most batches repeat nothing: one sort tells.)
            tr = np.sort(rows[todo])
            self._bring_ups(p, todo, not (tr[1:] != tr[:-1]).all())
        return p

    def _split_native(self, ns: Namespace, karr: np.ndarray, rows: np.ndarray, owner: int,
                      tier: Tier, split: bool = False) -> "_PendingGet":
        """_get's io path from lease_native's refusal on, its split in one C call
        (coherence/_gets.c: found, the ready copies pinned, the versions and checksums, the
        positions to bring up, whether they repeat): the same effects as the numpy path
        below it, which try_get and builds without the module take."""
        n = karr.size
        miss = rows < 0
        if miss.any():
            _refuse_zero_key(karr[miss])        # before anything is pinned
        cols = ns.table.cols
        found = np.empty(n, dtype=bool)
        slots = np.empty(n, dtype=np.int64)
        versions = np.empty(n, dtype=np.uint64)
        sums = np.empty(n, dtype=np.uint64)
        todo = np.empty(n, dtype=np.int64)
        k, hits, repeats = _split(cols["version"], cols["copy_ver"], cols["slot"],
                                  cols["checksum"], ns.slots[tier].leases, rows,
                                  ns.table.n_rows, int(tier), found, slots, versions, sums, todo)
        self.counters.tiers[tier].hits += hits
        p = _PendingGet(ns, karr, rows, found, slots, tier, owner, versions, sums)
        if k and split and _read_installable is not None:
            p.todo, p.todo_repeats = todo[:k], repeats     # (_bring_up_step brings them up)
        elif k:
            self._bring_ups(p, todo[:k], repeats)
        return p

    def _bring_ups(self, p: "_PendingGet", todo: np.ndarray, repeats: bool) -> None:
        """Plan p's bring-ups of batch positions todo (found, not current in p.tier). A key
        repeated in the batch is brought up once; its repeats share the slot (np.unique's
        index arrays and the set difference only when the batch repeats a key). When it
        raises, the pins p held end (_abandon)."""
        ns, rows, tier, slots, found = p.ns, p.rows, p.tier, p.slots, p.found
        try:
            if not repeats:
                p.plan, p.plan_pos, p.short = self.transfers.bring_up(ns, rows, todo, tier,
                                                                      slots, found)
                return
            _, first, inv = np.unique(rows[todo], return_index=True, return_inverse=True)
            inv = inv.reshape(-1)
            p.plan, p.plan_pos, p.short = self.transfers.bring_up(ns, rows, todo[first], tier,
                                                                  slots, found)
            rep = np.setdiff1d(np.arange(todo.size), first)
            if rep.size:
                p.repeats, p.repeat_src = todo[rep], todo[first][inv[rep]]
        except BaseException:
            # The copies already here were pinned (and bring_up gave back its own slots, or
            # its plan is p's): their pins end with the error (a device copy that failed,
            # fix9). Nothing else pins them: the decide's caller never sees p.
            if p.plan is not None:
                ns.log.unpin(p.plan.pins)
            self._abandon(p)
            raise

    def _finish_get(self, p: "_PendingGet", held: list[Any] | None = None,
                    lease: bool = True) -> GetResult | None:
        """The rest of a get, under the lock: NVMe copies installed, repeats share their
        slot, misses filled from the remote tier, and the lease (lease=False: not yet, None
        returned; _lease_step makes it). Versions and checksums are the ones the copies
        were pinned at. held: the NVMe read's segment pins, ended here (and emptied) after
        the install."""
        if held:
            try:
                return self._finish_get(p, None, lease)
            finally:
                segs, held[:] = list(held), []
                p.ns.log.unpin(segs)
        ns, tier, found, slots = p.ns, p.tier, p.found, p.slots
        try:
            if p.plan is not None:
                self._install_read(p)
                p.installed = True
            if p.repeats.size:
                src = p.repeat_src
                # Pinned before they are named: an error in between leaves a pin, never
                # ends one twice.
                add_one(ns.slots[tier].leases, slots[src[found[src]]])
                slots[p.repeats] = slots[src]
                found[p.repeats] = found[src]
            return self._lease_get(p) if lease else None
        except BaseException:
            # No lease was made (it is _lease_get's last step): the get's pins end here, or
            # nobody would ever end them (from_remote raising, rev8; the install, fix9).
            self._abandon(p)
            raise

    def _abandon(self, p: "_PendingGet") -> None:
        """Under the lock, for a finish that raised before its lease: every pin the get holds
        ends, and the slots its NVMe read was to fill go back free, with the host budget.

        A served position (found, with a slot) holds one pin: a copy already here, one
        brought up from memory or installed, a repeat's share, a remote fill. Until the
        install returned, the read's positions hold only what install_read put there (a
        copy another get installed meanwhile, pinned for this get), and the read's own
        slots (plan.dst) one pin each; Transfers.give_back undoes a partial install."""
        if p.abandoned:
            return                      # (its pins ended already)
        p.abandoned = True
        ns, tier, found, slots = p.ns, p.tier, p.found, p.slots
        pinned = found & (slots >= 0)
        if p.plan is not None and not p.installed:
            dst = p.plan.dst.astype(np.int64)
            pinned[p.plan_pos] &= slots[p.plan_pos] != dst
            self.transfers.give_back(ns, tier, p.plan.rows, dst)
        self.owner.unpin_slots(ns, tier, slots[pinned])

    def _lease_get(self, p: "_PendingGet") -> GetResult:
        """_finish_get's end: the remote tier's fills, then the lease. Every served position
        holds one pin on its slot in p.tier, which the lease takes over. The lease is made
        last: whatever raises here leaves none, and the rows' reader counts as they were (the
        caller ends the pins)."""
        ns, tier, rows, found, slots = p.ns, p.tier, p.rows, p.found, p.slots
        cols = ns.table.cols
        if self.remote is not None and not found.all():
            before = found.copy()
            self.transfers.from_remote(ns, p.karr, rows, found, slots, tier)
            got = found & ~before
            p.versions[got] = cols["version"][rows[got]]
            p.sums[got] = cols["checksum"][rows[got]]
        every = bool(found.all())
        if every:
            # Every key served (an NVMe reader's usual get): the batch's own arrays, no
            # selection (p's arrays are this get's alone: nothing uses them after this).
            srows, versions, karr, lslots = rows, p.versions, p.karr, slots
        else:
            served = np.flatnonzero(found)
            srows, versions = rows[served], p.versions[served]
            karr, lslots = p.karr[served], slots[served].astype(np.int64)
        # Readers count on rows still at the version served (a rewrite resets the count).
        if _lease_current is not None:
            cur = np.empty(srows.size, dtype=np.int64)
            cur = cur[:_lease_current(cols["version"], cols["key"], cols["leases"], srows,
                                      versions, karr, cur)]
        else:
            cur = srows[(cols["version"][srows] == versions) & (cols["key"][srows] == karr)]
            count_readers(cols["leases"], cur)     # saturating, as lease_current
        try:
            self.owner.touch(ns, cur)      # in batch order: the last key of a prefix is the newest
            lid = self.owner.new_id()
            lease = Lease(lid, ns, tier, lslots, srows, versions.copy(), p.owner,
                          time.monotonic() + self.settings.lease_timeout)
            if every:
                res = GetResult(found, slots.astype(np.int32), p.versions.copy(),
                                p.sums.copy(), lid, tier)
            else:
                res = GetResult(found, slots.astype(np.int32), np.where(found, p.versions, 0)
                                .astype(np.uint64), np.where(found, p.sums, 0)
                                .astype(np.uint64), lid, tier)
        except BaseException:
            # The counts come off again (the caller ends the pins). A count held at the top
            # comes down one it never went up: a count at 65,535 is "many" already.
            count_readers(cols["leases"], cur, -1)
            raise
        # The lease is the last step, nothing after it raises: a lease in the table whose
        # get raised was ended twice, by its release or expiry and by the caller's unpin.
        self.counters.gets += p.karr.size
        self.counters.get_hits += int(srows.size)
        self.counters.tiers[tier].bytes_read += int(srows.size) * ns.block_bytes
        self.leases[lid] = lease
        return res

    def _install_read(self, p: "_PendingGet") -> None:
        """Under the lock: p's NVMe copies installed (Transfers.install_read). The usual
        case - every record read and verified, its row still at the version read, no copy
        current in the tier meanwhile - is told by one C call (coherence/_gets.c
        read_installable, which writes nothing) and installed here with the same set_copy;
        anything else takes install_read, which drops, shares or frees what it must (issue 17,
        round 5: its checks were ~80 us of a ~230 us install step on the dev VM)."""
        plan, tier = p.plan, p.tier
        cols = p.ns.table.cols
        args = (cols["version"], cols["copy_ver"], cols["key"], p.ns.table.n_rows, int(tier),
                plan.ok, plan.rows, plan.keys, plan.versions)
        if _read_installable is None or plan.ok is None or not _read_installable(*args):
            if _read_installable is not None and plan.ok is not None and _read_shares is not None:
                # Every record installable as read, some already installed by another get's
                # read of the same blocks (stall10: most installs beside 4 readers of random
                # batches): shared without finish_read's checks, which would all pass.
                have = np.empty(plan.rows.size, dtype=bool)
                if _read_shares(*args, have) > 0:
                    self.transfers.install_shared(plan, tier, p.plan_pos, p.slots, have)
                    return
            self.transfers.install_read(plan, tier, p.plan_pos, p.rows, p.slots, p.found)
            return
        dst = plan.dst.astype(np.int64)
        self.owner.set_copy(p.ns, plan.rows, tier, dst, plan.versions)
        p.slots[p.plan_pos] = dst

    def read(self, namespace: str, keys: Any) -> tuple[np.ndarray, np.ndarray]:
        """get + copy + release, for in-process readers: (found mask, n x block_bytes array)."""
        res = self.get(namespace, keys)
        try:
            ns = self.namespace(namespace)
            out = np.zeros((res.found.size, ns.block_bytes), dtype=np.uint8)
            idx = np.flatnonzero(res.found)
            out[idx] = ns.slots[Tier.HOST].pool.read(res.slots[idx])   # leased: stable
        finally:
            self.release(res.lease_id)
        return res.found, out


def _room_count(ns: Namespace, rows: np.ndarray, tier: Tier) -> tuple[int, np.ndarray]:
    """(want, keep) for the room step: want, the positions of rows (a lookup's) whose row has a
    version and no current copy in tier (what the decide brings up); keep, the slots of the
    current ones, pinned here when want > 0 (else nothing is pinned, keep is empty). One C call
    (coherence/_gets.c room_rows, stall7: ~50 us of numpy calls before) or the numpy count,
    which it must match (tests/test_gets.py)."""
    cols = ns.table.cols
    leases = ns.slots[tier].leases
    if _room_rows is not None:
        keep = np.empty(rows.size, dtype=np.int64)
        want, k = _room_rows(cols["version"], cols["copy_ver"], cols["slot"], leases, rows,
                             ns.table.n_rows, int(tier), keep)
        return want, keep[:k]
    r = rows[rows >= 0]
    v = cols["version"][r]
    here = cols["copy_ver"][r, tier] == v
    want = int(((~here) & (v > 0)).sum())       # a row without a version is not brought up
    if not want:
        return 0, _NO_SLOTS
    keep = cols["slot"][r[here & (v > 0)], tier].astype(np.int64)
    add_one(leases, keep)
    return want, keep


def _missing_count(ns: Namespace, rows: np.ndarray, tier: Tier) -> int:
    """_room_count's want alone (no pins): the positions of rows whose row has a version and
    no current copy in tier. Rows past the table (none, unless it shrank) count as missing
    nothing."""
    cols = ns.table.cols
    r = rows[(rows >= 0) & (rows < ns.table.n_rows)]
    v = cols["version"][r]
    return int(((cols["copy_ver"][r, tier] != v) & (v > 0)).sum())


_NO_SLOTS = np.empty(0, dtype=np.int64)


def _refuse_zero_key(karr: np.ndarray) -> None:
    if not karr.view(np.uint8).reshape(karr.size, -1).any(axis=1).all():
        raise BadRequest("the all-zero key is reserved (it means 'no parent'); hash your "
                         "keys so that none is all zeros")


@dataclass(slots=True)
class _PendingGet:
    """A get between its locked decision and its locked finish (an NVMe read in between)."""

    ns: Namespace
    karr: np.ndarray
    rows: np.ndarray
    found: np.ndarray
    slots: np.ndarray
    tier: Tier
    owner: int
    versions: np.ndarray        # per position, the version pinned (0 where not found)
    sums: np.ndarray
    plan: ReadPlan | None = None
    plan_pos: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    repeats: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    repeat_src: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    short: bool = False         # some bring-ups found no room
    installed: bool = False     # the plan's install returned (its slots are the rows' now)
    abandoned: bool = False     # _abandon ended its pins (no lease will be made)
    todo: np.ndarray | None = None  # positions the decide left to _bring_up_step
    todo_repeats: bool = False      # (whether those repeat a row)
    batch: Any = None           # the plan's read as a tiers.reads Batch (None: run_read)
