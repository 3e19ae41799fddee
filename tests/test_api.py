"""The worker API against a real `kvtier serve` subprocess: every op, sharing, leases, restarts,
bad frames and security."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import kvtier
from kvtier.api import protocol as P
from kvtier.errors import (AuthError, BadRequest, LeaseError, NamespaceError, ProtocolError,
                           ServiceUnavailable)
from tests.conftest import blocks, keys
from tests.service import Service

BB = 65536


def raw_call(path: Path, frames: list[bytes], read: bool = True) -> list[dict]:
    """Send raw frames on a fresh connection; read one reply per frame."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(str(path))
    for f in frames:
        s.sendall(f)
    out = []
    buf = b""
    while read and len(out) < len(frames):
        chunk = s.recv(1 << 16)
        if not chunk:
            break
        buf += chunk
        while len(buf) >= 4 and len(buf) >= 4 + P.LENGTH.unpack_from(buf)[0]:
            n = P.LENGTH.unpack_from(buf)[0]
            out.append(msgpack.unpackb(buf[4:4 + n]))
            buf = buf[4 + n:]
    s.close()
    return out


def test_round_trip_of_every_op(service):
    with kvtier.Client(service.socket) as c:
        assert c.server_info["version"] == P.PROTOCOL_VERSION
        ns = c.namespace("llama/tp0", block_bytes=BB, layout={"dtype": "bf16", "layers": 2})
        assert ns.layout == {"dtype": "bf16", "layers": 2}
        data = blocks(8, BB)
        parents = bytes(16) + keys(range(7))
        v = ns.put(keys(range(8)), data, parents=parents)
        assert v.tolist() == [1] * 8
        assert ns.put(keys(range(2)), data[:2]).tolist() == [2, 2]      # rewrite
        found, out = ns.get(keys(range(10)))
        assert found.tolist() == [True] * 8 + [False] * 2
        assert (out[:8] == data).all() and (out[8:] == 0).all()
        assert ns.match_prefix(keys([0, 1, 2, 9, 3])) == 3
        with ns.get_leased(keys(range(3))) as lease:
            assert (lease.views[2] == data[2]).all()
            assert c.stats()["leases"] == 1
        assert c.stats()["leases"] == 0
        inline = c.namespace("llama/tp0", inline=True)
        inline.put(keys([20]), data[:1])
        f, o = inline.get(keys([20, 21]))
        assert f.tolist() == [True, False] and (o[0] == data[0]).all()
        assert ns.delete(keys([0, 20, 99])) == 2
        assert ns.match_prefix(keys(range(3))) == 0
        assert ns.flush() >= 0 and c.flush() >= 0
        s = c.stats()
        assert s["puts"] == 11 and s["tiers"]["host"]["blocks"] == 7     # 9 keys, 2 deleted
        # raw reserve / abort and a commit of an aborted reservation
        r = c._call("reserve", ns="llama/tp0", keys=keys([30]))
        c._call("abort", rid=r["rid"])
        with pytest.raises(LeaseError):
            c._call("commit", rid=r["rid"])


def test_lookup_with_stage_brings_a_prefix_held_only_on_nvme_up_to_host(service):
    data = blocks(6, BB, seed=5)
    with kvtier.Client(service.socket) as c:
        ns = c.namespace("staged", block_bytes=BB)
        ns.put(keys(range(6)), data, parents=bytes(16) + keys(range(5)))
        assert ns.lookup(keys(range(8))) == kvtier.api.client.PrefixHit(6, 0)
    service.stop()                                   # flushed; host copies are volatile
    service.start()
    with kvtier.Client(service.socket) as c:
        ns = c.namespace("staged")
        assert ns.lookup(keys([0, 1, 2, 3, 4, 5, 9])) == kvtier.api.client.PrefixHit(6, 6)
        assert ns.lookup(keys(range(4)), stage=True).below == 4      # staging starts
        # A get right after waits for the stage in flight: one disk read, not two.
        found, out = ns.get(keys(range(4)))
        assert found.all() and (out == data[:4]).all()
        tiers = c.stats()["tiers"]
        assert tiers["host"]["prefetched"] >= 4 and tiers["nvme"]["hits"] == 0
        found, out = ns.get(keys(range(6)))      # 4, 5: not staged (the chain prefetch may)
        assert found.all() and (out == data).all()
        assert c.stats()["leases"] == 0


