"""Faults with real causes where one can be had: a full file system (a real tmpfs), a data
directory made immutable under a running service, a stalled writer, a slow disk (simulated at
the back-end seam: a disk cannot be slowed on demand here), and the security rules."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import kvtier
from kvtier.api.server import Server
from kvtier.coherence.engine import Engine
from kvtier.config import make_settings
from kvtier.errors import DataDirError, LeaseError, StorageError
from kvtier.tiers.nvme import PosixBackend
from kvtier.types import Tier
from tests.conftest import blocks, key, keys
from tests.service import Service

BB = 4096


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.getuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs",
                                           str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(eng: Engine, data: np.ndarray) -> tuple[list[int], int]:
    """Put 64-block batches; returns (first keys of the acknowledged batches, failures)."""
    acked, failed = [], 0
    for lo in range(0, len(data), 64):
        try:
            eng.put("m", keys(range(lo, lo + 64)), data[lo:lo + 64])
            acked.append(lo)
        except StorageError:
            failed += 1
    return acked, failed


def test_a_disk_full_write_through_put_is_refused_or_durable(small_tmpfs: Path):
    settings = make_settings({"data_dir": str(small_tmpfs / "data"), "host_capacity": "8MiB",
                              "nvme_capacity": "64MiB", "segment_bytes": "1MiB"})
    eng = Engine(settings)
    eng.create_namespace("m", BB)
    data = blocks(1024, BB)
    acked, failed = _fill(eng, data)              # 4 MiB of blocks into a 3 MiB file system
    assert eng.stats()["nvme_full"] > 0           # the disk filled up under nvme_capacity ...
    assert failed == 0                            # ... and the tier shrank to it, reclaiming
    with pytest.raises(StorageError):             # a batch larger than the disk is refused
        eng.put("m", keys(range(2000, 2000 + 768)), blocks(768, BB, 7))
    kept = [i for i in range(1024) if eng.entry("m", key(i)) is not None]
    assert kept
    eng.close(flush=False)                        # as a crash would: nothing more is written
    eng = Engine(settings)
    for i in kept:                                # every acknowledged block it kept is on disk
        found, out = eng.read("m", key(i))
        assert found[0] and (out[0] == data[i]).all()
    eng.close(flush=False)


def test_a_disk_full_write_back_flush_is_not_answered_ok(small_tmpfs: Path):
    eng = Engine(make_settings({"data_dir": str(small_tmpfs / "data"), "host_capacity": "8MiB",
                                "nvme_capacity": "64MiB", "segment_bytes": "1MiB",
                                "write_policy": "write_back"}))
    eng.create_namespace("m", BB)
    data = blocks(1024, BB)
    acked, failed = _fill(eng, data)
    assert failed == 0                            # write_back: the host tier takes them
    with pytest.raises(StorageError, match="free space|full"):
        eng.flush()                               # not "ok" while blocks stay dirty
    dirty = sum(eng.entry("m", key(i))["dirty"] for i in range(1024))
    assert dirty > 0
    found, out = eng.read("m", keys(range(960, 1024)))
    assert found.all() and (out == data[960:]).all()   # and they are still served
    eng.close(flush=False)


def test_immutable_segment_directory_under_a_running_service(tmp_path: Path):
    svc = Service(tmp_path / "svc", segment_bytes="1MiB", host_capacity="16MiB").start()
    nsdir = None
    try:
        with kvtier.Client(svc.socket) as c:
            ns = c.namespace("m", block_bytes=BB)
            ns.put(keys(range(16)), blocks(16, BB))
            nsdir = next((svc.data_dir / "nvme").glob("ns-*"))
            if subprocess.run(["chattr", "+i", str(nsdir)], capture_output=True).returncode:
                pytest.skip("chattr +i is not supported here")
            # 1 MiB segments hold 255 records: these puts need a new segment file, which the
            # immutable directory refuses. Under write_through they fail, saying why; what
            # they wrote stays dirty in the host tier.
            failed = 0
            for lo in range(16, 528, 64):
                try:
                    ns.put(keys(range(lo, lo + 64)), blocks(64, BB, lo))
                except StorageError as exc:
                    assert "cannot create segment" in str(exc)
                    failed += 1
            s = c.stats()
            assert s["nvme_full"] > 0 and failed > 0
            subprocess.run(["chattr", "-i", str(nsdir)], check=True)
            nsdir = None
            assert c.flush() > 0                          # writable again: the backlog drains
            assert c.stats()["tiers"]["nvme"]["blocks"] == 528
    finally:
        if nsdir is not None:
            subprocess.run(["chattr", "-i", str(nsdir)], check=False)
        svc.stop()


def test_a_stalled_writer_loses_its_reservation(tmp_path: Path):
    svc = Service(tmp_path / "svc", reserve_timeout=0.3).start()
    try:
        with kvtier.Client(svc.socket) as c:
            c.namespace("m", block_bytes=BB)
            free = c.stats()["tiers"]["host"]["used_bytes"]
            r = c._call("reserve", ns="m", keys=keys(range(8)))
            deadline = time.monotonic() + 10
            while c.stats()["expired_reservations"] == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert c.stats()["expired_reservations"] == 1
            assert c.stats()["tiers"]["host"]["used_bytes"] == free     # slots reclaimed
            with pytest.raises(LeaseError, match="reserve again"):
                c._call("commit", rid=r["rid"])
    finally:
        svc.stop()


class SlowDisk(PosixBackend):
    """A disk that takes `delay` seconds per read. A mock, because a real disk cannot be slowed
    on demand here (dm-delay needs device-mapper, which the CI machine does not have)."""

    name = "slow"

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.reading = threading.Event()

    def preadv(self, fd, bufs, offset):
        self.reading.set()
        time.sleep(self.delay)
        return super().preadv(fd, bufs, offset)


def test_a_slow_disk_shows_in_latency_and_does_not_block_the_loop(tmp_path: Path):
    disk = SlowDisk(delay=1.5)
    settings = make_settings({"data_dir": str(tmp_path / "d"), "host_capacity": "1MiB",
                              "nvme_capacity": "16MiB", "admin": ""})
    eng = Engine(settings, nvme_backend=disk)
    eng.create_namespace("m", BB)
    eng.put("m", keys(range(4)), blocks(4, BB))
    eng.evict(Tier.HOST, 4)                        # the next get must read the slow disk
    loop = asyncio.new_event_loop()
    server = Server(eng, settings)
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    ready.wait(10)
    order: list[str] = []
    try:
        slow = kvtier.Client(settings.socket_path, name="slow-reader")
        fast = kvtier.Client(settings.socket_path, name="other")
        ns = slow.namespace("m")

        def read() -> None:
            ns.get(keys(range(4)))
            order.append("slow get")

        reader = threading.Thread(target=read)
        reader.start()
        assert disk.reading.wait(10)
        fast.ping()                                # answered while the disk read is in flight
        order.append("hello")
        reader.join()
        assert order == ["hello", "slow get"]
        by_name = {c.name: c.summary() for c in server.clients.values()}
        # The latency figures single out the worker that waited on the disk (a comparison of
        # two measurements, not an absolute timing).
        assert by_name["slow-reader"]["p99_ms"] > by_name["other"]["p99_ms"]
        slow.close()
        fast.close()
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        loop.run_until_complete(asyncio.sleep(0.1))    # let closed transports finish closing
        loop.close()


# ---------------------------------------------------------------------- security

def test_links_out_of_the_data_directory_are_refused(tmp_path: Path):
    data = tmp_path / "data"
    eng = Engine(make_settings({"data_dir": str(data), "nvme_capacity": "16MiB"}))
    eng.create_namespace("m", BB)
    eng.put("m", key(1), blocks(1, BB))
    eng.close(flush=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    nsdir = next((data / "nvme").glob("ns-*"))
    nsdir.rename(elsewhere / "ns")
    nsdir.symlink_to(elsewhere / "ns")
    with pytest.raises(DataDirError, match="symbolic link"):
        Engine(make_settings({"data_dir": str(data), "nvme_capacity": "16MiB"}))
    nsdir.unlink()
    (elsewhere / "ns").rename(nsdir)
    seg = next(nsdir.glob("seg-*.kvt"))
    seg.rename(elsewhere / "seg")
    seg.symlink_to(elsewhere / "seg")
    with pytest.raises(DataDirError, match="cannot open segment"):
        Engine(make_settings({"data_dir": str(data), "nvme_capacity": "16MiB"}))


def test_a_client_sees_only_its_namespace_memory(service):
    with kvtier.Client(service.socket) as c:
        a = c.namespace("a", block_bytes=BB)
        b = c.namespace("b", block_bytes=2 * BB)
        b.put(keys([1]), np.full((1, 2 * BB), 0xAB, np.uint8))
        a.put(keys([1]), np.full((1, BB), 0x11, np.uint8))
        view_a = a._view()
        assert not (view_a == 0xAB).any()                 # b's bytes are not in a's mapping
        lease_b = c._call("get", ns="b", keys=keys([1]))
        slot_b = np.frombuffer(lease_b["slots"], "<i4")
        lease_a = c._call("get", ns="a", keys=keys([1]))
        with pytest.raises(LeaseError):                   # a's lease does not hold b's slot
            c._call("release", lease=lease_a["lease"],
                    slots=np.array([slot_b[0] + 7], "<i4").tobytes())
        c._call("release", lease=lease_a["lease"])
        c._call("release", lease=lease_b["lease"])
