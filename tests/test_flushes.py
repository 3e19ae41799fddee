"""The flush pipeline's begun flushes (coherence.flushes.Flushes.begin, Puts.commit_begin):
a write_through put whose flush runs on the store's flush thread is acknowledged (its handle
completes) only once its records are synced and applied; meanwhile its rows stay DIRTY and
pinned, readers get the committed bytes from memory, and nothing that settles the pipeline
(an eviction, a record delete, a checkpoint, close) deadlocks with it (issue 17)."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest

from kvtier.coherence.engine import Engine
from kvtier.config import make_settings
from kvtier.errors import StorageError
from kvtier.tiers.nvme import PosixBackend
from kvtier.types import Tier
from tests.conftest import blocks, key, keys

BB = 4096


class HeldSyncs(PosixBackend):
    """Every fdatasync, once armed, waits at a gate; the order of events is recorded. fail:
    the held syncs then raise EIO instead of syncing."""

    def __init__(self) -> None:
        self.armed, self.fail = False, False
        self.gate, self.holding = threading.Event(), threading.Event()
        self.events: list[str] = []

    def sync(self, fd: int) -> None:
        if self.armed:
            self.events.append("sync-held")
            self.holding.set()
            assert self.gate.wait(30), "the test never opened the gate"
            if self.fail:
                raise OSError(errno.EIO, "injected fdatasync failure")
        super().sync(fd)
        if self.armed:
            self.events.append("sync-done")


def engine(tmp_path: Path, disk: PosixBackend | None = None, **over: str) -> Engine:
    conf = {"data_dir": str(tmp_path), "host_capacity": "1MiB", "nvme_capacity": "16MiB",
            "write_policy": "write_through", **over}
    eng = Engine(make_settings(conf), nvme_backend=disk) if disk else Engine(make_settings(conf))
    if "m" not in eng.namespaces:
        eng.create_namespace("m", BB)
    return eng


def begin_put(eng: Engine, ks: range, seed: int):
    res = eng.reserve("m", keys(ks))
    eng.namespace("m").slots[Tier.HOST].pool.write(res.slots, blocks(len(ks), BB, seed))
    return eng.puts.commit_begin(res.rid)


def host_leases(eng: Engine, k: bytes) -> int:
    ns = eng.namespace("m")
    row = ns.table.lookup(ns.table.keys_array(k))[0]
    return int(ns.slots[Tier.HOST].leases[ns.table.cols["slot"][row, Tier.HOST]])


def test_a_begun_puts_handle_completes_only_after_its_fdatasync(tmp_path: Path):
    disk = HeldSyncs()
    eng = engine(tmp_path, disk)
    disk.armed = True
    versions, handle = begin_put(eng, range(4), 1)
    assert (versions == 1).all()
    assert disk.holding.wait(10)                  # the flush thread is inside the fdatasync
    assert not handle.done()                      # not acknowledged before its sync
    found, out = eng.read("m", keys(range(4)))    # the committed bytes, from memory
    assert found.all() and (out == blocks(4, BB, 1)).all()
    assert eng.entry("m", key(0))["state"] == "dirty"
    assert host_leases(eng, key(0)) >= 1          # pinned until the handle completes
    disk.gate.set()
    assert handle.wait(10) == 4
    disk.events.append("acknowledged")
    assert disk.events == ["sync-held", "sync-done", "acknowledged"]
    assert eng.entry("m", key(0))["state"] == "clean"
    assert host_leases(eng, key(0)) == 0
    eng.close(flush=False)
    eng = engine(tmp_path)                        # what was acknowledged survives a restart
    found, out = eng.read("m", keys(range(4)))
    assert found.all() and (out == blocks(4, BB, 1)).all()
    eng.close(flush=False)


def test_a_begun_puts_failed_fdatasync_fails_its_handle_and_leaves_it_dirty(tmp_path: Path):
    disk = HeldSyncs()
    eng = engine(tmp_path, disk)
    disk.armed, disk.fail = True, True
    disk.gate.set()
    _, handle = begin_put(eng, range(4), 1)
    with pytest.raises(StorageError, match="fdatasync"):
        handle.wait(10)
    assert eng.entry("m", key(0))["state"] == "dirty"     # never reported durable
    assert host_leases(eng, key(0)) == 0
    disk.armed = False
    assert eng.flush("m") == 4                              # written by the next flush
    assert eng.entry("m", key(0))["state"] == "clean"
    eng.close(flush=False)


def test_a_rewrite_while_the_first_put_syncs_is_served_and_both_apply_in_order(
        tmp_path: Path):
    disk = HeldSyncs()
    eng = engine(tmp_path, disk)
    disk.armed = True
    _, first = begin_put(eng, range(4), 1)
    assert disk.holding.wait(10)
    versions, second = begin_put(eng, range(4), 2)         # the same keys, a new version
    assert (versions == 2).all()
    found, out = eng.read("m", keys(range(4)))
    assert found.all() and (out == blocks(4, BB, 2)).all()  # never the older bytes
    disk.gate.set()
    first.wait(10)
    second.wait(10)
    assert eng.entry("m", key(0))["version"] == 2
    assert eng.entry("m", key(0))["state"] == "clean"
    eng.close(flush=False)
    eng = engine(tmp_path)
    found, out = eng.read("m", keys(range(4)))
    assert found.all() and (out == blocks(4, BB, 2)).all()
    eng.close(flush=False)


def test_a_begun_puts_copies_stay_pinned_until_its_flush_picks_them(tmp_path: Path):
    """Between the commit and the flush thread's pick the rows are DIRTY and unwritten: an
    eviction then (the next get's room) must pass them over, not write them down itself."""
    eng = engine(tmp_path, host_capacity=f"{16 * BB}")
    eng.put("m", keys(range(100, 108)), blocks(8, BB, 9))   # clean blocks to evict
    with eng.nvme.writer:                         # the flush thread waits here, before its pick
        _, handle = begin_put(eng, range(4), 1)
        assert host_leases(eng, key(0)) == 1      # the reservation's pin, kept
        assert eng.evict(Tier.HOST, 16, "m") == 8
        assert not eng.nvme.wanted()              # no write-down asked for
        assert not handle.done()
    assert handle.wait(10) == 4
    assert host_leases(eng, key(0)) == 0
    assert eng.entry("m", key(0))["state"] == "clean"
    eng.close(flush=False)


def test_a_begun_put_with_a_repeated_key_pins_the_last_write_and_frees_the_first(
        tmp_path: Path):
    eng = engine(tmp_path)
    ns = eng.namespace("m")
    free = ns.slots[Tier.HOST].pool.free_count
    data = blocks(3, BB, 5)
    with eng.nvme.writer:                         # the flush thread waits before its pick
        res = eng.reserve("m", keys([0, 1, 0]))
        ns.slots[Tier.HOST].pool.write(res.slots, data)
        _, handle = eng.puts.commit_begin(res.rid)
        assert host_leases(eng, key(0)) == 1 and host_leases(eng, key(1)) == 1
        leases = ns.slots[Tier.HOST].leases
        assert leases[res.slots[0]] == 0                        # the repeat: unpinned...
        assert ns.slots[Tier.HOST].pool.free_count == free - 2  # ...and freed
    assert handle.wait(10) == 2
    assert host_leases(eng, key(0)) == 0
    found, out = eng.read("m", key(0))
    assert found.all() and (out[0] == data[2]).all()           # the last write of the key
    eng.close(flush=False)


def test_evictions_deletes_and_close_beside_a_begun_put_do_not_deadlock(tmp_path: Path):
    disk = HeldSyncs()
    eng = engine(tmp_path, disk, host_capacity=f"{16 * BB}")
    eng.put("m", keys(range(100, 108)), blocks(8, BB, 9))   # clean blocks to evict
    disk.armed = True
    _, handle = begin_put(eng, range(4), 1)
    assert disk.holding.wait(10)
    # An eviction passes the pinned DIRTY copies over and asks for no write-down.
    assert eng.evict(Tier.HOST, 16, "m") == 8
    assert not eng.nvme.wanted()
    assert eng.entry("m", key(0))["state"] == "dirty"
    # A record delete settles the pipeline: it waits for the held sync, then goes on.
    deleter = threading.Thread(target=eng.delete, args=("m", keys(range(100, 102))))
    deleter.start()
    deleter.join(0.3)
    assert deleter.is_alive() and not handle.done()
    disk.gate.set()
    deleter.join(10)
    assert not deleter.is_alive()
    assert handle.wait(10) == 4
    disk.gate.clear()
    disk.holding.clear()
    _, pending = begin_put(eng, range(10, 14), 3)
    assert disk.holding.wait(10)
    closer = threading.Thread(target=eng.close, kwargs={"flush": False})
    closer.start()                                # close runs the begun flush to its end
    closer.join(0.3)
    assert closer.is_alive()
    disk.gate.set()
    closer.join(10)
    assert not closer.is_alive() and pending.wait(0) == 4
    eng = engine(tmp_path)
    found, out = eng.read("m", keys(range(10, 14)))
    assert found.all() and (out == blocks(4, BB, 3)).all()
    found, _ = eng.read("m", keys(range(100, 102)))
    assert not found.any()
    eng.close(flush=False)


def test_a_write_back_commit_begin_is_acknowledged_at_once(tmp_path: Path):
    eng = engine(tmp_path, write_policy="write_back")
    versions, handle = begin_put(eng, range(4), 1)
    assert handle.done() and handle.wait(0) == 0 and (versions == 1).all()
    assert eng.entry("m", key(0))["state"] == "dirty"
    assert host_leases(eng, key(0)) == 0
    eng.close(flush=False)


def test_a_handle_waited_past_its_timeout_says_so(tmp_path: Path):
    disk = HeldSyncs()
    eng = engine(tmp_path, disk)
    disk.armed = True
    _, handle = begin_put(eng, range(4), 1)
    assert disk.holding.wait(10)
    with pytest.raises(TimeoutError):
        handle.wait(0.05)
    disk.gate.set()
    assert handle.wait(10) == 4
    eng.close(flush=False)


def test_a_flush_thread_that_failed_to_start_is_started_by_the_next_begin(tmp_path: Path,
                                                                         monkeypatch):
    # begin() kept the Thread object before its start(): once start() failed (no thread to
    # be had), every later begin queued its flush for a thread that never ran, and its
    # handle never completed (the put never acknowledged, close() raised on the join).
    eng = engine(tmp_path)
    real = threading.Thread.start
    fails = [RuntimeError("can't start new thread")]

    def start(self):
        if fails:
            raise fails.pop()
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(RuntimeError, match="start new thread"):
        begin_put(eng, range(4), 1)
    assert host_leases(eng, key(0)) == 0          # the failed commit_begin unpinned
    _, handle = begin_put(eng, range(4, 8), 2)
    assert handle.wait(10) == 4
    eng.close(flush=False)


@pytest.mark.parametrize("ks", [range(4), [0, 1, 0, 2]], ids=["distinct", "repeated"])
def test_a_commit_begin_whose_install_raises_leaves_no_slot_pinned(tmp_path: Path, monkeypatch,
                                                                    ks):
    # _commit(keep_pinned) kept the reservation's pins for the handle to drop; when install
    # raised there was no handle, and the slots stayed pinned for ever (rev5's review).
    eng = engine(tmp_path)
    res = eng.reserve("m", keys(ks))
    eng.namespace("m").slots[Tier.HOST].pool.write(res.slots, blocks(len(ks), BB, 1))

    def install(*args, **kw):
        raise MemoryError("injected: the page table cannot grow")

    monkeypatch.setattr(eng, "install", install)
    with pytest.raises(MemoryError, match="injected"):
        eng.puts.commit_begin(res.rid)
    assert (eng.namespace("m").slots[Tier.HOST].leases[res.slots] == 0).all()
    monkeypatch.undo()
    _, handle = begin_put(eng, range(10, 14), 2)  # the engine goes on
    assert handle.wait(10) == 4
    eng.close(flush=False)


@pytest.mark.parametrize("begin", [False, True], ids=["commit", "commit_begin"])
@pytest.mark.parametrize("ks", [range(4), [0, 1, 0, 2]], ids=["distinct", "repeated"])
def test_an_install_that_raises_gives_its_reserved_slots_back(tmp_path: Path, monkeypatch,
                                                               ks, begin):
    # Injected: every block state has a COMMIT move, so only an allocation failure (the page
    # table's insert out of memory) makes the install raise. Before rev8 the reserved slots
    # were neither installed nor freed: the pool lost them until a restart.
    eng = engine(tmp_path)
    st = eng.namespace("m").slots[Tier.HOST]
    free = st.pool.free_count
    table = eng.namespace("m").table

    def commit_failing_in(name: str, rid: int) -> None:
        def fails(*args, **kw):
            raise MemoryError(f"injected: no memory in {name}")
        with monkeypatch.context() as m:
            m.setattr(table, name, fails)
            with pytest.raises(MemoryError, match="injected"):
                eng.puts.commit_begin(rid) if begin else eng.commit(rid)

    res = eng.reserve("m", keys(ks))
    st.pool.write(res.slots, blocks(len(ks), BB, 1))
    commit_failing_in("insert_counted", res.rid)
    assert not st.leases.any() and st.pool.free_count == free
    # A failure after the copies were placed (the parents' links) frees none of them: the
    # rows serve their blocks.
    res = eng.reserve("m", keys(ks), parents=keys(range(100, 100 + len(ks))))
    data = blocks(len(ks), BB, 2)
    st.pool.write(res.slots, data)
    commit_failing_in("link_keys", res.rid)
    assert not st.leases.any()
    distinct = len(set(ks))
    assert st.pool.free_count == free - distinct
    last = {k: data[i] for i, k in enumerate(ks)}
    found, got = eng.read("m", keys(list(last)))
    assert found.all() and got.tobytes() == b"".join(d.tobytes() for d in last.values())
    eng.close(flush=False)