def test_two_clients_share_blocks(service):
    data = blocks(4, BB, seed=3)
    with kvtier.Client(service.socket, name="writer") as a, \
            kvtier.Client(service.socket, name="reader") as b:
        a.namespace("m", block_bytes=BB).put(keys(range(4)), data)
        found, out = b.namespace("m").get(keys(range(4)))
        assert found.all() and (out == data).all()
        b.namespace("m").put(keys([0]), data[3:4])                 # b rewrites, a sees it
        assert (a.namespace("m").get(keys([0]))[1][0] == data[3]).all()


def test_inputs_as_numpy_torch_and_lists(service):
    torch = pytest.importorskip("torch")
    with kvtier.Client(service.socket) as c:
        ns = c.namespace("t", block_bytes=4096)
        t = torch.arange(4096, dtype=torch.float16).reshape(2, 2048)
        ns.put([keys([0]), keys([1])], t)
        out = torch.empty(2, 2048, dtype=torch.float16)
        found, _ = ns.get(keys(range(2)), out=out)
        assert found.all() and torch.equal(out, t)
        with pytest.raises(BadRequest, match="exactly the namespace's block_bytes"):
            ns.put(keys([2]), torch.zeros(10))


def _holder(path: Path) -> subprocess.Popen:
    code = ("import kvtier, sys, time\n"
            f"c = kvtier.Client({str(path)!r})\n"
            "ns = c.namespace('m')\n"
            f"lease = ns.get_leased({keys(range(4))!r})\n"
            "print('held', flush=True)\n"
            "time.sleep(60)\n")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_a_killed_client_gives_its_slots_back(service):
    with kvtier.Client(service.socket) as c:
        c.namespace("m", block_bytes=BB).put(keys(range(4)), blocks(4, BB))
        holder = _holder(service.socket)
        assert holder.stdout.readline().strip() == "held"
        assert c.stats()["leases"] == 1
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
        deadline = time.monotonic() + 10
        while c.stats()["leases"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stats()["leases"] == 0


def test_restart_serves_flushed_blocks_and_the_client_reconnects(tmp_path: Path):
    svc = Service(tmp_path / "svc", host_capacity="8MiB", nvme_capacity="64MiB").start()
    data = blocks(6, BB, seed=5)
    c = kvtier.Client(svc.socket)
    ns = c.namespace("m", block_bytes=BB)
    ns.put(keys(range(6)), data)                       # write_through: durable when acked
    svc.kill()                                         # no chance to flush anything
    with pytest.raises(ServiceUnavailable):
        ns.get(keys(range(6)))
    svc.start()
    found, out = ns.get(keys(range(6)))                # reconnects and remaps the namespace
    assert found.all() and (out == data).all()
    assert svc.stop() == 0
    assert "stopped" in svc.output()
    c.close()


def test_sigterm_flushes_write_back_blocks(tmp_path: Path):
    svc = Service(tmp_path / "svc", write_policy="write_back", flush_interval=3600).start()
    data = blocks(3, BB, seed=9)
    with kvtier.Client(svc.socket) as c:
        c.namespace("m", block_bytes=BB).put(keys(range(3)), data)
    assert svc.stop(signal.SIGTERM) == 0
    svc.start()
    with kvtier.Client(svc.socket) as c:
        found, out = c.namespace("m").get(keys(range(3)))
        assert found.all() and (out == data).all()
    assert svc.stop(signal.SIGINT) == 0


# ---------------------------------------------------------------------- bad input

def test_typed_errors_for_bad_requests(service):
    with kvtier.Client(service.socket) as c:
        ns = c.namespace("m", block_bytes=4096)
        with pytest.raises(NamespaceError):
            c.namespace("nope")
        with pytest.raises(BadRequest, match="unknown op"):
            c._call("frobnicate")
        with pytest.raises(BadRequest, match="missing argument 'keys'"):
            c._call("get", ns="m")
        with pytest.raises(BadRequest, match="key width"):
            c._call("get", ns="m", keys=b"123")
        with pytest.raises(BadRequest, match="argument 'stage' must be bool"):
            c._call("match_prefix", ns="m", keys=keys([1]), stage="yes")
        with pytest.raises(BadRequest, match="expected n x 16 and n x 4096"):
            c._call("put", ns="m", keys=keys([1]), data=b"short")
        with pytest.raises(ProtocolError, match="protocol version"):
            c._call("hello", version=99)
        ns.put(keys([1]), blocks(1, 4096))
        g = c._call("get", ns="m", keys=keys([1]))
        with pytest.raises(BadRequest, match="slot out of range"):
            c._call("release", lease=g["lease"], slots=P.arr(np.array([10**6]), "<i4"))
        with pytest.raises(LeaseError, match="not held"):
            c._call("release", lease=g["lease"], slots=P.arr(np.array([0, 0]), "<i4"))
        c._call("release", lease=g["lease"])
        with pytest.raises(LeaseError):
            c._call("release", lease=g["lease"])                # double release
        with pytest.raises(LeaseError):
            c._call("release", lease=123456789)
        # the connection survived every one of these
        assert c.namespace("m").get(keys([1]))[0].all()


def test_single_key_get_answers_as_the_batch_get_and_its_piggybacked_releases_end(service):
    # A one-key resident get takes the server's short path: its reply carries the same fields
    # as a batch get's, and the releases a resident get carries end after its reply: stats,
    # the next request (on a thread, after them), sees only the lease the get made.
    with kvtier.Client(service.socket) as c:
        ns = c.namespace("one", block_bytes=BB)
        ns.put(keys(range(2)), blocks(2, BB))
        one = c._call("get", ns="one", keys=keys([0]))
        both = c._call("get", ns="one", keys=keys([0, 99]))
        assert one["found"] == b"\x01" and both["found"] == b"\x01\x00"
        assert one["slots"] == both["slots"][:4]
        assert one["versions"] == both["versions"][:8]
        assert one["checksums"] == both["checksums"][:8]
        c._call("release", lease=both["lease"])
        c._release_later(one["lease"])
        nxt = c._call("get", ns="one", keys=keys([1]))   # carries one's release
        assert nxt["found"] == b"\x01"
        assert c.stats()["leases"] == 1
        c._release_later(nxt["lease"])
        c._release_later(one["lease"])                   # twice: counted, nothing else
        last = c._call("get", ns="one", keys=keys([1]))
        assert last["found"] == b"\x01"
        assert c.stats()["leases"] == 1
        c._release_later(last["lease"])
        batch = c._call("get", ns="one", keys=keys([0, 1]))   # a resident batch: the same
        assert batch["found"] == b"\x01\x01"
        assert c.stats()["leases"] == 1
        assert c.release_errors == 0


def test_expired_lease_is_reclaimed_and_its_release_refused(tmp_path: Path):
    svc = Service(tmp_path / "svc", lease_timeout=0.2).start()
    try:
        with kvtier.Client(svc.socket) as c:
            ns = c.namespace("m", block_bytes=4096)
            ns.put(keys([1]), blocks(1, 4096))
            g = c._call("get", ns="m", keys=keys([1]))
            deadline = time.monotonic() + 10
            while c.stats()["leases"] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert c.stats()["expired_leases"] == 1
            with pytest.raises(LeaseError):
                c._call("release", lease=g["lease"])
    finally:
        svc.stop()


def test_malformed_body_gets_an_error_and_the_connection_stays(service):
    frames = [P.LENGTH.pack(5) + b"\xc1\xc1\xc1\xc1\xc1",        # not msgpack
              P.LENGTH.pack(3) + msgpack.packb([1, 2]),         # not a map
              P.pack({"id": 7, "op": "hello", "version": 1})]
    replies = raw_call(service.socket, frames)
    assert [r["ok"] for r in replies] == [False, False, True]
    assert replies[0]["error"]["code"] == "protocol" and replies[2]["id"] == 7


def test_oversize_length_field_closes_only_that_connection(service):
    replies = raw_call(service.socket, [P.LENGTH.pack(0xFFFFFFF0) + b"x"])
    assert replies[0]["error"]["code"] == "protocol" and "max_frame" in replies[0]["error"]["message"]
    with kvtier.Client(service.socket) as c:                    # others unaffected
        assert c.ping() > 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.lists(st.one_of(
    st.binary(max_size=64),
    st.builds(lambda b: P.LENGTH.pack(len(b)) + b, st.binary(max_size=64)),
    st.builds(lambda d: P.pack(d), st.dictionaries(
        st.sampled_from(["id", "op", "ns", "keys", "version", "lease", "rid", "slots", "name",
                         "block_bytes", "data", "inline", "map", "checksums", "parents"]),
        st.one_of(st.none(), st.integers(-2**63, 2**63 - 1), st.binary(max_size=40),
                  st.text(max_size=10), st.booleans(), st.sampled_from(list(P.OPS))),
        max_size=6))), min_size=1, max_size=8))
