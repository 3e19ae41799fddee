"""Issue 20: what a bad record, a damaged file or a greedy peer must not do to the service.

Each test drives the real thing: a `kvtier serve` subprocess (tests/service.py), a real LMDB
environment damaged on disk, real HTTP requests. Each failed before its fix (see the commit
that added it).
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import lmdb
import msgpack
import pytest

import kvtier
from kvtier.api import protocol as P
from kvtier.check import check
from kvtier.errors import BadRequest
from kvtier.pagetable.store import Catalog
from tests.conftest import blocks, keys
from tests.service import Service
from tests.test_api import raw_call

BB = 4096


def _svc(tmp_path: Path, name: str = "svc", **settings) -> Service:
    base = {"host_capacity": "8MiB", "nvme_capacity": "64MiB", "segment_bytes": "1MiB"}
    return Service(tmp_path / name, **{**base, **settings})


def _ns_create(sock: Path, **args) -> dict:
    return raw_call(sock, [P.pack({"id": 1, "op": "ns_create", **args})])[0]


# ---------------------------------------------------------------------- item 2: layouts

@pytest.mark.parametrize("layout", [
    {1: 2},                                   # a non-string map key (msgpack allows it)
    {"layers": {b"k": 1}},                    # a nested bytes key
    {"x" * 300: 1},                           # a key longer than the schema allows
    {"blob": "v" * 20000},                    # a value larger than the record may be
    {f"k{i}": i for i in range(500)},         # too many entries
    {"deep": [[[[[[[[[[1]]]]]]]]]]},          # nesting beyond the limit
    {"f": float("nan")},                      # not representable in JSON
    {"b": b"raw"},                            # bytes are not JSON-like
])
def test_a_layout_outside_the_schema_is_refused_and_the_directory_stays_usable(tmp_path, layout):
    svc = _svc(tmp_path).start()
    try:
        reply = _ns_create(svc.socket, name="bad", block_bytes=BB, layout=layout)
        assert reply["ok"] is False and reply["error"]["code"] == "bad_request"
        assert "layout" in reply["error"]["message"]
        good = _ns_create(svc.socket, name="good", block_bytes=BB,
                          layout={"dtype": "bf16", "layers": 32, "rope": [1.0, 2.5]})
        assert good["ok"] is True
    finally:
        svc.stop()
    svc.start()                                # the directory still opens
    try:
        with kvtier.Client(svc.socket) as c:
            assert c.namespace("good").layout["layers"] == 32
            assert _ns_create(svc.socket, name="other", block_bytes=BB)["ok"] is True
    finally:
        svc.stop()
    rep = check(svc.data_dir)
    assert rep.namespaces == 2 and not rep.damage


def test_a_record_written_with_integer_map_keys_still_reads(tmp_path):
    """Records an older service stored (layout {1: 2}, accepted before the schema) read back
    with the rules they were written with, and do not block the other namespaces."""
    data_dir = tmp_path / "svc"
    svc = _svc(tmp_path).start()
    with kvtier.Client(svc.socket) as c:
        c.namespace("a", block_bytes=BB).put(keys(range(3)), blocks(3, BB))
    svc.stop()
    cat = Catalog(data_dir / "meta")
    cat._write(lambda txn: txn.put(b"old", msgpack.packb(
        {"id": 7, "block_bytes": BB, "key_width": 16, "layout": {1: 2}}), db=cat._ns_db))
    cat.close()
    svc.start()
    try:
        with kvtier.Client(svc.socket) as c:
            assert c.namespace("old").layout == {"1": 2} or c.namespace("old").layout == {1: 2}
            found, _ = c.namespace("a").get(keys(range(3)))
            assert found.all()
            assert _ns_create(svc.socket, name="new", block_bytes=BB)["ok"] is True
    finally:
        svc.stop()


def test_one_garbage_namespace_record_does_not_block_the_others(tmp_path):
    data_dir = tmp_path / "svc"
    svc = _svc(tmp_path).start()
    data = blocks(3, BB)
    with kvtier.Client(svc.socket) as c:
        c.namespace("a", block_bytes=BB).put(keys(range(3)), data)
    svc.stop()
    cat = Catalog(data_dir / "meta")
    cat._write(lambda txn: txn.put(b"junk", b"\xc1\xff\x00", db=cat._ns_db))
    cat.close()
    svc.start()
    try:
        with kvtier.Client(svc.socket) as c:
            found, out = c.namespace("a").get(keys(range(3)))
            assert found.all() and (out == data).all()
            b = _ns_create(svc.socket, name="b", block_bytes=BB)
            assert b["ok"] is True and b["ns_id"] == 2     # the damaged record's id is not reused
            junk = _ns_create(svc.socket, name="junk", block_bytes=BB)
            assert junk["ok"] is False and "check --repair" in junk["error"]["message"]
        assert "junk" in svc.output() and "kvtier check --repair" in svc.output()
    finally:
        svc.stop()
    rep = check(data_dir)
    assert [d["problem"] for d in rep.damage] == ["namespace_record"]
    rep = check(data_dir, repair=True)
    assert rep.repaired == 1
    assert not check(data_dir).damage
    cat = Catalog(data_dir / "meta")               # quarantined, not deleted
    with cat.env.begin(db=cat.env.open_db(b"quarantine")) as txn:
        assert txn.get(b"namespaces/junk") == b"\xc1\xff\x00"
    cat.close()


# ---------------------------------------------------------------------- item 4: 1,000 namespaces

def test_the_documented_thousand_namespaces_survive_a_restart(tmp_path):
    """max_dbs must count the catalog's own databases too (MDB_DBS_FULL before)."""
    import numpy as np
    from kvtier.pagetable.store import MAX_NAMESPACES, record_dtype
    assert MAX_NAMESPACES >= 1000
    path = tmp_path / "meta"
    cat = Catalog(path)
    key = np.frombuffer(keys([5]), dtype="V16")
    for i in range(MAX_NAMESPACES):
        rec = cat.add_namespace(f"ns{i}", BB, 16, {})
        if i == MAX_NAMESPACES - 1:
            row = np.zeros(1, dtype=record_dtype(16))
            row["seg"], row["version"], row["size"] = 1, 1, BB
            cat.put_records(rec.ns_id, key, row)
    cat.close()
    cat = Catalog(path)
    try:
        names = cat.namespaces()
        assert len(names) == MAX_NAMESPACES
        last = max(names, key=lambda r: r.ns_id)
        k, r, bad = cat.load(last.ns_id, 16)
        assert k.size == 1 and bad == 0
        with pytest.raises(kvtier.errors.NamespaceError, match="max_namespaces|at most"):
            cat.add_namespace("one-too-many", BB, 16, {})
    finally:
        cat.close()


