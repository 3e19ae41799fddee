"""Pairs of trees on a GPU get's service side (issue 16's small-page onboards; lease13):
bench/get_control.py --serve (a real `kvtier serve`, chunked and sorted gets alternated) or
bench/get_steps.py (--steps: the same requests through Server._dispatch in process) run
against each tree in turn, the trees' order alternated by round (AB BA ...), so that a shared
machine's load falls on both alike.

    python bench/get_pairs.py --variant base=/work/main --variant head=. [--rounds 4]
        [--gets 40] [--steps | --sim h100-s36|h100-s37] [--out FILE.jsonl]

Each run is one line of --out (the bench's JSON with the variant, round and load). The summary
at the end gives per variant, block and kind of get the median over rounds (and the rounds'
range) of the get's total and each request's figures: --serve the total's 10th percentile over
the gets too (the gets the machine's other load left alone), the replies' arrival in the
client, each frame's arrival and each request's dispatch in the service; --steps each
request's dispatch.
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


def one(tree: str, args: argparse.Namespace, block: int) -> dict:
    """One run of the bench against tree; its JSON."""
    if args.steps:
        cmd = [sys.executable, os.path.join(ROOT, "bench", "get_steps.py"), "--tree", tree,
               "--json", "--gets", str(args.gets), "--block", str(block)]
    else:
        cmd = [sys.executable, os.path.join(ROOT, "bench", "get_control.py"), "--serve",
               "--tree", tree, "--json", "--gets", str(args.gets), "--blocks", str(block),
               "--gap-ms", str(args.gap_ms)] + (["--sim", args.sim] if args.sim else [])
    return run_tree_json(cmd, tree)


def figures(r: dict, steps: bool) -> dict:
    """(kind of get -> {figure: value}) of one run."""
    out = {}
    for how in ("chunked", "sorted"):
        if steps:
            out[how] = {"total_ms": r[f"{how}_total_ms"], "dispatch_us": r[f"{how}_us"]}
            continue
        for key, row in r.items():
            if key.startswith(how + "_") and isinstance(row, dict):
                # p10: the gets the shared machine's other load left alone, or nearly.
                out[how] = {"total_ms": row["total_ms"], "total_p10_ms": row["total_ms_p10_p90"][0],
                            "reply_at_ms": row["reply_at_ms"],
                            "arrived_at_ms": row.get("serve_arrived_at_ms"),
                            "dispatch_ms": row.get("serve_dispatch_ms")}
    return out


def summary(runs: list[dict], steps: bool) -> dict:
    """Per variant, block and kind: medians over rounds, with the rounds' range; and per
    variant and block the sorted get less the chunked get of the same run (the two are
    alternated get by get, so a shared machine's load falls on both alike)."""
    acc: dict = {}
    for r in runs:
        figs = figures(r, steps)
        for how, f in figs.items():
            d = acc.setdefault(f"{r['variant']} {r['block'] // 1024}k {how}", {})
            for k, v in f.items():
                d.setdefault(k, []).append(v)
        c, s = figs["chunked"], figs["sorted"]
        d = acc.setdefault(f"{r['variant']} {r['block'] // 1024}k sorted-chunked", {})
        d.setdefault("total_ms", []).append(s["total_ms"] - c["total_ms"])
        if not steps:
            d.setdefault("total_p10_ms", []).append(s["total_p10_ms"] - c["total_p10_ms"])
            d.setdefault("first_reply_ms", []).append(s["reply_at_ms"][0]
                                                      - c["reply_at_ms"][0])
    out: dict = {}
    for name, d in acc.items():
        out[name] = {}
        for k, v in d.items():
            a = np.array(v, dtype=float)
            out[name][k] = {"median": np.round(np.median(a, 0), 4).tolist(),
                            "min": np.round(a.min(0), 4).tolist(),
                            "max": np.round(a.max(0), 4).tolist()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True, help="NAME=TREE")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--gets", type=int, default=40)
    ap.add_argument("--gap-ms", type=float, default=1.5)
    ap.add_argument("--blocks", default="16384,65536")
    ap.add_argument("--steps", action="store_true", help="bench/get_steps.py (in process)")
    ap.add_argument("--sim", default="", help="get_control.py's simulated GPU (its SIMS)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    variants = [(v.partition("=")[0], os.path.abspath(v.partition("=")[2]))
                for v in args.variant]
    runs: list[dict] = []
    sink = open(args.out, "a") if args.out else None
    try:
        for rnd in range(args.rounds):
            order = variants if rnd % 2 == 0 else variants[::-1]
            for block in (int(b) for b in args.blocks.split(",")):
                for name, tree in order:
                    r = one(tree, args, block)
                    r.update(variant=name, round=rnd, block=block, steps=args.steps)
                    runs.append(r)
                    if sink:
                        sink.write(json.dumps(r) + "\n")
                        sink.flush()
                    figs = figures(r, args.steps)
                    print(f"round {rnd} {block // 1024}k {name}: chunked "
                          f"{figs['chunked']['total_ms']} ms, sorted "
                          f"{figs['sorted']['total_ms']} ms, load {r['loadavg']:.2f}",
                          file=sys.stderr)
    finally:
        if sink:
            sink.close()
    print(json.dumps(summary(runs, args.steps), indent=1))


if __name__ == "__main__":
    main()
