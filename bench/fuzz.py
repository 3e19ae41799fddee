"""Protocol soak: a million generated frames at a real `kvtier serve`; it must still answer.

    python bench/fuzz.py --frames 1000000 --json

Every frame is well framed (a length prefix and that many bytes) with a body from one of three
generators: random bytes; msgpack maps with a random op and random arguments of random types;
maps with a valid op and plausible but wrong arguments (bad key widths, unknown namespaces, stale
leases, slots out of range, wrong data sizes). Each must get a reply. One connection in ten then
ends in broken framing (random bytes, or an oversize length prefix), which may close only that
connection. Frames go out in bursts on fresh connections; replies are drained. At the end the
service must be alive and answer a valid hello and a correct put/get round trip.

    python bench/fuzz.py --structured --frames 1000000 --json

--structured: every body is a valid request map of a real op whose arguments are plausible in
shape but wrong in type or size (every argument swapped in turn for another type; key and slot
arrays of odd lengths; block_bytes, key_width and batch sizes from 0 to 2**40; inline gets of
100,000 keys; layouts with integer, bytes or over-long keys, NaN, deep nesting, 20 KB strings),
and ns_create over a pool of 3,000 names, so the service meets its namespace limits. After the
run the store must still open: the service is stopped, `kvtier check` must find no damage, and
a restart must serve the round trip again. rss_before/rss_after: the service's resident set
after its warm-up and after the run (the ratio must stay under 2).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import msgpack  # noqa: E402

from bench.common import emit, header  # noqa: E402
from kvtier.api import protocol as P  # noqa: E402

FIELDS = ["id", "op", "ns", "keys", "version", "lease", "rid", "slots", "name", "block_bytes",
          "data", "inline", "map", "checksums", "parents", "key_width", "layout",
          "release_first"]


def rand_value(r: random.Random):
    kind = r.randrange(9)
    if kind == 0:
        return None
    if kind == 1:
        return r.choice([0, 1, -1, 2**31, 2**63 - 1, -2**63, r.randrange(-1000, 1000)])
    if kind == 2:
        return r.randbytes(r.choice([0, 1, 15, 16, 17, 32, 64, r.randrange(200)]))
    if kind == 3:
        return "".join(chr(r.randrange(32, 0x2FF)) for _ in range(r.randrange(12)))
    if kind == 4:
        return r.random() < 0.5
    if kind == 5:
        return r.random() * 1e9
    if kind == 6:
        return [rand_value(r) for _ in range(r.randrange(3))]
    if kind == 7:
        return {str(r.randrange(5)): r.randrange(9) for _ in range(r.randrange(3))}
    return r.choice(list(P.OPS))


def breaker(r: random.Random) -> bytes:
    """Bytes that break the framing itself: the server may close the connection after them."""
    if r.random() < 0.5:
        return P.LENGTH.pack(0xFFFFFFFF) + b"x"
    return r.randbytes(r.randrange(1, 64))


def frame(r: random.Random) -> bytes:
    """A well-framed request with a body that may be anything."""
    g = r.random()
    if g < 0.30:
        body = r.randbytes(r.randrange(0, 64))
        return P.LENGTH.pack(len(body)) + body
    if g < 0.65:
        d = {r.choice(FIELDS): rand_value(r) for _ in range(r.randrange(1, 7))}
        return P.pack(d)
    else:
        op = r.choice(list(P.OPS))
        d = {"id": r.randrange(1 << 30), "op": op, "ns": r.choice(["fz", "nope", ""]),
             "keys": r.randbytes(r.choice([16, 32, 15, 0, 160])),
             "lease": r.randrange(-5, 1 << 20), "rid": r.randrange(-5, 1 << 20),
             "version": r.choice([1, 0, 2]), "name": r.choice(["fz", "x" * 300, ""]),
             "block_bytes": r.choice([4096, 0, -1, 1 << 40]),
             "data": r.randbytes(r.choice([0, 4096, 100])),
             "slots": r.randbytes(r.choice([4, 8, 3])), "inline": r.random() < 0.5,
             "map": r.random() < 0.3, "checksums": r.randbytes(r.choice([8, 7]))}
        return P.pack({k: v for k, v in d.items() if r.random() < 0.7 or k in ("id", "op")})


ODD_SIZES = [0, 1, 2, 3, 7, 15, 16, 17, 64, 65, 512, 4096, 65536, 1 << 20, 1 << 30, 1 << 31,
             1 << 40, -1, -(1 << 63)]
OTHER_TYPES = [None, True, 1.5, float("nan"), "16", b"\x00" * 8, [], [1, 2], {}, {"a": 1},
               (1 << 63) - 1, -1]
ODD_LAYOUTS = [{1: 2}, {b"k": 1}, {"x" * 300: 1}, {"blob": "v" * 20000},
               {f"k{i}": i for i in range(400)}, {"d": [[[[[[[[1]]]]]]]]}, {"f": float("nan")},
               {"b": b"raw"}, {"ok": "bf16", "layers": 32}, [], "layout", 7, {"": 1},
               {"t": (1 << 64) - 1}, None]


def structured(r: random.Random, names: list[str]) -> bytes:
    """A request map of a real op, its arguments right in shape and wrong in type or size."""
    op = r.choice(list(P.OPS))
    width = r.choice([16, 16, 16, 15, 17, 1, 64])
    n = r.choice([1, 2, 8, 100, 1000] * 10 + [100_000])
    keybytes = r.randbytes(min(n * width, 1 << 20)) if n <= 1000 else bytes(width) * n
    d: dict = {"id": r.randrange(1 << 30), "op": op}
    if op == "hello":
        d.update(version=r.choice([1, 0, 2, -1, 1 << 40]), client=r.choice(["x", "é" * 500]))
    elif op == "ns_create":
        d.update(name=r.choice(names), block_bytes=r.choice(ODD_SIZES + [4096] * 6),
                 key_width=r.choice([16, 16, 0, 1, 64, 65, -1, 1 << 40]),
                 layout=r.choice(ODD_LAYOUTS))
    elif op == "ns_open":
        d.update(name=r.choice(names + ["fz"]), map=r.random() < 0.2)
    elif op in ("reserve", "put", "get", "match_prefix", "delete"):
        d.update(ns=r.choice(["fz", "fz", r.choice(names)]), keys=keybytes)
        if op == "put":
            d["data"] = bytes(min(n, 64) * r.choice([4096, 4095, 1]))
        if op == "get":
            d["inline"] = r.random() < 0.5
            if r.random() < 0.2:                  # a sorted get (api.sortedgets)
                d["sort"] = r.randbytes(r.choice([0, 3, 4, 8, 40]))
            elif r.random() < 0.1:                # a sorted get's later piece
                d.pop("keys")
                d.update({"of": r.choice([d["id"] - 1, r.randrange(1 << 30), -1]),
                          "piece": r.choice([1, 2, 0, -1, 1 << 40])})
        if r.random() < 0.3:
            d["parents"] = r.randbytes(r.choice([0, width, len(keybytes)]))
        if r.random() < 0.2:
            d["tier"] = r.choice(["host", "hbm", "nvme", "remote", "", "HOST"])
    elif op == "commit":
        d.update(rid=r.randrange(-5, 1 << 20), checksums=r.randbytes(r.choice([0, 7, 8, 800])))
    elif op in ("abort", "release"):
        d.update(rid=r.randrange(-5, 1 << 20), lease=r.randrange(-5, 1 << 20))
        if op == "release" and r.random() < 0.5:
            d["slots"] = r.randbytes(r.choice([0, 3, 4, 4000]))
    elif op == "flush":
        d["ns"] = r.choice(["fz", None, "nope", r.choice(names)])
    if r.random() < 0.1:
        d["release_first"] = r.randbytes(r.choice([0, 7, 8, 800]))
    if r.random() < 0.5 and len(d) > 2:               # one argument of another type
        arg = r.choice([k for k in d if k not in ("id", "op")])
        d[arg] = r.choice(OTHER_TYPES + [r.choice(ODD_LAYOUTS)])
    return P.pack(d)


def _drain(s: socket.socket, out: list[bytes]) -> None:
    try:
        while True:
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            out.append(chunk)
    except OSError:
        pass


def rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=1_000_000)
    ap.add_argument("--burst", type=int, default=200)
    ap.add_argument("--structured", action="store_true",
                    help="valid requests with wrong types and sizes (see the docstring)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = header("bench/fuzz.py")
    import kvtier
    import numpy as np
    from tests.service import Service
    base = tempfile.mkdtemp(prefix="kvtier-fuzz-", dir=os.getcwd())
    # segment_bytes 1 MiB: thousands of namespaces each preallocate a first segment.
    # max_slot_metadata 32 MiB: the bound the RSS criterion is about (README: limits).
    settings = {"host_capacity": "16MiB", "nvme_capacity": "64MiB"}
    if args.structured:
        settings.update(segment_bytes="1MiB", max_slot_metadata="32MiB", max_frame="16MiB",
                        max_buffered="64MiB")
    svc = Service(os.path.join(base, "svc"), admin=False, **settings).start()
    r = random.Random(args.seed)
    names = [f"fz-{i}" for i in range(3000)]
    gen = (lambda: structured(r, names)) if args.structured else (lambda: frame(r))
    sent = replies = conns = errors = 0
    t0 = time.perf_counter()
    try:
        with kvtier.Client(svc.socket) as c:
            c.namespace("fz", block_bytes=4096).put(b"\x01" * 16, np.ones((1, 4096), np.uint8))
            rss_before = rss(svc.proc.pid)
        while sent < args.frames:
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(10)
            s.connect(str(svc.socket))
            conns += 1
            n = min(args.burst, args.frames - sent)
            payload = b"".join(gen() for _ in range(n))
            if r.random() < 0.1:             # one connection in ten ends in broken framing
                payload += breaker(r)
            # Replies are read while the burst is sent: large ones (inline gets) would
            # otherwise fill the socket both ways and stall the two ends on each other.
            got: list[bytes] = []
            reader = threading.Thread(target=_drain, args=(s, got))
            reader.start()
            try:
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass                        # the server closed on an oversize length: fine
            sent += n
            reader.join()
            buf = b"".join(got)
            while len(buf) >= 4:
                ln = P.LENGTH.unpack_from(buf)[0]
                if len(buf) < 4 + ln:
                    break
                reply = msgpack.unpackb(buf[4:4 + ln], strict_map_key=False)
                replies += 1
                errors += not reply.get("ok")
                buf = buf[4 + ln:]
            s.close()
            if svc.proc.poll() is not None:
                raise SystemExit(f"kvtier serve died after {sent} frames:\n{svc.output()}")
        elapsed = time.perf_counter() - t0
        with kvtier.Client(svc.socket) as c:
            hello_ok = c.server_info["version"] == P.PROTOCOL_VERSION
            ns = c.namespace("fz")
            ns.put(b"\x02" * 16, np.full((1, 4096), 9, np.uint8))
            found, out = ns.get(b"\x02" * 16)
            roundtrip_ok = bool(found[0] and (out == 9).all())
            stats = c.stats()
            leases = stats["leases"]
            namespaces = stats["namespaces"]
        rss_after = rss(svc.proc.pid)
        alive = svc.proc.poll() is None
        reopened = damaged = None
        if args.structured:
            from kvtier.check import check
            svc.stop()
            damaged = len(check(svc.data_dir).damage)
            svc.start(timeout=120)
            with kvtier.Client(svc.socket) as c:
                found, out = c.namespace("fz").get(b"\x02" * 16)
                reopened = bool(found[0] and (out == 9).all())
    finally:
        svc.stop()
        shutil.rmtree(base, ignore_errors=True)
    out = {"frames": sent, "connections": conns, "replies": replies, "alive": alive,
           "hello_ok": hello_ok, "roundtrip_ok": roundtrip_ok, "leases_after": leases,
           "frames_per_s": round(sent / elapsed, 1), "mode": "structured" if args.structured
           else "random", "error_replies": errors, "namespaces_after": namespaces,
           "rss_before": rss_before, "rss_after": rss_after,
           "rss_ratio": round(rss_after / rss_before, 3), "settings": settings, "machine": m}
    if args.structured:
        out.update(reopened_ok=reopened, check_damage=damaged)
    emit(out, args.json)
    if not (alive and hello_ok and roundtrip_ok) or (args.structured and not (
            reopened and damaged == 0 and out["rss_ratio"] < 2)):
        sys.exit(1)


if __name__ == "__main__":
    main()