# ---------------------------------------------------------------------- item 13: file modes

def test_no_file_of_the_data_directory_is_readable_by_other_users(tmp_path):
    svc = _svc(tmp_path).start()
    try:
        with kvtier.Client(svc.socket) as c:
            c.namespace("m", block_bytes=BB).put(keys(range(3)), blocks(3, BB))
        loose = []
        for root, dirs, files in os.walk(svc.data_dir):
            for name in dirs + files:
                p = Path(root) / name
                mode = p.lstat().st_mode
                if stat.S_ISSOCK(mode):
                    continue                       # the socket: 0600 (test_api)
                if mode & (stat.S_IRWXG | stat.S_IRWXO):
                    loose.append(f"{p.relative_to(svc.data_dir)} {stat.filemode(mode)}")
        assert loose == []
        assert svc.data_dir.stat().st_mode & 0o077 == 0
    finally:
        svc.stop()


def test_an_older_directory_with_open_modes_is_tightened_at_start(tmp_path):
    svc = _svc(tmp_path).start()
    svc.stop()
    for p in [svc.data_dir / "meta", svc.data_dir / "meta" / "data.mdb",
              svc.data_dir / "meta" / "lock.mdb"]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    svc.start()
    svc.stop()
    assert (svc.data_dir / "meta").stat().st_mode & 0o077 == 0
    assert (svc.data_dir / "meta" / "data.mdb").stat().st_mode & 0o077 == 0
    assert (svc.data_dir / "meta" / "lock.mdb").stat().st_mode & 0o077 == 0