def test_fuzzed_frames_never_break_the_service(service, garbage):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(str(service.socket))
    try:
        s.sendall(b"".join(garbage))
    except OSError:
        pass
    s.close()
    with kvtier.Client(service.socket, timeout=10) as c:
        assert c.server_info["version"] == P.PROTOCOL_VERSION


# ---------------------------------------------------------------------- security

def test_socket_is_private(service):
    mode = stat.S_IMODE(os.stat(service.socket).st_mode)
    assert mode == 0o600
    parent = stat.S_IMODE(os.stat(service.socket.parent).st_mode)
    assert parent & 0o022 == 0


def test_a_socket_directory_others_can_write_is_refused(tmp_path: Path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    svc = Service(tmp_path / "svc", socket=str(shared / "k.sock"))
    with pytest.raises(RuntimeError, match="writable by it alone"):
        svc.start(timeout=20)


def _python_for(uid: int) -> str | None:
    """A Python that uid can run: this one, or the system's (a pyenv or venv under /root is not
    readable by others); None if neither is."""
    for exe in dict.fromkeys([sys.executable, sys._base_executable, "/usr/bin/python3",
                              "/usr/local/bin/python3"]):
        try:
            if subprocess.run([exe, "-c", "pass"], user=uid, group=uid, capture_output=True,
                              cwd="/", timeout=30).returncode == 0:
                return exe
        except OSError:                  # missing, or not executable by uid
            continue
    return None


def test_peer_of_another_uid_cannot_map_namespace_memory(tmp_path: Path):
    if os.getuid() != 0:
        pytest.skip("needs root to run a peer as another uid")
    python = _python_for(65534)
    if python is None:
        pytest.skip("no Python that uid 65534 can run (this one is in a private directory)")
    import tempfile
    sockdir = Path(tempfile.mkdtemp(prefix="kvtier-peer-"))      # reachable by uid 65534
    sockdir.chmod(0o755)
    svc = Service(tmp_path / "svc", socket_group="nogroup", socket=str(sockdir / "k.sock"))
    svc.socket = sockdir / "k.sock"
    svc.start()
    try:
        with kvtier.Client(svc.socket) as c:
            c.namespace("m", block_bytes=4096)
        assert stat.S_IMODE(os.stat(svc.socket).st_mode) == 0o660
        frames = (P.pack({"id": 1, "op": "hello", "version": 1})
                  + P.pack({"id": 2, "op": "ns_open", "name": "m", "map": True})
                  + P.pack({"id": 3, "op": "ns_open", "name": "m"}))
        child = ("import socket,sys,array\n"
                 "s=socket.socket(socket.AF_UNIX); s.settimeout(10)\n"
                 f"s.connect({str(svc.socket)!r}); s.sendall(bytes.fromhex({frames.hex()!r}))\n"
                 "buf=b''; fds=[]\n"
                 "while buf.count(b'ok')<3:\n"
                 "    d,anc,_,_=s.recvmsg(65536, socket.CMSG_SPACE(16))\n"
                 "    fds+=anc\n"
                 "    if not d: break\n"
                 "    buf+=d\n"
                 "print(len(fds), buf.hex())\n")
        out = subprocess.run([python, "-c", child], user=65534, group=65534,
                             capture_output=True, text=True, cwd="/", timeout=30)
        assert out.returncode == 0, out.stderr
        nfds, hexbuf = out.stdout.split()
        assert nfds == "0"                                 # no fd ever reached that peer
        raw = bytes.fromhex(hexbuf)
        replies = []
        while raw:
            n = P.LENGTH.unpack_from(raw)[0]
            replies.append(msgpack.unpackb(raw[4:4 + n]))
            raw = raw[4 + n:]
        assert replies[0]["ok"] and not replies[1]["ok"] and replies[2]["ok"]
        assert replies[1]["error"]["code"] == AuthError.code
        assert "allowed_uids" in replies[1]["error"]["message"]
    finally:
        svc.stop()
        import shutil
        shutil.rmtree(sockdir, ignore_errors=True)


# ---------------------------------------------------------------------- pipelined chunks

_STRAY_WRITE = """
import ctypes, sys, numpy as np, kvtier
c = kvtier.Client(sys.argv[1])
ns = c.namespace("m")
ns._view()
seg = ns._seg
try:
    ns._view()[0, 0] = 1
except ValueError:
    print("numpy refused", flush=True)
# A stray pointer write into the writable mapping, outside any put's window.
ctypes.memset(seg._base + 5 * seg.block_bytes, 0xAB, 8)
print("the write went through", flush=True)
"""


def test_slots_of_a_tier_the_service_lacks_or_cannot_lease_are_refused(service):
    with kvtier.Client(service.socket) as c:
        ns = c.namespace("m", block_bytes=BB)
        ns.put(keys([0]), blocks(1, BB))
        for tier, words in (("hbm", "no hbm tier"), ("nvme", "host or hbm"),
                            ("tape", "unknown tier")):
            with pytest.raises(BadRequest, match=words):
                c._call("get", ns="m", keys=keys([0]), tier=tier)
            with pytest.raises(BadRequest, match=words):
                c._call("reserve", ns="m", keys=keys([1]), tier=tier)
        with pytest.raises(BadRequest, match="CUDA tensors"):
            ns.get(keys([0]), tier="hbm")
        assert ns.get(keys([0]))[0].all()                # the connection is still in step
        assert c.stats()["reservations"] == 0


def test_a_stray_write_into_committed_slots_faults_instead_of_corrupting(service):
    with kvtier.Client(service.socket) as c:
        ns = c.namespace("m", block_bytes=BB)
        data = blocks(8, BB, 3)
        ns.put(keys(range(8)), data)
        out = subprocess.run([sys.executable, "-c", _STRAY_WRITE, str(service.socket)],
                             capture_output=True, text=True, timeout=60)
        assert out.stdout.splitlines() == ["numpy refused"]
        assert out.returncode == -signal.SIGSEGV           # the MMU stopped the stray write
        found, got = ns.get(keys(range(8)), verify=True)
        assert found.all() and (got == data).all()
        assert ns.put(keys([5]), data[:1]).tolist() == [2]  # puts still open their window


@contextlib.contextmanager
def big_namespace(tmp_path: Path, host: str) -> Iterator[tuple[kvtier.Client, Any]]:
    """A real serve with a host tier of `host` and no NVMe, and a 4 KiB namespace on it."""
    svc = Service(tmp_path / "svc", admin=False, host_capacity=host, nvme_capacity="0").start()
    try:
        with kvtier.Client(svc.socket) as c:
            yield c, c.namespace("big", block_bytes=4096)
    finally:
        svc.stop()


def test_large_batches_go_in_pipelined_chunks_and_round_trip(tmp_path: Path):
    # 2,500 keys: three chunks of up to 1,024 (kvtier.api.pipeline), with a duplicate-free
    # shuffled get order so that each chunk's slots are scattered.
    with big_namespace(tmp_path, "32MiB") as (c, ns):
        n = 2500
        data = blocks(n, 4096, 5)
        versions = ns.put(keys(range(n)), data)
        assert versions.tolist() == [1] * n
        order = np.random.default_rng(1).permutation(n)
        found, got = ns.get(keys(order.tolist()) + keys([n + 7]))
        assert found[:n].all() and not found[n]
        assert (got[:n] == data[order]).all() and (got[n] == 0).all()
        assert ns.put(keys(range(n)), data[::-1]).tolist() == [2] * n
        found, got = ns.get(keys(range(n)))
        assert found.all() and (got == data[::-1]).all()
        assert c.stats()["leases"] == 0


def test_a_chunk_that_cannot_be_reserved_stores_the_chunks_before_it(tmp_path: Path):
    # A real shortage: 2,500 blocks of 4 KiB into a host tier of 8 MiB (2,048 blocks) with no
    # NVMe to evict to. Chunks of 256, 1,024, 1,024 and 196: the first two fit and are
    # committed, the third is refused, and the fourth, reserved before the refusal was read,
    # is aborted.
    with big_namespace(tmp_path, "8MiB") as (c, ns):
        data = blocks(2500, 4096, 6)
        with pytest.raises(kvtier.errors.CapacityError, match="1280 of 2500 blocks"):
            ns.put(keys(range(2500)), data)
        found, got = ns.get(keys(range(1280)))
        assert found.all() and (got == data[:1280]).all()
        assert not ns.get(keys(range(1280, 2500)))[0].any()
        st = c.stats()
        assert st["leases"] == 0 and st["reservations"] == 0
        assert c.ping() > 0                 # the connection is still in step


def test_a_corrupt_block_in_one_chunk_fails_the_get_and_leaks_no_lease(tmp_path: Path):
    # A deliberate writer outside the protocol (here: this test, through a fresh writable
    # mapping of the memfd) changes a committed block in the second chunk; the verifying get
    # raises, and every chunk's lease still ends.
    with big_namespace(tmp_path, "32MiB") as (c, ns):
        ns.put(keys(range(2500)), blocks(2500, 4096, 7))
        rep = c._call("get", ns="big", keys=keys([1500]))
        c._call("release", lease=rep["lease"])
        slot = int(np.frombuffer(rep["slots"], "<i4")[0])
        ns._seg.gpu_view()[slot, 0] ^= 0xFF
        with pytest.raises(kvtier.errors.ChecksumError):
            ns.get(keys(range(2500)), verify=True)
        assert c.stats()["leases"] == 0


def test_chunk_plan_covers_every_key_once_with_a_short_first_chunk():
    from kvtier.api.pipeline import chunks
    assert chunks(2048) == [(0, 2048)]
    assert chunks(2500) == [(0, 256), (256, 1280), (1280, 2304), (2304, 2500)]
    for n in (2049, 4096, 5000, 10007):
        parts = chunks(n)
        assert parts[0] == (0, 256) and parts[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert max(hi - lo for lo, hi in parts) == 1024
