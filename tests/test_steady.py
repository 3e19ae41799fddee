"""The NVMe tier in steady state: a full log keeps taking writes by reclaiming whole segments,
its capacity is what the disk holds, and disk reads run outside the engine lock (a block
rewritten while its read was in flight is not installed; a resident get does not wait)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from kvtier.coherence.engine import Engine
from kvtier.config import make_settings
from kvtier.tiers.nvme import PosixBackend
from kvtier.types import Tier
from tests.conftest import blocks, key, keys

BB = 64 << 10


def disk_bytes(root: Path) -> int:
    """Bytes allocated on disk under root/nvme (st_blocks), what `du` counts."""
    return sum(p.stat().st_blocks * 512 for p in (root / "nvme").rglob("*.kvt"))


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_full_nvme_tier_keeps_taking_puts(tmp_path: Path, policy: str):
    # The report's case: 8 MiB host, 32 MiB NVMe, 4 MiB segments, 200 puts of 16 new keys.
    eng = Engine(make_settings({"data_dir": str(tmp_path), "host_capacity": "8MiB",
                                "nvme_capacity": "32MiB", "segment_bytes": "4MiB",
                                "write_policy": policy}))
    eng.create_namespace("t", BB)
    worst = 0
    for i in range(200):
        eng.put("t", keys(range(i * 16, i * 16 + 16)), blocks(16, BB, i))   # never raises
        worst = max(worst, disk_bytes(tmp_path))
    s = eng.stats()["tiers"]["nvme"]
    assert worst <= 32 << 20                           # the disk never held more than capacity
    assert s["used_bytes"] <= 32 << 20 and s["evictions"] > 0
    assert s["blocks"] <= (32 << 20) // BB
    found, out = eng.read("t", keys(range(199 * 16, 200 * 16)))
    assert found.all() and (out == blocks(16, BB, 199)).all()
    eng.close(flush=False)


def test_capacity_counts_what_the_disk_holds(tmp_path: Path):
    # Four one-block namespaces: no segment is preallocated beyond what it holds.
    eng = Engine(make_settings({"data_dir": str(tmp_path), "nvme_capacity": "1GiB",
                                "segment_bytes": "256MiB"}))
    for n in range(4):
        eng.create_namespace(f"n{n}", 4096)
        eng.put(f"n{n}", key(1), blocks(1, 4096))
    used = eng.stats()["tiers"]["nvme"]["used_bytes"]
    assert disk_bytes(tmp_path) <= used <= 4 * 3 * 4096      # header + record, each
    eng.close(flush=False)


def test_reclaim_keeps_what_the_policy_ranks_hot(tmp_path: Path):
    eng = Engine(make_settings({"data_dir": str(tmp_path), "host_capacity": "2MiB",
                                "nvme_capacity": "16MiB", "segment_bytes": "2MiB",
                                "eviction": "lru"}))
    eng.create_namespace("t", BB)
    eng.put("t", keys(range(16)), blocks(16, BB))             # the first segment's blocks
    for i in range(1, 40):
        eng.read("t", keys(range(8)))                         # half of them stay hot
        eng.put("t", keys(range(i * 16, i * 16 + 16)), blocks(16, BB, i))
    found, _ = eng.read("t", keys(range(8)))
    assert found.all()                                        # copied forward, not dropped
    found, _ = eng.read("t", keys(range(8, 16)))
    assert not found.any()                                    # the cold half left
    s = eng.stats()
    assert s["tiers"]["nvme"]["used_bytes"] <= 16 << 20 and s["compactions"] > 0
    eng.close(flush=False)


def _segment_rows_by_scan(ns, seg_id: int) -> list[int]:
    cols, n = ns.table.cols, ns.table.n_rows
    return np.flatnonzero((cols["copy_ver"][:n, Tier.NVME] > 0)
                          & (cols["slot"][:n, Tier.NVME] == seg_id)).tolist()


@pytest.mark.parametrize("eviction", ["lru", "chain", "s3fifo"])
def test_each_segment_knows_exactly_the_rows_it_holds(tmp_path: Path, eviction: str):
    # Reclaim reads a segment's rows from space.Members instead of scanning the table: through
    # rewrites, reads, deletes, reclaims with re-admission and a restart, the list must be the
    # scan's answer for every segment.
    settings = make_settings({"data_dir": str(tmp_path), "host_capacity": "1MiB",
                              "nvme_capacity": "8MiB", "segment_bytes": "1MiB",
                              "eviction": eviction})
    eng = Engine(settings)
    eng.create_namespace("t", BB)
    rng = np.random.default_rng(3)

    def check(e: Engine) -> None:
        ns = e.namespace("t")
        for sid in list(ns.log.segments):
            rows, _ = e.nvme.space.of_segment(ns, sid)
            assert sorted(rows.tolist()) == _segment_rows_by_scan(ns, sid)

    for i in range(60):
        ks = rng.choice(200, 8, replace=False).tolist()
        eng.put("t", keys(ks), blocks(8, BB, i))
        eng.read("t", keys(rng.choice(200, 4, replace=False).tolist()))
        if i % 7 == 0:
            eng.delete("t", key(int(rng.integers(200))))
        if i % 5 == 0:
            eng.flush()
        check(eng)
    assert eng.stats()["compactions"] > 0
    eng.close()
    eng = Engine(settings)
    check(eng)
    eng.close(flush=False)


def test_restart_after_reclaiming_serves_every_block_it_kept(tmp_path: Path):
    settings = make_settings({"data_dir": str(tmp_path), "host_capacity": "2MiB",
                              "nvme_capacity": "16MiB", "segment_bytes": "2MiB"})
    eng = Engine(settings)
    eng.create_namespace("t", BB)
    for i in range(40):
        eng.put("t", keys(range(i * 16, i * 16 + 16)), blocks(16, BB, i))
    kept = [i for i in range(640) if eng.entry("t", key(i)) is not None]
    eng.close(flush=False)
    eng = Engine(settings)
    for i in kept:
        found, out = eng.read("t", key(i))
        assert found[0] and (out[0] == blocks(16, BB, i // 16)[i % 16]).all()
    eng.close(flush=False)


class GatedDisk(PosixBackend):
    """Reads wait at a gate: the test decides when a disk read completes (a real read, held
    back so that a rewrite or another get can happen while it is in flight)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.reading = threading.Event()

    def preadv(self, fd, bufs, offset):
        self.reading.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return super().preadv(fd, bufs, offset)


