"""The worker side of an engine connector, with no engine imported: moves the planned blocks
between kvtier and this rank's KV cache.

The KV cache is described once, at registration, as a ``kvtier.api.layouts.Pages`` (vLLM's
per-layer tensors: a block is one page per layer, or two with K and V apart) or as one row
buffer (a block-outermost layout, one contiguous row per block). Loads go straight from the
leased slots into the engine's block ids, stores straight from them into reserved slots
(``Namespace.get(out=, rows=)`` / ``put(..., rows=)``): no staging buffer on the host path.
The one data call is ``_move``, so that the CUDA path (an engine stream, an event back) is a
change in one place.

Failures: a load that kvtier cannot serve (down, slow, the block evicted since the lookup)
returns the engine block ids that were not filled; the engine recomputes from the first of
them. The stores a request planned in a step where its load failed are dropped: they were
computed over the blocks that did not arrive (the engine recomputes and stores them again). A
store that fails is dropped and counted: a later lookup simply misses.

Under tensor parallelism a rank's new blocks depend on every rank's KV, so each rank drops
the stores that any rank's failed load spoiled (``union_failures`` of what every rank saw).

Background loads (``BackgroundLoads``, vLLM's asynchronous loads of a hit that is partly on
NVMe) run on a thread of their own, through a Mover on its own connection, one batch per
engine step, into blocks the engine does not touch until the request is reported done.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import AbstractSet as Set, Any

import numpy as np

from kvtier.api.layouts import Pages
from kvtier.errors import ConfigError, NamespaceError, ServiceUnavailable
from kvtier.integrations.connector import Link
from kvtier.integrations.planner import LoadSpec, TransferPlan

log = logging.getLogger("kvtier.integrations")


class Mover:
    """One rank's mover. blocks: a Pages or a row buffer; layout: the namespace's record."""

    def __init__(self, link: Link, name: str, key_width: int, blocks: Any, block_bytes: int,
                 layout: dict[str, Any]) -> None:
        self.link = link
        self.name = name
        self.blocks = blocks
        self._create = {"block_bytes": block_bytes, "key_width": key_width, "layout": layout}

    def open(self) -> None:
        """Create or open the namespace at start-up. Another layout under the same name is a
        configuration error (the engine must not start); kvtier not running is not: the
        engine serves without it and the mover connects once it answers."""
        try:
            self.link.namespace(self.link.client(), self.name, self._create)
        except NamespaceError as exc:
            raise ConfigError(f"kvtier refused this engine's KV layout: {exc}") from None
        except ServiceUnavailable as exc:
            log.warning("kvtier is not reachable yet (%s); serving without it until it is", exc)

    def _move(self, op: str, keys: bytes, rows: list[int],
              parents: bytes | None = None) -> np.ndarray | None:
        """The one data call: op "get" returns the found mask, "put" None."""
        def run(c: Any) -> np.ndarray | bool:
            ns = self.link.namespace(c, self.name, self._create)
            if op == "get":
                found, _ = ns.get(keys, out=self.blocks, rows=rows)
                return found
            ns.put(keys, self.blocks, parents=parents, rows=rows)
            return True
        counter = "load_errors" if op == "get" else "store_errors"
        return self.link.call(run, counter, errors=len(rows))

    def load(self, loads: list[LoadSpec]) -> set[int]:
        """Fill the planned blocks; returns the engine block ids that were not filled."""
        if not loads:
            return set()
        rows = [b for spec in loads for b in spec.block_ids]
        keys = b"".join(k for spec in loads for k in spec.keys)
        found = self._move("get", keys, rows)
        if found is None:
            return set(rows)             # counted as load errors by the link
        missing = np.flatnonzero(~found)
        self.link.stats.add("loaded_blocks", int(found.sum()))
        if missing.size:
            self.link.stats.add("load_errors", int(missing.size))
            log.info("kvtier: %d of %d blocks found at lookup were gone at load (evicted); "
                     "the engine recomputes them", missing.size, len(rows))
        return {rows[i] for i in missing.tolist()}

    @staticmethod
    def spoiled(plan: TransferPlan, failed_reqs: Set[str], failed_blocks: Set[int]
                ) -> set[str]:
        """The requests whose computation in this step went over a block that did not
        arrive: failed_reqs (their own load failed) and those that read one of failed_blocks
        (plan.reads: blocks shared with them in this step)."""
        out = set(failed_reqs)
        if failed_blocks:
            out.update(r for r, reads in plan.reads.items()
                       if not failed_blocks.isdisjoint(reads))
        return out

    def save(self, plan: TransferPlan, failed_reqs: Set[str] = frozenset(),
             failed_blocks: Set[int] = frozenset()) -> None:
        """Store the plan's blocks, except those of the spoiled requests (``spoiled``: their
        new blocks were computed over blocks that never arrived); a block that two requests
        filled is stored once."""
        failed_reqs = self.spoiled(plan, failed_reqs, failed_blocks)
        seen: set[bytes] = set()
        keep = [i for i, (k, r) in enumerate(zip(plan.store_keys, plan.store_req_ids))
                if r not in failed_reqs and not (k in seen or seen.add(k))]
        if not keep:
            return
        keys = b"".join(plan.store_keys[i] for i in keep)
        parents = b"".join(plan.store_parents[i] for i in keep)
        if self._move("put", keys, [plan.store_block_ids[i] for i in keep], parents) is not None:
            self.link.stats.add("stored_blocks", len(keep))


def warm(pages: Pages, device: int) -> bool:
    """At registration, for a KV cache on a GPU: the kernels compiled and the mapped-read
    probe (gpu_sorted_gets = auto) run now, before the first forward, not inside the first
    step that loads blocks. A failure (no cupy on the host, a CUDA error) is logged and
    returns False: it is the first load's failure later, a counted miss, never a failed
    start of the engine. Nothing for host memory (True)."""
    if not pages.is_cuda:
        return True
    try:
        from kvtier.gpu import warm as warm_gpu
        warm_gpu(device)
    except Exception as exc:
        log.warning("kvtier: the CUDA path could not be warmed (%s: %s); loads and stores "
                    "will try again, and count what fails", type(exc).__name__, exc)
        return False
    return True


class SpoiledStores:
    """Which requests' stores a step drops. async_scheduling: the engine plans step N+1
    before it learns of step N's failed loads (vLLM's async scheduling), so what N+1 computes
    for N's spoiled requests, further over the same garbage, is dropped too; N+2 is planned
    from the rolled-back counts and stores the recomputed blocks again. Without it N+1 is
    that recompute, and is kept."""

    def __init__(self, async_scheduling: bool) -> None:
        self.async_scheduling = async_scheduling
        self._before: set[str] = set()

    def step(self, plan: TransferPlan, failed_reqs: Set[str], failed_blocks: Set[int]
             ) -> set[str]:
        spoiled = Mover.spoiled(plan, failed_reqs, failed_blocks)
        out = spoiled | self._before
        self._before = spoiled if self.async_scheduling else set()
        return out


def union_failures(per_rank: list[tuple[set[str], set[int]]]) -> tuple[set[str], set[int]]:
    """Every rank's (failed requests, failed block ids) of a step as one pair: what each
    rank's save must drop under tensor parallelism (kvtier.integrations.vllm gathers them)."""
    reqs: set[str] = set()
    blocks: set[int] = set()
    for r, b in per_rank:
        reqs |= r
        blocks |= b
    return reqs, blocks


