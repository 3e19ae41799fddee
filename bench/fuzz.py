"""Protocol soak: a million generated frames at a real `kvtier serve`; it must still answer.

    python bench/fuzz.py --frames 1000000 --json

Every frame is well framed (a length prefix and that many bytes) with a body from one of three
generators: random bytes; msgpack maps with a random op and random arguments of random types;
maps with a valid op and plausible but wrong arguments (bad key widths, unknown namespaces, stale
leases, slots out of range, wrong data sizes). Each must get a reply. One connection in ten then
ends in broken framing (random bytes, or an oversize length prefix), which may close only that
connection. Frames go out in bursts on fresh connections; replies are drained. At the end the
service must be alive and answer a valid hello and a correct put/get round trip.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import sys
import tempfile
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=1_000_000)
    ap.add_argument("--burst", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = header("bench/fuzz.py")
    import kvtier
    import numpy as np
    from tests.service import Service
    base = tempfile.mkdtemp(prefix="kvtier-fuzz-", dir=os.getcwd())
    svc = Service(os.path.join(base, "svc"), admin=False, host_capacity="16MiB",
                  nvme_capacity="64MiB").start()
    r = random.Random(args.seed)
    sent = replies = conns = 0
    t0 = time.perf_counter()
    try:
        with kvtier.Client(svc.socket) as c:
            c.namespace("fz", block_bytes=4096).put(b"\x01" * 16, np.ones((1, 4096), np.uint8))
        while sent < args.frames:
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(10)
            s.connect(str(svc.socket))
            conns += 1
            n = min(args.burst, args.frames - sent)
            payload = b"".join(frame(r) for _ in range(n))
            if r.random() < 0.1:             # one connection in ten ends in broken framing
                payload += breaker(r)
            try:
                s.sendall(payload)
            except OSError:
                pass                        # the server closed on an oversize length: fine
            sent += n
            s.shutdown(socket.SHUT_WR)
            buf = b""
            try:
                while True:
                    chunk = s.recv(1 << 16)
                    if not chunk:
                        break
                    buf += chunk
            except OSError:
                pass
            while len(buf) >= 4:
                ln = P.LENGTH.unpack_from(buf)[0]
                if len(buf) < 4 + ln:
                    break
                msgpack.unpackb(buf[4:4 + ln])
                replies += 1
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
            leases = c.stats()["leases"]
        alive = svc.proc.poll() is None
    finally:
        svc.stop()
        shutil.rmtree(base, ignore_errors=True)
    out = {"frames": sent, "connections": conns, "replies": replies, "alive": alive,
           "hello_ok": hello_ok, "roundtrip_ok": roundtrip_ok, "leases_after": leases,
           "frames_per_s": round(sent / elapsed, 1), "machine": m}
    emit(out, args.json)
    if not (alive and hello_ok and roundtrip_ok):
        sys.exit(1)


if __name__ == "__main__":
    main()