# ---------------------------------------------------------------------- items 11, 12, 14: admin

def _http(port: int, head: str, body: bytes = b"", timeout: float = 10.0) -> tuple[int, bytes]:
    """One raw HTTP/1.1 exchange; returns (status, body). The caller writes every header."""
    import socket
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        head_part, _, rest = data.partition(b"\r\n\r\n")
        status = int(head_part.split()[1]) if head_part else 0
        length = next((int(line.split(b":")[1]) for line in head_part.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), None)
        while length is not None and len(rest) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
        return status, rest


@pytest.fixture
def admin_svc(tmp_path):
    svc = _svc(tmp_path, admin_token="s3cret-token").start()
    yield svc
    svc.stop()


def test_an_oversized_unauthenticated_body_is_refused_before_it_is_read(admin_svc):
    """200 MiB announced, nothing sent: the 401 must come from the headers alone (before the fix
    the server waited for the body, and buffered it all when it came)."""
    status, _ = _http(admin_svc.port, f"POST /v1/flush HTTP/1.1\nHost: 127.0.0.1:{admin_svc.port}"
                      f"\nContent-Type: application/json\nContent-Length: {200 << 20}\n")
    assert status == 401
    status, body = _http(admin_svc.port,
                         f"POST /v1/flush HTTP/1.1\nHost: 127.0.0.1:{admin_svc.port}\n"
                         "Authorization: Bearer s3cret-token\nContent-Type: application/json\n"
                         f"Content-Length: {200 << 20}\n")
    assert status == 413 and b"admin_max_body" in body
    status, body = _http(admin_svc.port,
                         f"POST /v1/flush HTTP/1.1\nHost: 127.0.0.1:{admin_svc.port}\n"
                         "Authorization: Bearer s3cret-token\nContent-Type: application/json\n"
                         "Content-Length: 2\n", b"{}")
    assert status == 200 and b"flushed" in body


def test_a_chunked_body_over_the_cap_is_cut_off(admin_svc):
    chunk = b"x" * 65536
    body = b"".join(b"%x\r\n" % len(chunk) + chunk + b"\r\n" for _ in range(8)) + b"0\r\n\r\n"
    status, text = _http(admin_svc.port,
                         f"POST /v1/flush HTTP/1.1\nHost: 127.0.0.1:{admin_svc.port}\n"
                         "Authorization: Bearer s3cret-token\nContent-Type: application/json\n"
                         "Transfer-Encoding: chunked\n", body)
    assert status == 413 and b"admin_max_body" in text


def test_the_token_must_match_exactly(admin_svc):
    """(Trailing blanks are HTTP's optional whitespace, dropped by the parser before any
    comparison; blanks inside the value are not.)"""
    for auth in ["Bearer  s3cret-token", "Bearer \ts3cret-token", "Bearer s3cret-tok en",
                 "bearer s3cret-token", "Bearer s3cret-tokenX", "Bearer", "s3cret-token"]:
        status, _ = _http(admin_svc.port,
                          f"POST /v1/flush HTTP/1.1\nHost: 127.0.0.1:{admin_svc.port}\n"
                          f"Authorization: {auth}\nContent-Length: 0\n")
        assert status == 401, auth


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.nip.io",
                                  "localhost.evil.example:{port}", ""])
