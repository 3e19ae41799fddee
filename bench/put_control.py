"""A GPU put's control path against a real `kvtier serve`, with the GPU left out (issue 16's
offload rows; off7). The client does what kvtier.gpu.transfer.put_async does for bench/gpu.py's
rows: 4,096 rewrites of existing keys in a random key order, reserved in
pipeline.cuda_put_chunks, every reserve sent at once; as each reply is read, that chunk's
"copies" are started on a simulated GPU (one stream: a chunk's copies end --copy-gbps after the
later of its launch and the previous chunk's end); the commits of the leading chunks that have
ended are sent after each launch (early commits) and the rest as they end; then every commit
reply is read. Commits carry checksums (trusted), as a GPU put's do.

    python bench/put_control.py [--block 16384] [--n 4096] [--puts 40] [--copy-gbps 44]
                                [--gap-ms 1.5] [--trace | --later --serve] [--pack-buf B]
                                [--host-capacity 6GiB] [--json]

--copy-gbps 0: no copies (the service's chain alone). --trace: the service runs with
bench/get_control_hooks as its sitecustomize (every dispatch, pack and write timed); --later:
with bench/put_control_hooks (which of the put's requests the service ran a poll later, as a
Later of its step queue, and how long those waited: stall6's short-requests-first). Medians
over the puts of: the whole put, each reserve and commit reply's arrival from the put's entry,
the service's dispatches (traced). --serve (bench/put_control_hooks, PUT_CONTROL_SERVE): each
request's time in the service from its frame's arrival to its reply written, the wait before
its dispatch and the dispatch, and when its reply was written from the put's entry. A gap is spun between puts (bench/gpu.py's GPU wait; the
service's loop may sleep meanwhile).
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header  # noqa: E402


def spin(until: float) -> None:
    while time.perf_counter() < until:
        pass


def one_put(c, ns, kb: bytes, n: int, sums: np.ndarray, chunks: list, per_key_s: float,
            launch_s: float) -> dict:
    """One put as put_async + wait does it; returns its event times (s, from its entry)."""
    pc = time.perf_counter
    w = ns.key_width
    t0 = pc()
    ids = [c._send("reserve", {"ns": ns.name, "keys": kb[lo * w:hi * w], "tier": "host"},
                   piggyback=i == len(chunks) - 1) for i, (lo, hi) in enumerate(chunks)]
    ends: list[float] = []          # each chunk's simulated end of copies
    rids: list[int] = []
    commits: list[int] = []
    ev = {"reserve_reply": [], "commit_sent": [], "commit_reply": [], "ids": ids,
          "t0": t0}
    gpu_free = t0

    def commit_ready(now: float) -> None:
        while len(commits) < len(ends) and ends[len(commits)] <= now:
            k = len(commits)
            lo, hi = chunks[k]
            commits.append(c._send("commit", {"rid": rids[k], "trusted": True,
                                              "checksums": sums[lo:hi].tobytes()}))
            ev["commit_sent"].append(pc() - t0)
    for (lo, hi), rid in zip(chunks, ids):
        r = c._reply(rid)
        ev["reserve_reply"].append(pc() - t0)
        np.frombuffer(r["slots"], "<i4")
        rids.append(int(r["rid"]))
        spin(pc() + launch_s)               # the chunk's launch on the host
        start = max(pc(), gpu_free)
        gpu_free = start + (hi - lo) * per_key_s
        ends.append(gpu_free)
        commit_ready(pc())
    while len(commits) < len(chunks):       # wait(): each chunk's event in turn
        spin(ends[len(commits)])
        commit_ready(pc())
    for cid in commits:
        c._reply(cid)
        ev["commit_reply"].append(pc() - t0)
    ev["total"] = pc() - t0
    ev["ids"] = ids + commits
    return ev


def run(block: int, n: int, puts: int, trace: bool, copy_gbps: float, launch_us: float,
        gap_ms: float, later: bool = False, serve: bool = False, pack_buf: int = 0,
        host_capacity: str = "", tree: str = ROOT, sizes: str = "") -> dict:
    from kvtier import Client
    from kvtier.api import pipeline
    from tests.service import Service
    work = tempfile.mkdtemp(prefix="kvtier-putctl-")
    tpath = os.path.join(work, "serve.trace")
    lpath = os.path.join(work, "serve.later")
    spath = os.path.join(work, "serve.times")
    env_saved = dict(os.environ)
    hooks = ("get_control_hooks" if trace else "put_control_hooks" if later or serve or pack_buf
             else None)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        ([os.path.join(ROOT, "bench", hooks)] if hooks else []) + [tree]
        + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if trace:
        os.environ["GET_CONTROL_TRACE"] = tpath
    if later:
        os.environ["PUT_CONTROL_LATER"] = lpath
    if serve:
        os.environ["PUT_CONTROL_SERVE"] = spath
    if pack_buf:
        os.environ["PUT_CONTROL_PACK_BUF"] = str(pack_buf)
    cwd = os.getcwd()
    os.chdir(tree)            # `python -m kvtier.cli` puts its cwd first on sys.path
    try:      # as bench/gpu.py's service: no NVMe, room for a put beside the blocks it rewrites
        svc = Service(Path(work) / "d", admin=False,
                      host_capacity=host_capacity or str(max(64 << 20, 4 * n * block)),
                      nvme_capacity="0").start()
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env_saved)
    chunks = pipeline.cuda_put_chunks(n, block)
    if sizes:                 # another cut, for the GPU path to try (its sizes, in order)
        ends = np.cumsum([int(k) for k in sizes.split(",")])
        if ends[-1] != n:
            raise SystemExit(f"--chunks {sizes} add up to {ends[-1]}, not --n {n}")
        chunks = list(zip([0] + ends[:-1].tolist(), ends.tolist()))
    per_key_s = block / (copy_gbps * 1e9) if copy_gbps else 0.0
    evs = []
    t_first = time.perf_counter()
    try:
        c = Client(svc.socket)
        ns = c.namespace("rows", block_bytes=block)
        keys = np.arange(1, n + 1, dtype=">u8")
        karr = np.zeros((n, 16), np.uint8)
        karr[:, 8:] = keys.view(np.uint8).reshape(n, 8)
        ns.put(karr.tobytes(), np.random.default_rng(0).integers(0, 255, (n, block), np.uint8))
        rng = np.random.default_rng(block)
        sums = rng.integers(1, 2 ** 63, n, dtype=np.uint64)
        t_first = time.perf_counter()
        for _ in range(puts + 5):
            kb = karr[rng.permutation(n)].tobytes()
            evs.append((time.perf_counter(), one_put(c, ns, kb, n, sums, chunks, per_key_s,
                                                     launch_us * 1e-6)))
            spin(time.perf_counter() + gap_ms * 1e-3)
        c.close()
    finally:
        svc.stop()
    evs = evs[5:]
    out: dict = {"puts": len(evs), "chunks": [hi - lo for lo, hi in chunks],
                 "block": block, "copy_gbps": copy_gbps, "launch_us": launch_us,
                 "gap_ms": gap_ms, "pack_buf": pack_buf, "host_capacity": host_capacity,
                 "tree": tree}
    med = lambda xs: round(float(np.median(xs)) * 1e3, 4)     # noqa: E731
    out["total_ms"] = med([e["total"] for _t, e in evs])
    for kind in ("reserve_reply", "commit_sent", "commit_reply"):
        out[f"{kind}_at_ms"] = [med([e[kind][i] for _t, e in evs]) for i in range(len(chunks))]
    if trace:
        with open(tpath, "rb") as f:
            sev = pickle.load(f)
        out.update(service_split(sev, evs, len(chunks), t_first))
    if later:
        out.update(later_split(lpath, len(evs), 2 * len(chunks)))
    if serve:
        out.update(serve_split(spath, evs))
    return out


def serve_split(path: str, evs: list) -> dict:
    """Each of a put's requests (the reserves, then the commits) in the service, medians over
    the puts, ms: from its frame's arrival to its reply written (the service's time from
    request to reply), of it the wait before its dispatch, the dispatch itself and the reply's
    write (Connection._write: its pack and send); and when
    the reply was written, from the put's entry (the client's first send)."""
    import json
    with open(path) as f:
        dump = json.load(f)
    rows = {r["id"]: r for r in dump["rows"] if r.get("id") is not None}
    keys = ("serve_ms", "wait_ms", "dispatch_ms", "write_ms", "written_at_ms", "arrived_at_ms")
    per: dict = {k: [] for k in keys}
    later = 0
    for _t, e in evs:
        got = [rows.get(i) for i in e["ids"]]
        if any(r is None or r.get("written") is None or r.get("arrived") is None
               for r in got):
            continue
        later += sum(1 for r in got if r.get("later"))
        per["serve_ms"].append([r["written"] - r["arrived"] for r in got])
        per["wait_ms"].append([r["start"] - r["arrived"] for r in got])
        per["dispatch_ms"].append([r["end"] - r["start"] for r in got])
        per["write_ms"].append([r["written"] - r["write_start"] for r in got])
        per["written_at_ms"].append([r["written"] - e["t0"] for r in got])
        per["arrived_at_ms"].append([r["arrived"] - e["t0"] for r in got])
    if not per["serve_ms"]:
        return {"serve_puts": 0}
    out: dict = {"serve_puts": len(per["serve_ms"]), "serve_later_requests": later,
                 "serve_kvtier": dump["kvtier"]}
    for k, v in per.items():
        out[f"serve_{k}"] = np.round(np.median(np.array(v) * 1e3, 0), 4).tolist()
    out["serve_busy_ms"] = round(float(np.median(
        np.sum(np.array(per["dispatch_ms"]), 1) * 1e3)), 4)
    return out


def later_split(path: str, puts: int, per_put: int) -> dict:
    """Of the last puts' requests (per_put each, in the service's order: the reserves, then
    the commits), how many puts had each one run as a Later, and the Laters' wait."""
    import json
    with open(path) as f:
        d = json.load(f)
    kinds = d["kinds"][-puts * per_put:]
    waits = np.array(d["later_waits_s"]) * 1e3
    return {"later_by_request": [sum(1 for i in range(k, len(kinds), per_put)
                                     if kinds[i] == "Later") for k in range(per_put)],
            "later_count": int(sum(1 for k in d["kinds"] if k == "Later")),
            "dispatches": len(d["kinds"]),
            "later_wait_ms_p50_p90": [round(float(np.percentile(waits, q)), 4)
                                      for q in (50, 90)] if waits.size else None}


