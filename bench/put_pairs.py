"""Pairs of trees on a GPU put's service chain (issue 16's offload rows; svc12): bench/put_control.py
--serve run against each tree's `kvtier serve` and client in turn, variants alternated within
each round, so that a shared machine's load falls on all of them alike.

    python bench/put_pairs.py --variant base=/work/main --variant head=. \\
        [--variant head+pack=.:65536] [--rounds 4] [--puts 30] [--blocks 16384,65536]
        [--copy-gbps 0] [--launch-us 0] [--out FILE.jsonl]

A variant is NAME=TREE[:PACK_BUF] (PACK_BUF: put_control's --pack-buf, measurement only). Each
run is one line of --out (put_control's JSON with the variant, round and load); the summary
printed at the end gives, per block size and variant, the median over rounds (and the rounds'
range) of: the put's total, the service's busy time (its dispatches, and its reply writes),
the last commit's reply from the put's entry, and each request's time in the service.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import run_tree_json  # noqa: E402
CONTROL = os.path.join(ROOT, "bench", "put_control.py")


def one(tree: str, pack_buf: int, block: int, args: argparse.Namespace) -> dict:
    """One put_control.py --serve run of tree; its JSON."""
    cmd = [sys.executable, CONTROL, "--tree", tree, "--serve", "--json", "--block", str(block),
           "--puts", str(args.puts), "--copy-gbps", str(args.copy_gbps),
           "--launch-us", str(args.launch_us), "--host-capacity", args.host_capacity]
    if pack_buf:
        cmd += ["--pack-buf", str(pack_buf)]
    return run_tree_json(cmd, tree)


def summary(runs: list[dict]) -> dict:
    """Per block and variant: medians over rounds (with min and max) of the figures."""
    out: dict = {}
    for r in runs:
        key = f"{r['block'] // 1024}k {r['variant']}"
        d = out.setdefault(key, {"total_ms": [], "serve_busy_ms": [], "serve_write_sum_ms": [],
                                 "last_commit_reply_ms": [], "serve_ms": []})
        d["total_ms"].append(r["total_ms"])
        d["serve_busy_ms"].append(r["serve_busy_ms"])
        d["serve_write_sum_ms"].append(round(sum(r["serve_write_ms"]), 4))
        d["last_commit_reply_ms"].append(r["commit_reply_at_ms"][-1])
        d["serve_ms"].append(r["serve_serve_ms"])
    for d in out.values():
        for k in ("total_ms", "serve_busy_ms", "serve_write_sum_ms", "last_commit_reply_ms"):
            v = d[k]
            d[k] = {"median": round(float(np.median(v)), 4), "min": min(v), "max": max(v)}
        d["serve_ms"] = np.round(np.median(np.array(d["serve_ms"]), 0), 4).tolist()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True,
                    help="NAME=TREE[:PACK_BUF]")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--puts", type=int, default=30)
    ap.add_argument("--blocks", default="16384,65536")
    ap.add_argument("--copy-gbps", type=float, default=0.0)
    ap.add_argument("--launch-us", type=float, default=0.0)
    ap.add_argument("--host-capacity", default="6GiB", help="bench/gpu.py's service's")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    variants = []
    for v in args.variant:
        name, _, rest = v.partition("=")
        tree, _, buf = rest.partition(":")
        variants.append((name, os.path.abspath(tree), int(buf or 0)))
    runs: list[dict] = []
    sink = open(args.out, "a") if args.out else None
    try:
        for rnd in range(args.rounds):
            order = variants if rnd % 2 == 0 else variants[::-1]     # ABC CBA ...
            for block in (int(b) for b in args.blocks.split(",")):
                for name, tree, buf in order:
                    r = one(tree, buf, block, args)
                    r.update(variant=name, round=rnd)
                    runs.append(r)
                    if sink:
                        sink.write(json.dumps(r) + "\n")
                        sink.flush()
                    print(f"round {rnd} {block // 1024}k {name}: total {r['total_ms']} ms, "
                          f"service busy {r['serve_busy_ms']} ms, load {r['loadavg']:.2f}",
                          file=sys.stderr)
    finally:
        if sink:
            sink.close()
    print(json.dumps(summary(runs), indent=1))


if __name__ == "__main__":
    main()