def gated_engine(tmp_path: Path) -> tuple[Engine, GatedDisk]:
    disk = GatedDisk()
    eng = Engine(make_settings({"data_dir": str(tmp_path), "host_capacity": "1MiB",
                                "nvme_capacity": "16MiB", "io_threads": 1}), nvme_backend=disk)
    eng.create_namespace("m", 4096)
    eng.put("m", keys(range(4)), blocks(4, 4096))
    eng.put("m", keys(range(4, 6)), blocks(2, 4096, 5))
    eng.evict(Tier.HOST, 4)
    return eng, disk


def test_a_resident_get_does_not_wait_for_another_clients_disk_read(tmp_path: Path):
    eng, disk = gated_engine(tmp_path)
    resident = [i for i in range(6) if eng.entry("m", key(i))["copies"].get("host")]
    cold = [i for i in range(6) if i not in resident]
    reader = threading.Thread(target=eng.read, args=("m", keys(cold)))
    reader.start()
    assert disk.reading.wait(10)                  # the cold get is inside its disk read
    found, out = eng.read("m", keys(resident))    # answered while that read is held
    assert found.all()
    eng.flush()                                   # and so is a flush
    disk.gate.set()
    reader.join(10)
    eng.close(flush=False)


def test_a_block_rewritten_while_its_read_is_in_flight_is_not_installed(tmp_path: Path):
    eng, disk = gated_engine(tmp_path)
    cold = [i for i in range(6) if not eng.entry("m", key(i))["copies"].get("host")][:1]
    got: list = []
    reader = threading.Thread(target=lambda: got.append(eng.read("m", keys(cold))))
    reader.start()
    assert disk.reading.wait(10)
    new = blocks(1, 4096, 99)
    eng.put("m", keys(cold), new)                 # the rewrite lands mid-read
    disk.gate.set()
    reader.join(10)
    found, out = got[0]
    # The old bytes are read and verified but not installed; the get tries once more and
    # serves the new version, now in the host tier (before: a miss).
    assert found[0] and (out[0] == new[0]).all()
    found, out = eng.read("m", keys(cold))
    assert found[0] and (out[0] == new[0]).all()   # never the old bytes as the new version
    e = eng.entry("m", key(cold[0]))
    assert e["version"] == 2 and e["copies"]["host"]["version"] == 2
    eng.close(flush=False)


def drive_by_hand(eng: Engine, steps, after) -> object:
    """Run a get's steps here, as the server's StepRunner would, calling after(step) once
    each has run; the get's result."""
    value = None
    while True:
        try:
            step = steps.send(value)
        except StopIteration as stop:
            return stop.value
        if step.locked:
            with eng.lock:
                value = step.fn()
        else:
            value = step.fn()
        after(step)


