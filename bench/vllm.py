"""vLLM with and without kvtier: time to first token on prompts that share all but their last
512 tokens with an earlier one, and the prefix-hit tokens of a replayed multi-turn workload.

    python bench/vllm.py --json                      # 1k, 4k and 16k tokens; the committed run
    python bench/vllm.py --lengths 1024 --reps 1 --turns 10 --json      # the smoke run

Both engines run in this process on the same tiny seeded model (tests.vllm_engines; vLLM's CPU
backend, float32, VLLM_ENABLE_V1_MULTIPROCESSING=0), with vLLM's own prefix cache off, so the
"without" engine recomputes every prompt and the "with" engine loads what kvtier holds. For each
length L: a base prompt of L tokens runs once on each engine (the "with" engine stores it), then
`reps` prompts made of the base's first L - 512 tokens and 512 new ones are timed on both,
alternating, each a request of one output token (its latency is the time to first token).
The sampled tokens and logprobs of every timed prompt are compared between the engines.

Replay: the first `turns` requests of Mooncake's conversation trace (/work/shared/traces), each
trace block (512 tokens there) scaled to one 32-token vLLM block of token ids derived from its
id, plus a short unique tail; the "with" engine runs them in order, and the prompt tokens it
was served from kvtier are counted against the leading-run hits of an infinite cache.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TRACE = Path("/work/shared/traces/mooncake_conversation_first_half.jsonl")
SUFFIX = 512


def _ttft(llm: Any, prompt: list[int]) -> tuple[float, dict[str, Any]]:
    from tests.vllm_engines import generate
    t0 = time.perf_counter()
    (out,) = generate(llm, [prompt], max_tokens=1)
    return (time.perf_counter() - t0) * 1000, out


def _diff(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, float]:
    return a["tokens"] == b["tokens"], max(abs(x - y) for x, y in zip(a["logprobs"],
                                                                     b["logprobs"]))


def _trace_prompts(turns: int, block: int) -> tuple[list[list[int]], int]:
    """Prompts of the first turns requests, and the hit tokens of an infinite cache."""
    seen: set[int] = set()
    prompts, ideal = [], 0
    with TRACE.open() as fh:
        for i, line in enumerate(fh):
            if i >= turns:
                break
            ids = json.loads(line)["hash_ids"]
            lead = 0
            while lead < len(ids) and ids[lead] in seen:
                lead += 1
            ideal += lead * block
            seen.update(ids)
            toks = [t for h in ids for t in random.Random(h).choices(range(3, 500), k=block)]
            prompts.append(toks + random.Random(-1 - i).choices(range(3, 500), k=5))
    return prompts, ideal


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from tests.service import Service
    from tests.vllm_engines import BLOCK, build_model, generate, kv_config, make_llm
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))
    max_len = max(args.lengths) + 64
    model = build_model(tmp / "model", seed=0, max_len=max_len)
    svc = Service(tmp / "data", host_capacity="1GiB", nvme_capacity="2GiB").start()
    kv_bytes = 4 * max_len * 1024            # 32 KiB per 32 tokens: four such prompts at once
    try:
        without = make_llm(model, None, max_len=max_len, kv_bytes=kv_bytes)
        with_kv = make_llm(model, kv_config(svc.socket, engine_id="bench", report_s=0.1),
                           max_len=max_len, kv_bytes=kv_bytes)
        rng = random.Random(0)
        ttft_without: dict[str, float] = {}
        ttft_with: dict[str, float] = {}
        equal, worst = True, 0.0
        rounds: dict[str, dict[str, list[float]]] = {}
        for n in args.lengths:
            base = [rng.randrange(3, 500) for _ in range(n)]
            generate(without, [base], max_tokens=1)
            generate(with_kv, [base], max_tokens=1)
            a_ms, b_ms = [], []
            for _ in range(args.reps):
                prompt = base[:n - SUFFIX] + [rng.randrange(3, 500) for _ in range(SUFFIX)]
                ta, oa = _ttft(without, prompt)
                tb, ob = _ttft(with_kv, prompt)
                same, delta = _diff(oa, ob)
                equal &= same and ob["cached"] == (n - SUFFIX) // BLOCK * BLOCK
                worst = max(worst, delta)
                a_ms.append(ta)
                b_ms.append(tb)
            ttft_without[str(n)] = round(statistics.median(a_ms), 2)
            ttft_with[str(n)] = round(statistics.median(b_ms), 2)
            rounds[str(n)] = {"without": [round(x, 2) for x in a_ms],
                              "with": [round(x, 2) for x in b_ms]}
            print(f"# {n} tokens: TTFT {ttft_without[str(n)]} ms without kvtier, "
                  f"{ttft_with[str(n)]} ms with", file=sys.stderr)
        prompts, ideal = _trace_prompts(args.turns, BLOCK)
        replay = generate(with_kv, prompts, max_tokens=1)
        hit = sum(o["cached"] for o in replay)
        check = generate(without, prompts[-3:], max_tokens=1)
        for a, b in zip(check, replay[-3:]):
            same, delta = _diff(a, b)
            equal &= same
            worst = max(worst, delta)
        return {
            "ttft_ms_without": ttft_without, "ttft_ms_with": ttft_with,
            "ttft_ratio": {k: round(ttft_without[k] / ttft_with[k], 2) for k in ttft_with},
            "ttft_rounds_ms": rounds, "suffix_tokens": SUFFIX, "reps": args.reps,
            "outputs_equal": bool(equal), "max_abs_logprob_diff": worst,
            "hit_tokens": hit, "prompt_tokens": sum(len(p) for p in prompts),
            "ideal_hit_tokens": ideal, "replay_requests": len(prompts),
            "model": "Llama 2 layers, hidden 128, 4 heads / 2 KV heads of 32, float32",
            "block_size": BLOCK,
        }
    finally:
        svc.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--turns", type=int, default=60)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if min(args.lengths) <= SUFFIX:
        ap.error(f"every length must exceed the {SUFFIX}-token new suffix")
    from bench.common import emit, header
    m = header("bench/vllm.py")
    with contextlib.redirect_stdout(sys.stderr):         # vLLM logs to stdout; the JSON only
        result = run(args)
    result["machine"] = m
    emit(result, args.json)


if __name__ == "__main__":
    main()
