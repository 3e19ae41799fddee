"""The summary lines of a device call's stall runs (bench/results/s37-stall12-run.sh): one
bench run's JSON (its output, whatever precedes the JSON skipped) appended as a line of
OUT_JSONL with its run name, and its figures printed on one line (stall) or three (trace).

    python bench/stall_device.py stall RUN_OUTPUT NAME OUT_JSONL
    python bench/stall_device.py trace RUN_OUTPUT NAME OUT_JSONL READERS
"""

from __future__ import annotations

import json
import sys


def _load(path: str, name: str, out: str) -> dict:
    text = open(path).read()
    d = json.loads(text[text.find("{"):])
    d["run"] = name
    with open(out, "a") as fh:
        fh.write(json.dumps(d) + "\n")
    return d


def stall(path: str, name: str, out: str) -> None:
    """bench/stall.py's run: worst ratio, load, per readers alone p99, beside p50 and p99,
    ratio."""
    d = _load(path, name, out)
    print(name, d["worst_p99_ratio"], d["loadavg_start"], d["loadavg_end"],
          [(r, c["alone_p99_us"], c["beside_p50_us"], c["beside_p99_us"], c["p99_ratio"])
           for r, c in d["conditions"].items()])


def trace(path: str, name: str, out: str, readers: str) -> None:
    """bench/stall_trace.py's run: the probe's figures, the tail's wait by kind, and each
    kind of loop work (n, CPU p50, wall p50, wall p90, share of the phase)."""
    c = _load(path, name, out)["conditions"][readers]
    print(name, {k: c[k] for k in ("alone_p99_us", "beside_p50_us", "beside_p99_us",
                                   "tail_wait_to_data_received_us", "reader_gets")})
    print("  tail", {k: v["us"] for k, v in c["tail_wait_by_kind_us"].items()})
    print("  work", {k: (v["n"], v.get("cpu_p50"), v["p50"], v["p90"], v["share_of_phase"])
                     for k, v in c["loop_work_us"].items()})


if __name__ == "__main__":
    {"stall": stall, "trace": trace}[sys.argv[1]](*sys.argv[2:])