def test_get_steps_driven_by_hand_install_only_the_version_that_was_read(tmp_path: Path):
    # The socket server runs a get's steps itself (the locked ones on its loop, the read on
    # a thread). Here a rewrite lands between the read step and the install step: the old
    # bytes are not installed, the release and a second decide follow, and the new version
    # is served. Steps, in order (locked but the read): room, decide, read, install, release,
    # room, decide.
    eng, disk = gated_engine(tmp_path)
    disk.gate.set()
    cold = [i for i in range(6) if not eng.entry("m", key(i))["copies"].get("host")][:1]
    new = blocks(1, 4096, 99)
    kinds: list[bool] = []

    def after(step) -> None:
        kinds.append(step.locked)
        if not step.locked:
            eng.put("m", keys(cold), new)          # after the read, before its install
    res = drive_by_hand(eng, eng.get_steps("m", keys(cold)), after)
    assert kinds == [True, True, True, True, False, True, True, True, True, True]
    pool = eng.namespace("m").slots[Tier.HOST].pool
    assert res.found[0] and res.versions[0] == 2
    assert (pool.read(res.slots[:1])[0] == new[0]).all()
    eng.release(res.lease_id)
    eng.close(flush=False)


def lru_engine(tmp_path: Path) -> Engine:
    """LRU, 16 host slots, keys 0..31 put in order (16..31 in the host tier, 16 the coldest)."""
    eng = Engine(make_settings({"data_dir": str(tmp_path), "host_capacity": "1MiB",
                                "nvme_capacity": "64MiB", "segment_bytes": "4MiB",
                                "eviction": "lru", "write_policy": "write_through"}))
    eng.create_namespace("t", BB)
    for i in range(32):
        eng.put("t", key(i), blocks(1, BB, i))
    return eng


def test_the_room_step_keeps_the_batchs_own_host_copies(tmp_path: Path):
    # LRU, 16 host slots holding keys 16..31 (16 the coldest), a get of [16, 0..3]: the room
    # step evicts 4 for the bring-ups, never 16, so the decide finds the room made and
    # evicts nothing (before: it evicted 16, and the decide brought it up and evicted again).
    eng = lru_engine(tmp_path)
    assert eng.entry("t", key(16))["copies"].get("host")
    before = eng.stats()["tiers"]["host"]["evictions"]
    steps = eng.get_steps("t", keys([16, 0, 1, 2, 3]))
    room = next(steps)
    with eng.lock:
        room.fn()
    assert eng.entry("t", key(16))["copies"].get("host")          # pinned while room was made
    evicted = eng.stats()["tiers"]["host"]["evictions"]
    assert evicted - before == 4
    decides: list[int] = []

    def after(step) -> None:
        if step.fn.func.__name__ == "_get_decide":
            decides.append(eng.stats()["tiers"]["host"]["evictions"])
    res = drive_by_hand(eng, steps, after)
    assert decides == [evicted]                                   # none in the decide
    assert res.found.all()
    pool = eng.namespace("t").slots[Tier.HOST].pool
    for pos, i in enumerate([16, 0, 1, 2, 3]):
        assert (pool.read(res.slots[pos:pos + 1]) == blocks(1, BB, i)).all()
    eng.release(res.lease_id)
    eng.close(flush=False)


def test_looks_resident_tells_memory_only_gets_from_those_that_need_the_disk(tmp_path: Path):
    eng, _disk = gated_engine(tmp_path)
    resident = [i for i in range(6) if eng.entry("m", key(i))["copies"].get("host")]
    cold = [i for i in range(6) if i not in resident]
    assert eng.looks_resident("m", keys(resident))
    assert eng.looks_resident("m", keys(resident + [100]))     # a miss needs no disk
    assert not eng.looks_resident("m", keys(resident + cold[:1]))
    assert eng.looks_resident("m", key(cold[0]))      # one key: always tried inline
    assert eng.looks_resident("m", b"short")          # bad keys: the locked path says so
    assert eng.looks_resident("nope", keys(cold))     # so does an unknown namespace
    eng.close(flush=False)


def test_try_get_refuses_a_batch_that_needs_the_disk_and_serves_one_with_a_deleted_key(
        tmp_path: Path):
    # try_get's early refusal (one check before the general path) must change nothing when it
    # refuses, and must not refuse a resident batch because one of its keys is gone (a miss).
    eng = lru_engine(tmp_path)
    resident = [i for i in range(32) if eng.entry("t", key(i))["copies"].get("host")]
    cold = [i for i in range(32) if i not in resident]
    assert resident and cold
    ns = eng.namespace("t")
    leases = ns.slots[Tier.HOST].leases.copy()
    before = eng.stats()
    assert eng.try_get("t", keys(resident[:3] + cold[:1])) is None
    assert (ns.slots[Tier.HOST].leases == leases).all()
    after = eng.stats()
    assert (after["gets"], after["tiers"]["host"]["hits"]) == (before["gets"],
                                                              before["tiers"]["host"]["hits"])
    eng.delete("t", key(resident[0]))
    res = eng.try_get("t", keys(resident[:3]))
    assert res is not None and res.found.tolist() == [False, True, True]
    pool = ns.slots[Tier.HOST].pool
    for pos, i in ((1, resident[1]), (2, resident[2])):
        assert (pool.read(res.slots[pos:pos + 1]) == blocks(1, BB, i)).all()
    eng.release(res.lease_id)
    eng.close(flush=False)