def test_a_forged_host_header_is_refused_on_every_endpoint(admin_svc, host):
    """DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1 sends
    Host: evil.example; only the bound address, IP literals and localhost names are served."""
    host = host.format(port=admin_svc.port)
    for path in ["/v1/stats", "/v1/clients", "/v1/namespaces", "/metrics", "/", "/healthz"]:
        line = f"Host: {host}\n" if host else ""
        status, _ = _http(admin_svc.port, f"GET {path} HTTP/1.1\n{line}")
        assert status in (400, 421), (path, status)
    for ok in [f"127.0.0.1:{admin_svc.port}", f"localhost:{admin_svc.port}", "localhost",
               "127.0.0.1"]:
        status, _ = _http(admin_svc.port, f"GET /v1/clients HTTP/1.1\nHost: {ok}\n")
        assert status == 200, ok


@pytest.mark.skipif(__import__("shutil").which("chromium") is None,
                    reason="chromium is installed by .ci/run")
def test_dns_rebinding_from_headless_chromium_reads_nothing(admin_svc, tmp_path):
    """A real browser, its resolver told that rebind.test is 127.0.0.1 (what a rebinding DNS
    server does after the page has loaded): the page may not read the admin API."""
    import shutil
    import subprocess
    with kvtier.Client(admin_svc.socket, name="victim-worker"):
        out = subprocess.run(
            [shutil.which("chromium"), "--headless", "--no-sandbox", "--disable-gpu",
             f"--user-data-dir={tmp_path / 'chromium'}",
             "--host-resolver-rules=MAP rebind.test 127.0.0.1", "--dump-dom",
             f"http://rebind.test:{admin_svc.port}/v1/clients"],
            capture_output=True, text=True, timeout=120)
    assert "victim-worker" not in out.stdout and '"pid"' not in out.stdout
    assert "Host" in out.stdout                   # the refusal says why


def test_a_release_parked_for_a_closed_connection_leaves_no_unretrieved_error(tmp_path):
    """Releases that wait for the engine lock and whose connection then closes: their
    LeaseError must not surface as 'Future exception was never retrieved', nor shutdown leave
    'coroutine ... was never awaited'."""
    import socket
    import threading
    svc = _svc(tmp_path, host_capacity="32MiB", nvme_capacity="256MiB").start()
    stop = threading.Event()
    client = kvtier.Client(svc.socket)
    ns = client.namespace("busy", block_bytes=1 << 20)

    def writer() -> None:
        data = blocks(8, 1 << 20)
        i = 0
        while not stop.is_set():
            ns.put(keys(range(i, i + 8)), data)           # write_through: holds the lock
            i = (i + 8) % 64

    t = threading.Thread(target=writer)
    t.start()
    try:
        frames = b"".join(P.pack({"id": i, "op": "release", "lease": 10**9 + i})
                          for i in range(64))
        for _ in range(150):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(10)
            while s.connect_ex(str(svc.socket)) != 0:     # EAGAIN: the accept backlog is full
                time.sleep(0.01)
            s.sendall(P.pack({"id": 0, "op": "hello", "version": 1}) + frames)
            s.close()                                     # gone before its replies
    finally:
        stop.set()
        t.join()
        client.close()
        svc.stop()
    log = svc.output()
    assert "never retrieved" not in log and "never awaited" not in log
    assert "Traceback" not in log


# ---------------------------------------------------------------------- items 7, 8: memory

def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_namespace_whose_slot_metadata_would_be_huge_is_refused(tmp_path):
    """block_bytes=1 at a 64 MiB host tier: 67M slots, ~1 GB of metadata before the fix."""
    svc = _svc(tmp_path, host_capacity="64MiB").start()
    try:
        before = _rss(svc.proc.pid)
        reply = _ns_create(svc.socket, name="tiny", block_bytes=1)
        assert reply["ok"] is False and reply["error"]["code"] == "capacity"
        assert "max_host_slots" in reply["error"]["message"]
        assert _rss(svc.proc.pid) - before < 64 << 20
        assert _ns_create(svc.socket, name="ok", block_bytes=64)["ok"] is True   # 1 Mi slots
    finally:
        svc.stop()