class BackgroundLoads:
    """Loads the engine does not wait for, one batch at a time on a daemon thread, through
    ``mover`` (on a connection of its own: a Client is not thread-safe). ``take`` hands back,
    once each, the requests whose batch is done and the block ids of theirs that failed: the
    engine learns both in the same step (vLLM: get_finished, get_block_ids_with_load_errors)."""

    def __init__(self, mover: Mover) -> None:
        self.mover = mover
        self._jobs: queue.SimpleQueue[list[LoadSpec] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._done_reqs: set[str] = set()
        self._failed: set[int] = set()
        self._pending = 0                     # batches submitted and not done
        self._ready = threading.Event()       # set when a batch is done
        self._thread: threading.Thread | None = None

    def submit(self, loads: list[LoadSpec]) -> None:
        if not loads:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"kvtier-loads-{self.mover.link.part}")
            self._thread.start()
        with self._lock:
            self._pending += 1
        self._jobs.put(loads)

    def wait(self, timeout: float) -> None:
        """Block up to timeout seconds until a batch is done; at once when one is done
        already or none is pending. For an engine step with nothing else to do (otherwise
        the engine polls take() in a busy loop, and on a small machine takes the CPU from the
        service that is reading the blocks)."""
        with self._lock:
            if self._done_reqs or not self._pending:
                return
            self._ready.clear()
        self._ready.wait(timeout)

    def take(self) -> tuple[set[str], set[int]]:
        with self._lock:
            done, failed = self._done_reqs, self._failed
            self._done_reqs, self._failed = set(), set()
        return done, failed

    def _run(self) -> None:
        while (loads := self._jobs.get()) is not None:
            try:
                failed = self.mover.load(loads)
            except Exception:
                # Not a kvtier failure (Link.call turns those into load errors) but a bug:
                # the requests must still be reported done, or they would wait forever; all
                # their blocks are load errors, so the engine recomputes them.
                log.exception("kvtier: a background load failed; its blocks are recomputed")
                failed = {b for spec in loads for b in spec.block_ids}
            with self._lock:
                self._done_reqs.update(spec.req_id for spec in loads)
                self._failed |= failed
                self._pending -= 1
                self._ready.set()

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=self.mover.link.settings.timeout_s + 1)