def test_admin_eviction_from_nvme_drops_blocks_for_good(tmp_path: Path):
    settings = make_settings({"data_dir": str(tmp_path), "nvme_capacity": "16MiB"})
    eng = Engine(settings)
    eng.create_namespace("m", 4096)
    eng.put("m", keys(range(8)), blocks(8, 4096))
    assert eng.evict(Tier.NVME, 3) == 3
    found, _ = eng.read("m", keys(range(8)))
    assert found.sum() == 5
    eng.close(flush=False)
    eng = Engine(settings)                        # their LMDB records went too
    found, _ = eng.read("m", keys(range(8)))
    assert found.sum() == 5
    eng.close(flush=False)


def test_concurrent_write_through_puts_share_one_flush(tmp_path: Path):
    # Three puts arrive while a flush is in flight (the writer held): the next holder writes
    # all three as one batch (one append, one LMDB transaction), and each put returns only
    # once that batch is durable: after a restart that flushes nothing, all three are there.
    settings = make_settings({"data_dir": str(tmp_path), "nvme_capacity": "16MiB"})
    eng = Engine(settings)
    eng.create_namespace("g", 4096)
    before = eng.stats()["flushes"]
    acked: list[int] = []
    eng.nvme.writer.acquire()
    puts = [threading.Thread(target=lambda i=i: (eng.put("g", keys(range(i * 4, i * 4 + 4)),
                                                         blocks(4, 4096, i)), acked.append(i)))
            for i in range(3)]
    for t in puts:
        t.start()
    for _ in range(1000):                         # until all three have queued their rows
        if eng.nvme.flushes.queued("g") == 3:
            break
        threading.Event().wait(0.01)
    assert acked == []                            # none acknowledged before its flush
    eng.nvme.writer.release()
    for t in puts:
        t.join(30)
    assert sorted(acked) == [0, 1, 2]
    assert eng.stats()["flushes"] - before == 1
    assert all(eng.entry("g", key(i))["state"] == "clean" for i in range(12))
    eng.close(flush=False)
    eng = Engine(settings)
    found, out = eng.read("g", keys(range(12)))
    assert found.all()
    assert all((out[i * 4:i * 4 + 4] == blocks(4, 4096, i)).all() for i in range(3))
    eng.close(flush=False)


class FirstSyncHeld(PosixBackend):
    """The first fdatasync waits at a gate (a slow device flush, made to last); later ones
    run at once and are counted."""

    def __init__(self) -> None:
        self.gate, self.holding, self.second = threading.Event(), threading.Event(), threading.Event()
        self.syncs = 0

    def sync(self, fd: int) -> None:
        self.syncs += 1
        if self.syncs == 1:
            self.holding.set()
            assert self.gate.wait(30), "the test never opened the gate"
        else:
            self.second.set()
        super().sync(fd)


def test_a_put_writes_beside_another_puts_fdatasync_and_returns_after_it(tmp_path: Path):
    """Two write_through puts: the second one's records are written and synced while the
    first one's fdatasync is still in flight (before, the flush writer was held across the
    sync and the second put waited for it, issue 17), yet it is acknowledged only after the
    first is applied (flushes apply in the order they were written), and both survive a
    restart."""
    disk = FirstSyncHeld()
    settings = make_settings({"data_dir": str(tmp_path), "host_capacity": "1MiB",
                              "nvme_capacity": "16MiB", "write_policy": "write_through"})
    eng = Engine(settings, nvme_backend=disk)
    eng.create_namespace("m", 4096)
    first = threading.Thread(target=eng.put, args=("m", keys(range(4)), blocks(4, 4096, 1)))
    first.start()
    assert disk.holding.wait(10)                  # the first put is inside its fdatasync
    second = threading.Thread(target=eng.put,
                              args=("m", keys(range(10, 14)), blocks(4, 4096, 2)))
    second.start()
    assert disk.second.wait(10)                   # the second wrote and synced meanwhile
    second.join(0.2)
    assert first.is_alive() and second.is_alive()  # not acknowledged before the first
    assert eng.entry("m", key(10))["state"] == "dirty"
    disk.gate.set()
    first.join(10)
    second.join(10)
    assert not first.is_alive() and not second.is_alive()
    eng.close(flush=False)
    eng = Engine(settings)
    for ks, seed in ((range(4), 1), (range(10, 14), 2)):
        found, out = eng.read("m", keys(ks))
        assert found.all() and (out == blocks(4, 4096, seed)).all()
    eng.close(flush=False)