def test_the_namespace_count_is_bounded_by_a_setting(tmp_path):
    svc = _svc(tmp_path, max_namespaces=3, nvme_capacity="0").start()
    try:
        for i in range(3):
            assert _ns_create(svc.socket, name=f"n{i}", block_bytes=BB)["ok"] is True
        reply = _ns_create(svc.socket, name="n3", block_bytes=BB)
        assert reply["ok"] is False and "max_namespaces" in reply["error"]["message"]
        assert _ns_create(svc.socket, name="n1", block_bytes=BB)["ok"] is True   # reopen
    finally:
        svc.stop()


def test_an_inline_get_larger_than_max_frame_is_refused_without_allocating(tmp_path):
    svc = _svc(tmp_path, max_frame="8MiB", max_buffered="64MiB").start()
    try:
        assert _ns_create(svc.socket, name="big", block_bytes=1 << 20)["ok"] is True
        before = _rss(svc.proc.pid)
        for _ in range(4):                # missing keys: zeros would have been sent for each
            reply = raw_call(svc.socket, [P.pack({"id": 1, "op": "get", "ns": "big",
                                                  "keys": keys(range(200)), "inline": True})])[0]
            assert reply["ok"] is False and "max_frame" in reply["error"]["message"]
        assert _rss(svc.proc.pid) - before < 64 << 20
        reply = raw_call(svc.socket, [P.pack({"id": 1, "op": "get", "ns": "big",
                                              "keys": keys(range(4)), "inline": True})])[0]
        assert reply["ok"] is True and len(reply["data"]) == 4 << 20
    finally:
        svc.stop()


def test_half_sent_frames_of_many_connections_are_bounded(tmp_path):
    import socket
    svc = _svc(tmp_path, max_frame="1MiB", max_buffered="4MiB").start()
    conns = []
    try:
        before = _rss(svc.proc.pid)
        refused = 0
        for _ in range(12):
            s = socket.socket(socket.AF_UNIX)
            conns.append(s)
            s.settimeout(10)
            s.connect(str(svc.socket))
            try:
                s.sendall(P.LENGTH.pack(1 << 20) + b"\x81" + b"x" * ((1 << 20) - 4096))
            except (BrokenPipeError, ConnectionResetError):
                refused += 1                # closed while it was still sending
                continue
            s.settimeout(2)
            try:
                data = s.recv(65536)
            except TimeoutError:
                continue                    # still open, its half frame within the budget
            assert b"max_buffered" in data
            refused += 1
        assert 8 <= refused <= 10           # 4 MiB hold three or four of them
        assert _rss(svc.proc.pid) - before < 32 << 20
    finally:
        for s in conns:
            s.close()
    try:
        with kvtier.Client(svc.socket) as c:      # the service carries on
            ns = c.namespace("m", block_bytes=BB)
            ns.put(keys(range(2)), blocks(2, BB))
            assert ns.get(keys(range(2)))[0].all()
    finally:
        svc.stop()


# ---------------------------------------------------------------------- item 3: bound records

def _flip_key_in(path: Path, key: bytes, bit: int = 0) -> bytes:
    """Flip one bit of every copy of key in a real file (LMDB keeps old pages too)."""
    raw = bytearray(path.read_bytes())
    flipped = bytes([key[0] ^ (1 << bit)]) + key[1:]
    at = raw.find(key)
    assert at >= 0
    while at >= 0:
        raw[at:at + len(key)] = flipped
        at = raw.find(key, at + 1)
    path.write_bytes(bytes(raw))
    return flipped


def test_a_bit_flip_in_a_key_stored_in_lmdb_serves_nothing_and_check_reports_it(tmp_path):
    import hashlib
    svc = _svc(tmp_path).start()
    k = hashlib.sha256(b"victim").digest()[:16]
    data = blocks(1, BB, seed=9)
    try:
        with kvtier.Client(svc.socket) as c:
            c.namespace("m", block_bytes=BB).put(k, data)        # write_through: in LMDB
    finally:
        svc.stop()
    flipped = _flip_key_in(svc.data_dir / "meta" / "data.mdb", k, bit=3)
    svc.start()
    try:
        with kvtier.Client(svc.socket) as c:
            found, out = c.namespace("m").get(flipped)
            assert not found.any()                 # before: another key's block, served
            assert not c.namespace("m").get(k)[0].any()
            assert c.stats()["records_dropped"] == 1
    finally:
        svc.stop()
    rep = check(svc.data_dir)
    assert [(d["problem"], d["key"]) for d in rep.damage] == [("binding", flipped.hex())]
    rep = check(svc.data_dir, repair=True)
    assert rep.repaired == 1 and not check(svc.data_dir).damage


