"""The scheduler side of an engine connector, with no engine imported: lookups, and the plan
of loads and stores that each engine step hands to the workers.

Lifecycle of one request (vLLM's hook names; kvtier.integrations.vllm calls these):

1. ``lookup`` (get_num_new_matched_tokens): one ``match_prefix`` (``Namespace.lookup``) of the
   request's block hashes past the engine's own hit, in every tensor-parallel rank's
   namespace; the hit is the shortest of them (a block missing on one rank is a miss for
   all), cut so that at least one prompt token is left to compute. The lookup also asks the
   service to stage the part of the hit that only NVMe holds up to host at once, and says
   whether there was such a part: then (``background_loads``) the load is asynchronous, the
   request waits for it (vLLM's WAITING_FOR_REMOTE_KVS) and the batch does not. kvtier down or
   slow: 0, and the engine computes everything.
2. ``allocated`` (update_state_after_alloc): the engine gave the hit its blocks; the load of
   hit blocks [first, first + n) into those block ids joins the next plan, marked background
   or not.
3. ``scheduled`` (build_connector_meta, for every request in the step): each block that becomes
   full in this step is stored after the forward, with its parent (the previous block's hash),
   so that a later request, engine or restart finds the chain. Blocks the engine computes
   again (it recomputes from the first block of a failed load) are stored again: the step
   stores from the engine's computed-token count before it, not from what was planned.
4. ``finished`` (request_finished): the request's state goes; nothing is held, since stores
   complete in the step that computed them.

Blocks found at a lookup may be evicted before the worker loads them. The worker then reports
their block ids as load errors, and the engine recomputes from the first of them
(vLLM's kv_load_failure_policy="recompute"): a miss, never a wrong block. The worker also drops
the stores that a request with a failed load planned in that step (they were computed over
the blocks that did not arrive); the recompute stores them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet as Set, Any, Callable, Sequence

from kvtier.errors import NamespaceError
from kvtier.integrations.connector import Link

@dataclass(slots=True)
class LoadSpec:
    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    background: bool = False           # the engine does not wait for it (vLLM: load_kv_async)


@dataclass(slots=True)
class TransferPlan:
    """One step's work for the workers: loads (before the forward, or in the background) and
    one store batch after it, each store tagged with its request."""

    loads: list[LoadSpec] = field(default_factory=list)
    store_keys: list[bytes] = field(default_factory=list)
    store_parents: list[bytes] = field(default_factory=list)
    store_block_ids: list[int] = field(default_factory=list)
    store_req_ids: list[str] = field(default_factory=list)
    # For each request admitted in a step with loads before the forward: the block ids this
    # step loads (its own, or another request's that the engine's prefix cache shares with
    # it) among the blocks before its computed tokens. If one of them fails, whatever the
    # request computes over it is garbage: its stores are dropped.
    reads: dict[str, list[int]] = field(default_factory=dict)

    def empty(self) -> bool:
        return not self.loads and not self.store_keys


@dataclass(slots=True)
class _Req:
    hashes: Sequence[bytes]            # the engine's live list: it grows as tokens are added
    first: int = 0                     # first block the lookup may fill (the local hit's end)
    hit: int = 0                       # blocks found at the lookup, counted from 0
    stored: int = 0                    # blocks [0, stored) are in kvtier or planned to be
    background: bool = False           # part of the hit is below host memory: load it async
    loading: list[int] = field(default_factory=list)   # block ids of its background load
    load_failed: bool = False          # its background load failed: compute, do not look up


class Planner:
    """Scheduler-side state of one engine. namespaces: one name per tensor-parallel rank;
    background: load hits that are partly on NVMe asynchronously (the setting
    background_loads)."""

    def __init__(self, link: Link, namespaces: list[str], block_size: int, key_width: int,
                 background: bool = True) -> None:
        self.link = link
        self.namespaces = namespaces
        self.block_size = block_size
        self.background = background
        self.zero = bytes(key_width)
        self._reqs: dict[str, _Req] = {}
        self._loading: set[str] = set()     # requests whose background load is in flight
        self._plan = TransferPlan()
        self._loaded_now: set[int] = set()  # block ids the plan loads before the forward
        self._admitted: set[str] = set()    # requests allocated in this step

    def lookup(self, req_id: str, hashes: Sequence[bytes], num_tokens: int,
               num_computed: int) -> tuple[int, bool]:
        """Tokens beyond num_computed (block-aligned) that kvtier can load, and whether to load
        them in the background; (0, False) on any failure."""
        bs = self.block_size
        first = num_computed // bs
        limit = min(len(hashes), (num_tokens - 1) // bs)      # leave a token to compute
        old = self._reqs.get(req_id)
        req = _Req(hashes, first=first, stored=first,
                   load_failed=old is not None and old.load_failed)
        self._reqs[req_id] = req
        self.link.stats.add("lookups")
        if limit <= first or req.load_failed:
            # (After a failed background load the engine frees the request's blocks and asks
            # again: the same hit would fail the same way, for ever.)
            return 0, False
        keys = b"".join(hashes[first:limit])

        def match(c: Any) -> tuple[int, int]:
            n, below = limit - first, 0
            for name in self.namespaces:
                try:
                    hit = self.link.namespace(c, name).lookup(keys, stage=True)
                except NamespaceError:
                    return 0, 0         # nothing stored for this rank yet: a plain miss
                n, below = min(n, hit.n), max(below, hit.below)
            return n, below
        n, below = self.link.call(match, "lookup_errors") or (0, 0)
        if n <= 0:
            return 0, False
        req.hit = first + n
        req.background = self.background and below > 0
        self.link.stats.add("hit_tokens", n * bs)
        return n * bs, req.background

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """The engine allocated block_ids for the request; load num_external tokens into them."""
        self._admitted.add(req_id)
        req = self._reqs.get(req_id)
        if req is None or num_external <= 0:
            return
        n = min(num_external // self.block_size, req.hit - req.first)
        last = req.first + n
        if n <= 0:
            return
        if len(block_ids) < last:
            # vLLM now counts the hit's tokens as computed; planning no load would leave them
            # unwritten, i.e. wrong tokens. A broken invariant of vLLM's block accounting.
            raise RuntimeError(f"kvtier: vLLM allocated {len(block_ids)} blocks to request "
                               f"{req_id!r}, fewer than the {last} its {num_external} external "
                               "tokens need; refusing to leave them unloaded")
        self._plan.loads.append(LoadSpec(req_id, list(req.hashes[req.first:last]),
                                         list(block_ids[req.first:last]), req.background))
        if req.background:
            self.link.stats.add("background_loads")
            req.loading = list(block_ids[req.first:last])
            self._loading.add(req_id)
        else:
            self._loaded_now.update(block_ids[req.first:last])
        req.stored = max(req.stored, last)

    def loads_done(self, finished: Set[str], failed_block_ids: Set[int]) -> None:
        """Each step's worker output (vLLM's update_connector_output): failed_block_ids, the
        block ids some rank did not fill in this step; finished, the requests whose background
        load every rank has completed (a rank may report its failures a step earlier)."""
        if failed_block_ids:
            for rid in self._loading:
                req = self._reqs.get(rid)
                if req is not None and not failed_block_ids.isdisjoint(req.loading):
                    req.load_failed = True
        for rid in finished & self._loading:
            self._loading.discard(rid)
            req = self._reqs.get(rid)
            if req is not None:
                req.loading = []

    def scheduled(self, req_id: str, block_ids: Sequence[int] | Callable[[], Sequence[int]],
                  computed_before: int, computed_after: int) -> None:
        """The step computes the request's tokens [computed_before, computed_after): store the
        blocks that become full (their hashes exist once the tokens are in the request), and
        those computed again after a failed load (computed_before fell back below them).
        Where this step loads blocks before the forward, a request admitted in it also lists
        the loaded ones among its blocks (TransferPlan.reads): one sharing a block whose load
        fails (the engine's prefix cache hands it the loading request's block in the same
        step) computes over garbage, and the worker drops its stores. Only requests admitted
        in this step can hold a block allocated in it, so running ones are not scanned.

        block_ids may be a function that returns them: it is called only in a step that needs
        them (a block fills, or the request was admitted beside loads), so that a running
        request's decode steps inside a block cost no list of its whole context's block ids
        (O(context) per request per step in the engine's get_block_ids)."""
        req = self._reqs.get(req_id)
        if req is None:
            return
        bs = self.block_size
        lo = min(req.stored, computed_before // bs)
        full = min(computed_after // bs, len(req.hashes))
        reads_wanted = bool(self._loaded_now) and req_id in self._admitted
        if full <= lo and not reads_wanted:
            return
        if callable(block_ids):
            block_ids = block_ids()
        if reads_wanted:
            reads = [b for b in block_ids[:computed_before // bs] if b in self._loaded_now]
            if reads:
                self._plan.reads[req_id] = reads
        full = min(full, len(block_ids))
        if full <= lo:
            return
        p = self._plan
        p.store_keys.extend(req.hashes[lo:full])
        p.store_parents.append(req.hashes[lo - 1] if lo else self.zero)
        p.store_parents.extend(req.hashes[lo:full - 1])
        p.store_block_ids.extend(block_ids[lo:full])
        p.store_req_ids.extend([req_id] * (full - lo))
        req.stored = full

    def finished(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
        self._loading.discard(req_id)

    def take_plan(self) -> TransferPlan:
        """This step's plan (a block two requests both fill is deduplicated by the worker,
        which first drops the stores of requests whose load failed)."""
        plan, self._plan = self._plan, TransferPlan()
        self._loaded_now, self._admitted = set(), set()
        return plan
