"""`kvtier bench JOBFILE --compare` for two trees, alternated, each run with its own fio runs
(issue 17): the ratio of each tree to the fio run paired with it, and the trees' MiB/s side by
side. Rounds alternate the order (A B, then B A, ...), so that neither tree always runs first.

    PYTHONPATH=. python bench/fio_ab.py BASE_TREE BRANCH_TREE [ROUNDS] [JOBFILE] [DIR]
    COMPARE=0 ...   (no fio runs: the trees alone, alternated; ratios are then None)
    VARIANTS="main=TREE,k1=TREE@1,k2=TREE@2" ...   (more than two; TREE@N adds --calls N;
                    each round runs them in order, reversed every other round)
    FIO_AB_SITE=/tmp/site ...   (packages installed apart, put on PYTHONPATH after the tree)

Each tree must have its C extensions built (setup.py build_ext --inplace). Prints a table and
writes one JSON line: per round and tree, every job's kvtier and fio MiB/s and the ratios.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import header  # noqa: E402


def run(tree: str, jobfile: str, directory: str, calls: str = "") -> tuple[dict, float]:
    """One `kvtier bench` of tree; returns its JSON and the CPU seconds it used (user +
    system, fio's runs included when compared)."""
    # FIO_AB_SITE: packages installed apart (a device's /tmp/site), after the tree.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (tree, os.environ.get("FIO_AB_SITE", "")) if p))
    compare = ["--compare"] if os.environ.get("COMPARE", "1") != "0" else []
    if calls:
        compare += ["--calls", calls]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-m", "kvtier.fio", jobfile, *compare,
                          "--directory", directory, "--output-format", "json"],
                         cwd=tree, env=env, capture_output=True, text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(out.stdout[out.stdout.index("{"):]), cpu


def summary(res: dict) -> list[dict]:
    rows = []
    for j in res["jobs"]:
        base = (j["kvtier"].get("baseline") or {}).get("result") or {}
        rows.append({"job": j["jobname"],
                     "kvtier_mib": [round(j[d]["bw_bytes"] / 2**20, 1) for d in ("read", "write")],
                     "fio_mib": [round((base.get(d) or {}).get("bw_bytes", 0) / 2**20, 1)
                                 for d in ("read", "write")],
                     "ratio": [j["kvtier"].get("ratio_read"), j["kvtier"].get("ratio_write")],
                     "clat_ms": [round(j[d]["clat_ns"]["mean"] / 1e6, 2) for d in ("read", "write")],
                     "calls": j["kvtier"].get("calls_in_flight"),
                     # blocks got from host memory, not the disk (fio's direct reads never are)
                     "host_hits": (j["kvtier"].get("tiers", {}).get("host") or {}).get("hits"),
                     "blocks_read": j["read"]["total_ios"],
                     "cpu_s": j["kvtier"].get("cpu_s")})
    return rows


def main() -> int:
    base, branch = sys.argv[1], sys.argv[2]     # ignored where VARIANTS is given
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    jobfile = os.path.abspath(sys.argv[4] if len(sys.argv) > 4
                              else os.path.join(ROOT, "bench/jobs/randrw.fio"))
    directory = sys.argv[5] if len(sys.argv) > 5 else "/tmp"
    m = header("fio_ab")
    out = {"machine": m, "command": " ".join(sys.argv), "rounds": []}
    for r in range(rounds):
        order = [("main", base), ("branch", branch)]
        if os.environ.get("VARIANTS"):
            order = [tuple(v.split("=", 1)) for v in os.environ["VARIANTS"].split(",")]
        if r % 2:
            order.reverse()
        for name, spec in order:
            tree, _, calls = spec.partition("@")
            t0 = time.time()
            load = os.getloadavg()[0]
            res, cpu = run(tree, jobfile, directory, calls)
            rows = summary(res)
            out["rounds"].append({"round": r + 1, "tree": name, "start": t0, "load": load,
                                  "cpu_s": round(cpu, 2), "jobs": rows})
            for row in rows:
                print(f"r{r + 1} {name:6} {row['job']:13} kvtier {row['kvtier_mib'][0]:6.1f} / "
                      f"{row['kvtier_mib'][1]:6.1f}  fio {row['fio_mib'][0]:6.1f} / "
                      f"{row['fio_mib'][1]:6.1f}  ratio {row['ratio'][0]} / {row['ratio'][1]}"
                      f"  load {load:.1f} cpu {cpu:.1f} s lanes {row['cpu_s']}"
                      f"  host hits {row['host_hits']} of {row['blocks_read']}",
                      file=sys.stderr, flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