def service_split(sev: list, evs: list, parts: int, t_first: float) -> dict:
    """The service's dispatches in each put's window, in order (the reserves, then the
    commits), start and duration, medians; and its packs and writes summed."""
    sev = sorted((e for e in sev if e[1] >= t_first), key=lambda e: e[1])
    starts = np.array([e[1] for e in sev])
    per: dict = {"dispatch_at_ms": [], "dispatch_ms": [], "write_sum_ms": [], "dr_count": []}
    for (t_in, e) in evs:
        lo, hi = np.searchsorted(starts, [t_in, t_in + e["total"]])
        win = sev[lo:hi]
        d = [x for x in win if x[0] == "dispatch"]
        if len(d) < 2 * parts:
            continue
        per["dispatch_at_ms"].append([(x[1] - t_in) * 1e3 for x in d[:2 * parts]])
        per["dispatch_ms"].append([(x[2] - x[1]) * 1e3 for x in d[:2 * parts]])
        per["write_sum_ms"].append(sum((x[2] - x[1]) * 1e3 for x in win if x[0] == "write"))
        per["dr_count"].append(sum(1 for x in win if x[0] == "dr"))
    if not per["dispatch_ms"]:
        return {"service_windows": 0}
    return {"service_windows": len(per["dispatch_ms"]),
            "serve_dispatch_at_ms": np.round(np.median(per["dispatch_at_ms"], 0), 4).tolist(),
            "serve_dispatch_ms": np.round(np.median(per["dispatch_ms"], 0), 4).tolist(),
            "serve_dispatch_sum_ms": round(float(np.median(np.sum(per["dispatch_ms"], 1))), 4),
            "serve_write_sum_ms": round(float(np.median(per["write_sum_ms"])), 4),
            "serve_dr_count": float(np.median(per["dr_count"]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block", type=int, default=16384)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--puts", type=int, default=40)
    ap.add_argument("--copy-gbps", type=float, default=44.0,
                    help="the simulated copies' rate (H200: the offload kernel ~0.8 of 54.6)")
    ap.add_argument("--launch-us", type=float, default=100.0,
                    help="host time a chunk's launch takes (H200, gpu5: 0.10-0.16 ms)")
    ap.add_argument("--gap-ms", type=float, default=1.5)
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--later", action="store_true")
    ap.add_argument("--serve", action="store_true",
                    help="each request's time in the service, arrival to reply written")
    ap.add_argument("--pack-buf", type=int, default=0,
                    help="measurement only: the service's protocol.pack with msgpack's Packer "
                    "buffer of this many bytes (bench/put_control_hooks)")
    ap.add_argument("--host-capacity", default="",
                    help="the service's host tier (bench/gpu.py's: 6GiB; default 4 puts' bytes)")
    ap.add_argument("--chunks", default="",
                    help="the put's chunk sizes, comma-separated (default: cuda_put_chunks')")
    ap.add_argument("--tree", default=ROOT,
                    help="the kvtier tree the client and the service run (pairs: main's)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.tree))   # kvtier from there, the harness from here
    if args.trace and (args.later or args.serve):
        raise SystemExit("--trace or --later/--serve, not both (one sitecustomize)")
    m = header("bench/put_control.py")
    res = run(args.block, args.n, args.puts, args.trace, args.copy_gbps, args.launch_us,
              args.gap_ms, args.later, args.serve, args.pack_buf, args.host_capacity,
              os.path.abspath(args.tree), args.chunks)
    res["loadavg"] = os.getloadavg()[0]
    res["machine"] = m
    emit(res, args.json)


if __name__ == "__main__":
    main()
