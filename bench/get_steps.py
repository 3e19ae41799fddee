"""A GPU get's service steps in process (issue 16's small-page onboards; lease13):
Server._dispatch of packed get requests as kvtier.gpu.transfer.get_async sends them for
bench/gpu.py's rows (4,096 keys in a shuffled order), each reply packed: the chunked get
(pipeline.lease: every chunk a get) and the sorted get (pipeline.lease_sorted: the first
request with the pieces' ends, then one request per later piece), the requests recorded from
the tree's own client; each get's
leases piggybacked on the next get's last request, as GetTransfer's are. A real engine (no
NVMe, as bench/gpu.py's service), glibc's mmap threshold pinned as `kvtier serve` pins it
(memory.tune_malloc). Medians of --gets, us per request and ms per get.

    python bench/get_steps.py [--block 16384] [--gets 300] [--profile] [--tree TREE] [--json]

--tree: another tree's kvtier (pairs: bench/get_pairs.py --steps).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit, header  # noqa: E402


class Recorder:
    """A client stand-in that records what pipeline.lease or lease_sorted sends (and answers
    nothing: each read is a failure, which they read past), so that the requests replayed are
    the tree's own client's."""

    def __init__(self, first_id: int) -> None:
        self.sent: list[dict] = []
        self.next = first_id

    def _send(self, op: str, args: dict, piggyback: bool = True) -> int:
        self.sent.append({"op": op, "id": self.next,
                          **{k: v for k, v in args.items() if v is not None}})
        self.next += 1
        return self.next - 1

    def _reply(self, rid: int) -> dict:
        from kvtier.errors import KvtierError
        raise KvtierError("recorded, not sent")


class Names:
    """What pipeline.lease reads of a Namespace."""

    def __init__(self, client: Recorder) -> None:
        self._client, self.name, self.key_width = client, "rows", 16


def requests(how: str, kb: bytes, n: int, piece_keys: int, first_id: int) -> list[dict]:
    """A get's requests as the tree's pipeline.lease (chunked: a CUDA get's arguments) or
    lease_sorted (sorted, TransferPolicy's piece size) sends them."""
    from kvtier.api import pipeline
    rec = Recorder(first_id)
    extra = {"tier": "host", "device": None}
    if how == "chunked":
        pipeline.lease(Names(rec), kb, n, lambda rep, lo: None, extra, None, None, ())
    else:
        pipeline.lease_sorted(Names(rec), kb, n, lambda rep, at: None, extra, piece_keys)
    return rec.sent


def run(block: int, n: int, gets: int, profile: bool) -> dict:
    """On an event loop: a get's piggybacked releases end on its next iteration
    (kvtier.api.resident), which the gap between two gets gives them."""
    import asyncio
    return asyncio.run(_run(block, n, gets, profile))


async def _run(block: int, n: int, gets: int, profile: bool) -> dict:
    import asyncio
    from kvtier.api import protocol as P
    from kvtier.api.quota import ClientInfo
    from kvtier.api.server import Server
    from kvtier.coherence.engine import Engine
    from kvtier.config import make_settings
    from kvtier.gpu.plan import TransferPolicy
    from kvtier.memory import tune_malloc
    tune_malloc()                               # as `kvtier serve`
    eng = Engine(make_settings({"data_dir": tempfile.mkdtemp(prefix="kvtier-getsteps-"),
                                "host_capacity": "6GiB", "nvme_capacity": "0"}))
    eng.create_namespace("rows", block)
    keys = b"".join((i + 1).to_bytes(16, "big") for i in range(n))
    eng.put("rows", keys, np.random.default_rng(0).integers(0, 255, (n, block), np.uint8))
    order = np.random.default_rng(block).permutation(n)          # bench/gpu.py's
    kb = b"".join(keys[16 * i:16 * i + 16] for i in order)
    srv, cl = Server(eng, eng.settings), ClientInfo(1, 0, 0)
    piece_keys = TransferPolicy().sorted_piece_keys
    pc = time.perf_counter
    held: list[int] = []
    next_id = [1]

    def get(how: str) -> list[float]:
        reqs = requests(how, kb, n, piece_keys, next_id[0])
        next_id[0] += len(reqs)
        if held:
            reqs[-1]["release_first"] = np.array(held, "<u8").tobytes()
            held.clear()
        bodies = [P.pack(r)[4:] for r in reqs]
        times = []
        for body in bodies:
            t0 = pc()
            r = srv._dispatch(cl, body)
            P.pack(r[0])
            times.append(pc() - t0)
            if not r[0].get("ok"):
                raise RuntimeError(f"{how} get failed: {r[0]}")
            held.append(r[0]["lease"])
        return times
    hows = ("chunked", "sorted")
    times: dict = {h: [] for h in hows}
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
    for i in range(gets + 20):
        for how in hows if i % 2 == 0 else hows[::-1]:
            if prof is not None and how == "sorted" and i >= 20:
                prof.enable()
            t = get(how)
            if prof is not None:
                prof.disable()
            if i >= 20:
                times[how].append(t)
            await asyncio.sleep(0)          # the releases' call_soon
    out: dict = {"block": block, "n": n, "gets": gets, "piece_keys": piece_keys}
    for how, v in times.items():
        a = np.array(v) * 1e6
        out[f"{how}_us"] = np.round(np.median(a, 0), 1).tolist()
        out[f"{how}_total_ms"] = round(float(np.median(a.sum(1))) / 1e3, 4)
    if prof is not None:
        import io
        import pstats
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
        out["sorted_profile"] = s.getvalue().splitlines()[:40]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block", type=int, default=16384)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--gets", type=int, default=300)
    ap.add_argument("--profile", action="store_true", help="the sorted gets under cProfile")
    ap.add_argument("--tree", default=ROOT, help="the kvtier tree to run (pairs: main's)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.tree))   # kvtier from there, the harness from here
    m = header("bench/get_steps.py")
    res = run(args.block, args.n, args.gets, args.profile)
    import kvtier
    res["kvtier"] = kvtier.__file__
    res["loadavg"] = os.getloadavg()[0]
    res["machine"] = m
    emit(res, args.json)


if __name__ == "__main__":
    main()