def test_records_written_before_the_binding_still_read(tmp_path):
    """Older records (flags without FLAG_BOUND, binding zero) are served as before."""
    import numpy as np
    from kvtier.pagetable.store import FLAG_BOUND, record_dtype
    svc = _svc(tmp_path).start()
    data = blocks(3, BB, seed=4)
    try:
        with kvtier.Client(svc.socket) as c:
            c.namespace("m", block_bytes=BB).put(keys(range(3)), data)
    finally:
        svc.stop()
    cat = Catalog(svc.data_dir / "meta")
    ns_id = cat.namespaces()[0].ns_id
    ks, recs, _ = cat.load(ns_id, 16)
    old = recs.copy()
    old["flags"] &= ~np.uint32(FLAG_BOUND)
    old["binding"] = 0
    db = cat._db(ns_id)
    cat._write(lambda txn: [txn.put(bytes(k), r.tobytes(), db=db) for k, r in zip(ks, old)])
    cat.close()
    assert old.dtype == record_dtype(16)
    svc.start()
    try:
        with kvtier.Client(svc.socket) as c:
            found, out = c.namespace("m").get(keys(range(3)))
            assert found.all() and (out == data).all()
    finally:
        svc.stop()
    assert not check(svc.data_dir).damage


@pytest.mark.skipif(__import__("shutil").which("redis-server") is None,
                    reason="redis-server is installed by .ci/run")
def test_a_remote_value_under_another_key_is_not_served(tmp_path):
    from tests.redis_servers import RedisServer
    redis = RedisServer(tmp_path).start()
    a = _svc(tmp_path, "a", redis=redis.url).start()
    b = None
    data = blocks(2, BB, seed=5)
    try:
        with kvtier.Client(a.socket) as c:
            c.namespace("shared", block_bytes=BB).put(keys(range(2)), data)
        k0, k9 = keys([0]).hex(), keys([9]).hex()
        redis.cli("COPY", f"kvtier:shared:{k0}", f"kvtier:shared:{k9}")   # a misplaced value
        # an old-format (KVT1) value of key 5, as a service before the binding wrote it
        import xxhash
        v1 = b"KVT1%020d%020d" % (1, xxhash.xxh3_64_intdigest(data[1].tobytes())) + \
            data[1].tobytes()
        import redis as redis_py
        r = redis_py.Redis(port=redis.port)
        r.set(f"kvtier:shared:{keys([5]).hex()}".encode(), v1)
        r.close()
        b = _svc(tmp_path, "b", redis=redis.url).start()        # empty local tiers
        with kvtier.Client(b.socket) as c:
            ns = c.namespace("shared", block_bytes=BB)
            found, out = ns.get(keys([9]))
            assert not found.any()                       # before: key 0's block, as key 9
            found, out = ns.get(keys([0, 5]))
            assert found.all() and (out[0] == data[0]).all() and (out[1] == data[1]).all()
            assert c.stats()["tiers"]["remote"]["binding_failures"] == 1
    finally:
        a.stop()
        if b is not None:
            b.stop()
        redis.stop()


# ---------------------------------------------------------------------- item 6: damaged files

def _filled(tmp_path: Path, n: int = 64) -> tuple[Service, "object"]:
    svc = _svc(tmp_path).start()
    data = blocks(n, BB, seed=11)
    try:
        with kvtier.Client(svc.socket) as c:
            c.namespace("m", block_bytes=BB).put(keys(range(n)), data)
    finally:
        svc.stop()
    return svc, data


