"""A GPU put's requests as kvtier.gpu.transfer.put_async sends them (reserve {ns, keys, tier} per
chunk, the writer's copy into the reserved slots, commit {rid, checksums, trusted}), against a
real `kvtier serve`: the service's reserve reads the host tier without parsing it (svc12), hands
out its slots as int32 bytes, and answers an inline op without inspect's awaitable test. What
must hold: the blocks read back as written, every other tier spelling is parsed as before (or
refused in one line with nothing held), and the commits that run on a thread (untrusted: the
service hashes) still answer, a torn write included."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

import kvtier
from kvtier.api import pipeline
from kvtier.errors import BadRequest, ChecksumError
from tests.conftest import blocks, keys

BB = 4096


@pytest.fixture
def ns(service):
    """A namespace of a client of a real `kvtier serve` (ns._client: the client)."""
    with kvtier.Client(str(service.socket)) as c:
        yield c.namespace("p", block_bytes=BB)


@pytest.fixture
def client(ns):
    return ns._client


def _sums(data: np.ndarray) -> bytes:
    return np.array([xxhash.xxh3_64_intdigest(b) for b in data], "<u8").tobytes()


def _held(client) -> int:
    return client._call("stats")["reservations"]


def _put_as_the_gpu_does(ns, kb: bytes, data: np.ndarray, **reserve_args) -> np.ndarray:
    """Every reserve sent before the first reply is read; each chunk copied and committed with
    its checksums (trusted) as its reply arrives; then every commit reply. The versions."""
    c, w, n = ns._client, ns.key_width, data.shape[0]
    parts = pipeline.chunks(n, 8)
    ids = [c._send("reserve", {"ns": ns.name, "keys": kb[lo * w:hi * w], **reserve_args})
           for lo, hi in parts]
    ns._view()
    commits = []
    for (lo, hi), rid in zip(parts, ids):
        r = c._reply(rid)
        slots = np.frombuffer(r["slots"], "<i4")
        assert slots.size == hi - lo and np.unique(slots).size == slots.size
        ns._write(slots, data[lo:hi])
        commits.append(c._send("commit", {"rid": r["rid"], "trusted": True,
                                          "checksums": _sums(data[lo:hi])}))
    return np.concatenate([np.frombuffer(c._reply(i)["versions"], "<u8") for i in commits])


@pytest.mark.parametrize("tier", [{"tier": "host"}, {}, {"tier": "HOST"}])
def test_a_gpu_puts_chunks_read_back_as_written_whatever_names_the_host_tier(ns, client, tier):
    kb, data = keys(range(40)), blocks(40, BB, seed=5)
    ns.put(kb, blocks(40, BB, seed=1))                      # rewrites, as bench/gpu.py's rows
    versions = _put_as_the_gpu_does(ns, kb, data, **tier)
    assert versions.size == 40 and versions.min() > 0
    found, got = ns.get(kb)
    assert found.all() and (got == data).all()
    assert _held(client) == 0


@pytest.mark.parametrize("tier", ["nvme", "remote", "gpu", "", 3, b"host"])
def test_a_reserve_of_any_other_tier_is_refused_in_one_line_with_nothing_held(ns, client,
                                                                             tier):
    with pytest.raises(BadRequest) as err:
        client._call("reserve", ns=ns.name, keys=keys(range(4)), tier=tier)
    assert "\n" not in str(err.value)
    assert _held(client) == 0
    assert _put_as_the_gpu_does(ns, keys(range(4)), blocks(4, BB), tier="host").size == 4


def test_commits_that_run_on_a_thread_answer_and_a_torn_one_is_refused(ns, client):
    data = blocks(6, BB, seed=7)
    r = client._call("reserve", ns=ns.name, keys=keys(range(6)), tier="host")
    ns._view()
    ns._write(np.frombuffer(r["slots"], "<i4"), data)
    # Untrusted: the service hashes every slot on a thread (an awaitable answer).
    v = client._call("commit", rid=r["rid"], checksums=_sums(data))
    assert np.frombuffer(v["versions"], "<u8").min() > 0
    r = client._call("reserve", ns=ns.name, keys=keys(range(6, 12)), tier="host")
    ns._write(np.frombuffer(r["slots"], "<i4"), data)
    torn = bytearray(_sums(data))
    torn[0] ^= 1
    with pytest.raises(ChecksumError):
        client._call("commit", rid=r["rid"], checksums=bytes(torn))
    found, got = ns.get(keys(range(12)))
    assert found[:6].all() and not found[6:].any() and (got[:6] == data).all()
    assert _held(client) == 0


def test_a_trusted_commit_with_the_wrong_count_of_checksums_ends_its_reservation(ns, client):
    r = client._call("reserve", ns=ns.name, keys=keys(range(5)), tier="host")
    with pytest.raises(BadRequest):
        client._call("commit", rid=r["rid"], trusted=True, checksums=bytes(8 * 4))
    assert _held(client) == 0
    assert not ns.get(keys(range(5)))[0].any()


@pytest.mark.parametrize("size", [0, 1, (64 << 10) - 40, 64 << 10, (64 << 10) + 1, 3 << 20])
def test_a_frame_packs_and_unpacks_whole_whatever_its_size_against_the_packers_buffer(size):
    """Guards a pack with a smaller Packer buffer than msgpack's default (svc12's proposed
    protocol.pack, bench/results/s36-svc12-pack.patch): a body past the buffer grows it."""
    from kvtier.api import protocol as P
    body = {"id": 7, "ok": True, "data": np.random.default_rng(size).bytes(size),
            "slots": np.arange(size // 64, dtype="<i4").tobytes()}
    frame = P.pack(body)
    assert P.LENGTH.unpack_from(frame)[0] == len(frame) - 4
    assert P.unpack(frame[4:]) == body
