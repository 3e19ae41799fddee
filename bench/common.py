"""Helpers shared by the benchmarks: the system header, percentiles, RSS, and output.

Every benchmark prints a header first (machine, CPU, Python, numpy, kernel) and, with --json,
one JSON object on stdout whose ``machine`` field carries the same header. Medians and
percentiles, not means: a shared machine's outliers are real but say little about the code.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from typing import Any, Callable

import numpy as np


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as fh:
            mem = int(fh.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    info = {"host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(),
            "mem_gib": round(mem / 2**30, 1), "python": platform.python_version(),
            "numpy": np.__version__, "kernel": platform.release()}
    try:
        import torch  # noqa: F401
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def header(name: str, stream: Any = sys.stderr) -> dict[str, Any]:
    m = machine()
    print(f"# {name} on {m['host']}: {m['cpu']} x{m['cores']}, {m['mem_gib']} GiB, "
          f"Python {m['python']}, numpy {m['numpy']}, Linux {m['kernel']}"
          + (f", {m['gpu']}" if "gpu" in m else ""), file=stream)
    return m


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def percentiles(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples, dtype=np.float64)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max()), "n": int(a.size)}


def timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    """Seconds per call, one sample per call."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=None, sort_keys=True))
    else:
        for k, v in result.items():
            if k != "machine":
                print(f"{k:>28}: {v}")


def wrap_thread_cpu(owner: Any, name: str, label: str, spent: dict[str, float],
                    calls: dict[str, int] | None = None) -> None:
    """Wrap owner.name so that its thread CPU time adds to spent[label] (and each call to
    calls[label]): a step's CPU in process, less exposed than wall time to a shared machine."""
    real = getattr(owner, name)

    def call(*args: Any, **kw: Any) -> Any:
        t = time.thread_time()
        try:
            return real(*args, **kw)
        finally:
            spent[label] += time.thread_time() - t
            if calls is not None:
                calls[label] += 1
    setattr(owner, name, call)


def run_tree_json(cmd: list[str], tree: str) -> dict[str, Any]:
    """Run a bench command with tree's kvtier first on the path; its last JSON line."""
    import subprocess
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [tree] + [p for p in [os.environ.get("PYTHONPATH")] if p])}   # the tree first
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{cmd} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])