def _refused(svc: Service, *words: str) -> str:
    with pytest.raises(RuntimeError) as info:
        svc.start()
    text = str(info.value)
    assert "exited with 2" in text, text              # not -7 (SIGBUS) nor a traceback's 1
    assert "Traceback" not in text
    for w in words:
        assert w in text, (w, text)
    return text


def _check_cli(data_dir: Path, *extra: str) -> "subprocess.CompletedProcess":
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "kvtier.cli", "check", "--data-dir",
                           str(data_dir), *extra], capture_output=True, text=True, timeout=120)


def test_a_truncated_lmdb_file_is_refused_by_name_and_repair_moves_it_aside(tmp_path):
    svc, _ = _filled(tmp_path)
    mdb = svc.data_dir / "meta" / "data.mdb"
    os.truncate(mdb, mdb.stat().st_size // 2 // 4096 * 4096)
    _refused(svc, "data.mdb", "kvtier check --repair")
    out = _check_cli(svc.data_dir)
    assert out.returncode == 2 and "data.mdb" in out.stderr and out.returncode != -7
    out = _check_cli(svc.data_dir, "--repair")
    assert out.returncode == 0, out.stderr
    moved = list((svc.data_dir / "quarantine").rglob("data.mdb"))
    assert len(moved) == 1                                  # kept, not deleted
    assert list((svc.data_dir / "quarantine").rglob("seg-*.kvt"))   # its segments too
    svc.start()
    try:
        with kvtier.Client(svc.socket) as c:
            ns = c.namespace("m", block_bytes=BB)
            assert not ns.get(keys(range(4)))[0].any()      # empty, and says so in the log
            ns.put(keys([1]), blocks(1, BB))
            assert ns.get(keys([1]))[0].all()
    finally:
        svc.stop()


@pytest.mark.parametrize("seed", range(4))
def test_random_bytes_inside_lmdb_never_give_a_traceback_or_a_wrong_block(tmp_path, seed):
    import random
    svc, data = _filled(tmp_path, n=400)
    mdb = svc.data_dir / "meta" / "data.mdb"
    raw = bytearray(mdb.read_bytes())
    rng = random.Random(seed)
    for _ in range(4):                                     # four pages of garbage, past the metas
        page = rng.randrange(2, len(raw) // 4096)
        raw[page * 4096:(page + 1) * 4096] = rng.randbytes(4096)
    mdb.write_bytes(bytes(raw))
    try:
        svc.start()
    except RuntimeError as exc:
        text = str(exc)
        assert "exited with 2" in text and "Traceback" not in text and "data.mdb" in text
        out = _check_cli(svc.data_dir, "--repair")
        assert out.returncode == 0, out.stderr
        svc.start()
    try:
        with kvtier.Client(svc.socket) as c:
            ns = c.namespace("m", block_bytes=BB)
            found, out = ns.get(keys(range(400)))
            assert (out[found] == data[found]).all()        # served or missed, never wrong
    finally:
        svc.stop()
    assert "Traceback" not in svc.output()


def test_a_lost_lmdb_file_is_refused_instead_of_starting_empty_over_old_segments(tmp_path):
    svc, _ = _filled(tmp_path)
    for name in ("data.mdb", "lock.mdb"):
        (svc.data_dir / "meta" / name).unlink()
    _refused(svc, "data.mdb", "nvme", "kvtier check --repair")
    out = _check_cli(svc.data_dir, "--repair")
    assert out.returncode == 0, out.stderr
    assert list((svc.data_dir / "quarantine").rglob("seg-*.kvt"))
    assert not (svc.data_dir / "nvme" / "ns-1").exists()
    svc.start()
    svc.stop()


@pytest.mark.parametrize("content", ["foreign", "zeroed"])
def test_a_foreign_or_zeroed_segment_is_refused_and_repair_moves_it_aside(tmp_path, content):
    svc, data = _filled(tmp_path)
    seg_dir = svc.data_dir / "nvme" / "ns-1"
    bogus = seg_dir / "seg-00000099.kvt"
    bogus.write_bytes(os.urandom(8192) if content == "foreign" else bytes(8192))
    _refused(svc, "seg-00000099.kvt", "kvtier check --repair")
    out = _check_cli(svc.data_dir, "--repair")
    assert out.returncode == 0, out.stderr
    assert not bogus.exists()
    assert list((svc.data_dir / "quarantine").rglob("seg-00000099.kvt"))
    svc.start()
    try:
        with kvtier.Client(svc.socket) as c:
            found, out = c.namespace("m").get(keys(range(64)))
            assert found.all() and (out == data).all()
    finally:
        svc.stop()


# ---------------------------------------------------------------------- item 9: lease quota

def test_one_client_pinning_the_host_tier_leaves_others_their_nvme_blocks_and_puts(tmp_path):
    """A: leases on as many host slots as it can get. B: gets of durable blocks that live on
    NVMe only, and puts. Before max_client_share, A held all 256 slots and B got misses and
    CapacityError until lease_timeout."""
    svc = _svc(tmp_path, host_capacity="1MiB", nvme_capacity="64MiB").start()   # 256 slots
    data = blocks(768, BB, seed=2)
    try:
        with kvtier.Client(svc.socket) as a, kvtier.Client(svc.socket) as b:
            na = a.namespace("m", block_bytes=BB)
            for lo in range(0, 768, 128):
                na.put(keys(range(lo, lo + 128)), data[lo:lo + 128])   # write_through: durable
            held, refused = [], None
            for lo in range(512, 768, 16):
                try:
                    held.append(na.get_leased(keys(range(lo, lo + 16))))
                except kvtier.errors.CapacityError as exc:
                    refused = exc
                    break
            assert refused is not None and "max_client_share" in str(refused)
            nb = b.namespace("m")
            found, out = nb.get(keys(range(0, 32)))          # on NVMe only: copy-on-read
            assert found.all() and (out == data[:32]).all()
            nb.put(keys(range(1000, 1016)), blocks(16, BB, seed=8))
            assert nb.get(keys(range(1000, 1016)))[0].all()
            for lease in held:
                lease.release()
            assert len(na.get_leased(keys(range(512, 528))).views) == 16  # quota given back
    finally:
        svc.stop()


# ---------------------------------------------------------------------- item 10: per-namespace

def test_namespaces_share_one_aio_context_and_their_slot_metadata_is_bounded(tmp_path):
    """Each namespace set up its own AIO context (256 events of the host-wide fs.aio-max-nr:
    ~256 namespaces exhausted it for every process on the host)."""
    svc = _svc(tmp_path, host_capacity="64MiB", max_slot_metadata="16MiB").start()
    try:
        with kvtier.Client(svc.socket) as c:
            for i in range(40):
                c.namespace(f"n{i}", block_bytes=BB).put(keys(range(2)), blocks(2, BB, seed=i))
            maps = Path(f"/proc/{svc.proc.pid}/maps").read_text()
            assert maps.count("[aio]") <= 1
            # 16,384 slots x 17 B each (278,528 B): 16 MiB holds 60 such namespaces
        replies = [_ns_create(svc.socket, name=f"m{i}", block_bytes=BB) for i in range(30)]
        ok = [r["ok"] for r in replies]
        assert ok == [True] * 20 + [False] * 10       # 60 namespaces' worth, then refused
        assert "max_slot_metadata" in replies[-1]["error"]["message"]
    finally:
        svc.stop()


def test_check_reads_namespaces_of_any_block_size(tmp_path):
    """A 17-byte namespace made check crash (a 4 KiB-rounded buffer reshaped to 256 x 17)."""
    svc = _svc(tmp_path).start()
    data = blocks(3, 17, seed=1)
    try:
        with kvtier.Client(svc.socket) as c:
            c.namespace("odd", block_bytes=17).put(keys(range(3)), data)
    finally:
        svc.stop()
    rep = check(svc.data_dir)
    assert rep.records == 3 and rep.sound == 3 and not rep.damage
