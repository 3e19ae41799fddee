"""Engine scenarios: coherence rules step by step, damage on disk, bad input, restart."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvtier.coherence import fastpath
from kvtier.coherence.engine import Engine
from kvtier.config import make_settings
from kvtier.errors import (BadRequest, CapacityError, ChecksumError, DataDirError, LeaseError,
                           NamespaceError)
from kvtier.types import Tier
from tests.conftest import blocks, key, keys

BB = 4096


def _entry(eng: Engine, k: bytes) -> dict:
    e = eng.entry("m", k)
    assert e is not None
    return e


def test_gpu_write_is_exclusive_dirty_written_through_to_host_and_stales_nvme(make_engine):
    eng = make_engine(hbm=True, write_policy="write_back")
    eng.create_namespace("m", BB)
    eng.put("m", key(1), blocks(1, BB, 1))
    eng.flush()
    e = _entry(eng, key(1))
    assert e["state"] == "clean" and e["copies"]["nvme"]["version"] == 1
    eng.put("m", key(1), blocks(1, BB, 2), tier=Tier.HBM)
    e = _entry(eng, key(1))
    assert e["version"] == 2 and e["dirty"]
    assert e["copies"]["hbm"] == {"version": 2, "current": 1, "slot": e["copies"]["hbm"]["slot"]}
    assert e["copies"]["host"]["version"] == 2            # written through to host
    assert e["copies"]["nvme"]["current"] == 0            # the NVMe copy is now stale
    found, out = eng.read("m", key(1))
    assert found[0] and (out[0] == blocks(1, BB, 2)[0]).all()


def test_read_is_served_from_nvme_with_copy_on_read(make_engine):
    eng = make_engine()
    eng.create_namespace("m", BB)
    eng.put("m", key(1), blocks(1, BB))
    eng.evict(Tier.HOST, 1)
    assert "host" not in _entry(eng, key(1))["copies"]
    found, out = eng.read("m", key(1))
    assert found[0] and (out[0] == blocks(1, BB)[0]).all()
    assert _entry(eng, key(1))["copies"]["host"]["current"] == 1     # copy-on-read installed it
    assert eng.counters.tiers[Tier.HOST].promotions == 1


def test_flush_goes_in_version_order_and_clears_dirty_only_after_lmdb(make_engine):
    eng = make_engine(write_policy="write_back")
    eng.create_namespace("m", BB)
    eng.put("m", key(2), blocks(1, BB, 0))
    eng.put("m", key(1), blocks(1, BB, 1))
    eng.put("m", key(2), blocks(1, BB, 2))        # key 2 is now at version 2
    assert eng.flush() == 2
    e1, e2 = _entry(eng, key(1)), _entry(eng, key(2))
    # key 1 (version 1) was appended before key 2 (version 2): log order follows versions.
    assert e1["copies"]["nvme"]["offset"] < e2["copies"]["nvme"]["offset"]
    assert not e1["dirty"] and not e2["dirty"]
    # Durable in the segment's batch header; LMDB gets the records at the next checkpoint.
    assert eng.nvme.journal.waiting == 2
    with eng.nvme.writer:
        eng.nvme.checkpoint()
    assert eng.catalog.count(eng.namespace("m").ns_id) == 2


def test_eviction_never_drops_a_dirty_sole_copy(make_engine):
    eng = make_engine(write_policy="write_back", host_capacity=4 * BB)
    eng.create_namespace("m", BB)
    eng.put("m", keys(range(4)), blocks(4, BB))
    assert all(_entry(eng, key(i))["dirty"] for i in range(4))
    eng.put("m", keys(range(4, 6)), blocks(2, BB, 9))      # forces two evictions
    for i in range(4):
        found, out = eng.read("m", key(i))
        assert found[0] and (out[0] == blocks(4, BB)[i]).all()


def test_leased_slot_is_never_overwritten_by_a_new_version(make_engine):
    eng = make_engine()
    eng.create_namespace("m", BB)
    eng.put("m", key(1), blocks(1, BB, 1))
    res = eng.get("m", key(1))
    pool = eng.namespace("m").slots[Tier.HOST].pool
    slot = int(res.slots[0])
    before = pool.array[slot].copy()
    for seed in range(2, 20):                       # many rewrites, small host tier
        eng.put("m", key(1), blocks(1, BB, seed))
    assert (pool.array[slot] == before).all()
    assert int(eng.get("m", key(1)).slots[0]) != slot
    eng.release(res.lease_id)
    with pytest.raises(LeaseError):
        eng.release(res.lease_id)                   # a double release is a typed error


def test_lease_ends_with_its_owner(make_engine):
    eng = make_engine()
    eng.create_namespace("m", BB)
    eng.put("m", keys(range(3)), blocks(3, BB))
    eng.get("m", keys(range(3)), owner=7)
    eng.reserve("m", key(9), owner=7)
    assert eng.release_owner(7) == 2
    assert not eng.leases and not eng.reservations
    st = eng.namespace("m").slots[Tier.HOST]
    assert st.leases.sum() == 0


def test_stalled_reservation_expires_and_its_commit_is_refused(make_engine):
    eng = make_engine(reserve_timeout=0.0)
    eng.create_namespace("m", BB)
    res = eng.reserve("m", key(1))
    assert eng.reap() == 1
    with pytest.raises(LeaseError, match="reserve again"):
        eng.commit(res.rid)
    assert eng.namespace("m").slots[Tier.HOST].pool.free_count == 16


def test_torn_write_detected_by_checksum_is_not_committed(make_engine):
    eng = make_engine()
    eng.create_namespace("m", BB)
    res = eng.reserve("m", key(1))
    eng.namespace("m").slots[Tier.HOST].pool.write(res.slots, blocks(1, BB))
    with pytest.raises(ChecksumError):
        eng.commit(res.rid, checksums=np.array([12345], dtype=np.uint64))
    assert eng.entry("m", key(1)) is None and not eng.reservations


def test_bit_flip_in_a_segment_is_detected_dropped_and_counted(make_engine, tmp_path: Path):
    eng = make_engine()
    eng.create_namespace("m", BB)
    eng.put("m", keys(range(3)), blocks(3, BB))
    e = _entry(eng, key(1))
    eng.close(flush=False)
    seg = next((tmp_path / "data" / "nvme").glob("ns-*/seg-*.kvt"))
    with open(seg, "r+b") as fh:
        fh.seek(e["copies"]["nvme"]["offset"] + 100)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0x10]))
    eng = make_engine()
    found, out = eng.read("m", keys(range(3)))
    assert found.tolist() == [True, False, True]
    assert eng.counters.checksum_failures == 1
    assert eng.entry("m", key(1)) is None                 # dropped, never served
    assert eng.catalog.count(eng.namespace("m").ns_id) == 2
    assert (out[0] == blocks(3, BB)[0]).all() and (out[2] == blocks(3, BB)[2]).all()


def test_truncated_segment_drops_records_past_the_end_at_restart(make_engine, tmp_path: Path):
    eng = make_engine()
    eng.create_namespace("m", BB)
    eng.put("m", keys(range(4)), blocks(4, BB))
    eng.close(flush=False)
    seg = next((tmp_path / "data" / "nvme").glob("ns-*/seg-*.kvt"))
    os.truncate(seg, 4096 + (1 + 2) * BB)        # the batch header's slot and two records
    eng = make_engine()
    assert eng.counters.records_dropped == 2
    found, _ = eng.read("m", keys(range(4)))
    assert found.tolist() == [True, True, False, False]


def test_restart_serves_every_flushed_version(make_engine):
    eng = make_engine(write_policy="write_back")
    eng.create_namespace("m", BB, layout={"dtype": "float16"})
    eng.put("m", keys(range(5)), blocks(5, BB, 1))
    eng.flush()
    eng.put("m", keys(range(2)), blocks(2, BB, 2))     # rewritten, not flushed
    eng.close(flush=False)
    eng = make_engine(write_policy="write_back")
    assert eng.namespace("m").layout == {"dtype": "float16"}
    found, out = eng.read("m", keys(range(5)))
    assert found.all() and (out == blocks(5, BB, 1)).all()
    assert [_entry(eng, key(i))["version"] for i in range(5)] == [1] * 5


def test_versions_keep_rising_after_a_delete_an_eviction_and_a_restart(make_engine):
    # A version number once given out never names another block: a key deleted, or evicted
    # from every tier, and put again goes on above its last version, and so does a key first
    # put after a restart (even one that no tier kept: the host-only tier below).
    eng = make_engine(nvme_capacity=0, host_capacity=4 * BB)
    eng.create_namespace("m", BB)
    assert eng.put("m", key(1), blocks(1, BB, 1)).tolist() == [1]
    assert eng.put("m", key(1), blocks(1, BB, 2)).tolist() == [2]
    eng.delete("m", key(1))
    assert eng.put("m", key(1), blocks(1, BB, 3)).tolist() == [3]
    eng.put("m", keys(range(2, 6)), blocks(4, BB, 4))          # key 1 evicted from every tier
    assert eng.entry("m", key(1)) is None
    v = int(eng.put("m", key(1), blocks(1, BB, 5))[0])
    assert v > 3
    eng.close(flush=False)
    eng = make_engine(nvme_capacity=0, host_capacity=4 * BB)   # nothing kept across it
    after = int(eng.put("m", key(1), blocks(1, BB, 6))[0])
    assert after > v
    found, out = eng.read("m", key(1))
    assert found[0] and (out[0] == blocks(1, BB, 6)[0]).all()
    eng.close(flush=False)
    eng = make_engine(nvme_capacity=0, host_capacity=4 * BB)
    assert int(eng.put("m", key(1), blocks(1, BB, 7))[0]) > after


def test_a_version_lost_unflushed_in_a_crash_is_not_given_out_again(make_engine):
    eng = make_engine(write_policy="write_back")
    eng.create_namespace("m", BB)
    eng.put("m", key(1), blocks(1, BB, 1))
    eng.flush()
    assert eng.put("m", key(1), blocks(1, BB, 2)).tolist() == [2]      # never flushed
    eng.close(flush=False)                                             # as a crash would
    eng = make_engine(write_policy="write_back")
    assert _entry(eng, key(1))["version"] == 1                         # the flushed one
    assert int(eng.put("m", key(1), blocks(1, BB, 3))[0]) > 2


def test_parent_links_survive_restart(make_engine):
    eng = make_engine()
    eng.create_namespace("m", BB)
    parents = bytes(16) + keys(range(0, 3))
    eng.put("m", keys(range(4)), blocks(4, BB), parents=parents)
    assert _entry(eng, key(0))["children"] == [key(1).hex()]
    eng.close(flush=False)
    eng = make_engine()
    assert _entry(eng, key(2))["parent"] == key(1).hex()
    assert _entry(eng, key(2))["children"] == [key(3).hex()]


def test_match_prefix_counts_only_the_leading_run(make_engine):
    eng = make_engine()
    eng.create_namespace("m", BB)
    eng.put("m", keys([0, 1, 3]), blocks(3, BB))
    assert eng.match_prefix("m", keys(range(5))) == 2
    assert eng.match_prefix("m", keys([5, 0])) == 0
    eng.delete("m", key(0))
    assert eng.match_prefix("m", keys(range(5))) == 0


def test_delete_removes_the_lmdb_record_too(make_engine):
    eng = make_engine()
    eng.create_namespace("m", BB)
    eng.put("m", keys(range(2)), blocks(2, BB))
    assert eng.delete("m", keys([0, 0, 7])) == 1
    eng.close(flush=False)
    eng = make_engine()
    found, _ = eng.read("m", keys(range(2)))
    assert found.tolist() == [False, True]


def test_compaction_reclaims_segments_of_rewritten_blocks(make_engine):
    eng = make_engine(host_capacity=64 * BB, compact_threshold=0.5)
    eng.create_namespace("m", BB)
    for seed in range(4):                               # 4 x 200 records of 4 KiB: 4 segments
        for lo in range(0, 200, 50):
            eng.put("m", keys(range(lo, lo + 50)), blocks(50, BB, seed * 10 + lo))
    assert eng.counters.compactions > 0
    log = eng.namespace("m").log
    assert log.total_bytes() < 4 * 200 * BB
    eng.evict(Tier.HOST, 64)
    found, out = eng.read("m", keys(range(0, 50)))
    assert found.all() and (out == blocks(50, BB, 30)).all()


def test_nvme_full_keeps_puts_in_the_upper_tiers(make_engine):
    # Nine segments of a ninth of the capacity: its start, a batch header and seven records
    # (segments of one record, as here before batch headers, cannot be compacted: moving a
    # record forward costs a header slot too).
    eng = make_engine(host_capacity=32 * BB, nvme_capacity=81 * BB, segment_bytes="1MiB")
    eng.create_namespace("m", BB)
    for lo in range(0, 120, 4):
        eng.put("m", keys(range(lo, lo + 4)), blocks(4, BB, lo))
    assert eng.counters.nvme_full > 0 or eng.counters.tiers[Tier.NVME].evictions > 0
    found, _ = eng.read("m", keys(range(116, 120)))
    assert found.all()


def test_map_full_grows_the_lmdb_map(tmp_path: Path):
    from kvtier.pagetable.store import Catalog, record_dtype
    cat = Catalog(tmp_path / "meta", map_size=64 * 1024)
    ns = cat.add_namespace("m", BB, 16, {})
    k = np.frombuffer(keys(range(5000)), dtype="V16")
    cat.put_records(ns.ns_id, k, np.zeros(5000, dtype=record_dtype(16)))
    assert cat.map_grows > 0 and cat.count(ns.ns_id) == 5000
    cat.close()


# ---------------------------------------------------------------------- bad input

def test_wrong_block_size_unknown_key_and_unknown_namespace(make_engine):
    eng = make_engine()
    eng.create_namespace("m", BB)
    with pytest.raises(BadRequest, match="4096"):
        eng.put("m", key(1), [b"short"])
    found, _ = eng.read("m", key(99))
    assert not found[0]                                    # an unknown key is a miss
    with pytest.raises(NamespaceError, match="create it first"):
        eng.get("nope", key(1))
    with pytest.raises(NamespaceError, match="exists with block_bytes"):
        eng.create_namespace("m", 2 * BB)
    with pytest.raises(BadRequest):
        eng.create_namespace("x", 0)
    with pytest.raises(NamespaceError):
        eng.create_namespace("", BB)
    with pytest.raises(BadRequest, match="all-zero key is reserved"):
        eng.put("m", bytes(16), blocks(1, BB))
    with pytest.raises(BadRequest, match="empty key batch"):
        eng.get("m", b"")
    with pytest.raises(CapacityError, match="smaller batches"):
        eng.reserve("m", keys(range(17)))


def test_missing_or_unwritable_data_dir_is_a_clear_error(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DataDirError, match="cannot create data_dir"):
        Engine(make_settings({"data_dir": str(blocker / "sub")}))
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.getuid() != 0:
        ro.chmod(0o555)
        with pytest.raises(DataDirError, match="not writable"):
            Engine(make_settings({"data_dir": str(ro)}))
        return
    # Root ignores permission bits; an immutable directory stops even root (ext4, xfs).
    if subprocess.run(["chattr", "+i", str(ro)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported on this file system")
    try:
        with pytest.raises(DataDirError, match="not writable"):
            Engine(make_settings({"data_dir": str(ro)}))
    finally:
        subprocess.run(["chattr", "-i", str(ro)], check=True)


def test_data_dir_that_is_a_file_is_a_clear_error(tmp_path: Path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(DataDirError, match="not a directory|cannot create"):
        Engine(make_settings({"data_dir": str(f)}))


def test_garbage_lmdb_record_is_skipped_and_counted(make_engine):
    eng = make_engine()
    eng.create_namespace("m", BB)
    eng.put("m", key(1), blocks(1, BB))
    ns_id = eng.namespace("m").ns_id
    db = eng.catalog._db(ns_id)
    with eng.catalog.env.begin(write=True) as txn:
        txn.put(b"short-key", b"garbage", db=db)
    eng.close(flush=False)
    eng = make_engine()
    assert eng.counters.records_dropped == 1
    assert eng.read("m", key(1))[0][0]


def test_a_prefix_hit_prefetches_the_next_blocks_from_nvme(make_engine):
    eng = make_engine(prefetch_blocks=3)
    eng.create_namespace("m", BB)
    eng.put("m", keys(range(8)), blocks(8, BB), parents=bytes(16) + keys(range(7)))
    eng.evict(Tier.HOST, 8)
    found, _ = eng.read("m", keys(range(2)))                    # blocks 0 and 1 are hit
    assert found.all()
    assert eng.prefetch_after("m", keys(range(2))) == 3         # 2, 3, 4 come up
    on_host = [("host" in _entry(eng, key(i))["copies"]) for i in range(8)]
    assert on_host == [True, True, True, True, True, False, False, False]
    assert eng.counters.tiers[Tier.HOST].prefetched == 3
    assert eng.prefetch_after("m", keys([7])) == 0              # no children: nothing to do


def test_prefetch_never_evicts(make_engine):
    eng = make_engine(host_capacity=4 * BB, prefetch_blocks=8)
    eng.create_namespace("m", BB)
    eng.put("m", keys(range(4)), blocks(4, BB), parents=bytes(16) + keys(range(3)))
    eng.put("m", keys(range(4, 8)), blocks(4, BB), parents=keys(range(3, 7)))
    held = [i for i in range(8) if "host" in _entry(eng, key(i))["copies"]]
    assert eng.prefetch_after("m", keys([0])) == 0              # host full: no guesses
    assert [i for i in range(8) if "host" in _entry(eng, key(i))["copies"]] == held


def test_lookup_counts_the_hit_below_memory_and_stage_brings_it_up(make_engine):
    eng = make_engine(host_capacity=6 * BB, prefetch_blocks=0)
    eng.create_namespace("m", BB)
    data = blocks(6, BB)
    eng.put("m", keys(range(6)), data, parents=bytes(16) + keys(range(5)))
    eng.evict(Tier.HOST, 6)                                     # all on NVMe only
    eng.put("m", keys([10, 11]), blocks(2, BB, seed=1))         # two others fill host
    eng.read("m", keys([0, 1]))                                 # 0, 1 back on host
    assert eng.lookup_prefix("m", keys([0, 1, 2, 3, 4, 5, 99])) == (6, 4)
    assert eng.match_prefix("m", keys(range(6))) == 6
    # Host holds 6 blocks: 0, 1 (the batch's, kept), 10, 11; staging 2..5 evicts 10 and 11.
    assert eng.stage("m", keys(range(6))) == 4
    on_host = [("host" in _entry(eng, key(i))["copies"]) for i in (0, 1, 2, 3, 4, 5, 10, 11)]
    assert on_host == [True] * 6 + [False, False]
    assert eng.lookup_prefix("m", keys(range(6))) == (6, 0)
    assert eng.counters.tiers[Tier.HOST].prefetched == 4
    assert eng.stage("m", keys(range(6))) == 0                  # nothing left below
    found, got = eng.read("m", keys(range(6)))
    assert found.all() and (got == data).all()
    assert not eng.leases                                      # staged copies are not leased


def test_a_stage_whose_disk_read_fails_gives_its_slots_back(make_engine, monkeypatch):
    # A disk read that raises (EIO) cannot be produced for real here: the segment log's reads
    # (the AIO path into slots and the general one) are replaced for one call. Its pinned host
    # slots must come back, and nothing is installed.
    eng = make_engine(host_capacity=4 * BB, prefetch_blocks=0)
    eng.create_namespace("m", BB)
    data = blocks(4, BB)
    eng.put("m", keys(range(4)), data)
    eng.evict(Tier.HOST, 4)
    log_ = eng.namespace("m").log

    def broken(*_a, **_k):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(log_, "read", broken)
    monkeypatch.setattr(log_, "read_rows", broken)
    with pytest.raises(OSError):
        eng.stage("m", keys(range(4)))
    monkeypatch.undo()
    st = eng.namespace("m").slots[Tier.HOST]
    assert int(st.leases.sum()) == 0 and st.pool.free_count == st.pool.n_slots
    assert eng.lookup_prefix("m", keys(range(4))) == (4, 4)        # still on NVMe only
    assert eng.stage("m", keys(range(4))) == 4
    found, got = eng.read("m", keys(range(4)))
    assert found.all() and (got == data).all()


def _state(eng: Engine, ks: list[bytes]) -> dict:
    """What a get and a release may change, for the keys ks."""
    ns = eng.namespace("m")
    cols = ns.table.cols
    rows = ns.table.lookup(b"".join(ks))
    st = ns.slots[Tier.HOST]
    slots = cols["slot"][rows, Tier.HOST]
    c = eng.counters
    return {"rows": {name: cols[name][rows].tolist() for name in
                     ("leases", "last_access", "prev_access", "freq", "version")},
            "slot_leases": st.leases[slots].tolist(), "retired": st.retired[slots].tolist(),
            "clock": eng.clock, "hits": c.tiers[Tier.HOST].hits, "get_hits": c.get_hits,
            "bytes_read": c.tiers[Tier.HOST].bytes_read, "leases": len(eng.leases),
            "host_used": eng.host_used}


@pytest.mark.parametrize("native", [True, False], ids=["c-helper", "numpy"])
@pytest.mark.parametrize("n,repeat", [(1, False), (5, False), (5, True)])
def test_fast_paths_leave_the_state_the_batch_path_leaves(tmp_path: Path, n: int, repeat: bool,
                                                          native: bool, monkeypatch):
    # Engine a serves the n resident keys alone (coherence.fastpath: the C helper, or its numpy
    # reference); engine b gets the same keys plus one absent key, which sends the batch through
    # the general path. Every field a get touches must agree, after the get, after a rewrite
    # that retires the leased slots, and after the release that frees them. With repeat, the
    # batch names its first key twice (two pins of one slot, one touch of the row).
    if native and fastpath._fast is None:
        pytest.skip("kvtier.coherence._fast was not built here")
    if not native:
        monkeypatch.setattr(fastpath, "_fast", None)
    ks = [key(i) for i in range(n)]
    stored = ks
    if repeat:
        ks = ks + ks[:1]
        n += 1
    engines = []
    for name in ("a", "b"):
        eng = Engine(make_settings({"data_dir": str(tmp_path / name), "host_capacity": "64KiB",
                                    "nvme_capacity": "0"}))
        eng.create_namespace("m", BB)
        eng.put("m", b"".join(stored), blocks(len(stored), BB, 1))
        eng.release(eng.get("m", ks[0]).lease_id)     # an earlier access moves prev_access
        engines.append(eng)
    a, b = engines
    ra = a.get("m", b"".join(ks))
    rb = b.get("m", b"".join(ks) + key(99))
    assert rb.found.tolist() == [True] * n + [False]
    assert ra.found.tolist() == [True] * n
    assert ra.slots.tolist() == rb.slots[:n].tolist()
    assert ra.versions.tolist() == rb.versions[:n].tolist()
    assert ra.checksums.tolist() == rb.checksums[:n].tolist()
    assert ra.slots.dtype == rb.slots.dtype and ra.versions.dtype == rb.versions.dtype
    assert _state(a, ks) == _state(b, ks)
    for eng in engines:
        eng.put("m", b"".join(stored), blocks(len(stored), BB, 2))   # the leased slots retire
    assert _state(a, ks) == _state(b, ks)
    for eng, res in ((a, ra), (b, rb)):
        assert eng.namespace("m").slots[Tier.HOST].retired[res.slots[:n]].all()
    a.release(ra.lease_id, 0)
    b.release(rb.lease_id, 0)
    assert _state(a, ks) == _state(b, ks)
    assert a.namespace("m").slots[Tier.HOST].retired.sum() == 0
    for eng in engines:
        eng.close(flush=False)


def test_release_many_ends_each_lease_once_and_frees_retired_slots(make_engine):
    # Three leases of one owner (two on the same key), one of another owner, one unknown id:
    # release_many ends the three in one pass, counts the other two, and a slot that a rewrite
    # retired is freed only once both of its readers are gone.
    eng = make_engine(nvme_capacity="0")
    eng.create_namespace("m", BB)
    eng.put("m", keys(range(4)), blocks(4, BB))
    a = eng.get("m", keys([0, 1]), owner=1)
    b = eng.get("m", keys([0]), owner=1)
    c = eng.get("m", keys([2, 3]), owner=1)
    other = eng.get("m", keys([3]), owner=2)
    eng.put("m", keys([0]), blocks(1, BB, 9))              # key 0's old slot is retired
    pool = eng.namespace("m").slots[Tier.HOST]
    old0 = int(a.slots[0])
    assert pool.retired[old0] and pool.leases[old0] == 2
    free_before = pool.pool.free_count
    assert eng.release_many([a.lease_id, b.lease_id, c.lease_id, other.lease_id, 999], 1) == 2
    assert not pool.retired[old0] and pool.leases[old0] == 0
    assert pool.pool.free_count == free_before + 1          # the retired slot came back
    assert sorted(eng.leases) == [other.lease_id]
    assert pool.leases[int(other.slots[0])] == 1            # another owner's lease stands
    assert eng.release_many([a.lease_id], 1) == 1           # already ended: counted, no change
    eng.release(other.lease_id, 2)
    assert pool.leases.sum() == 0 and not eng.leases


def _workload_state(tmp: Path, policy: str, seed: int, nvme: str = "4MiB") -> list:
    """A random workload (chained puts, rewrites, gets, deletes, evictions into NVMe and out
    of it, with an HBM stand-in above host) and, after every step, the whole page table, the
    slot tiers' arrays and the engine's counters. nvme "0": no NVMe tier, so that host
    evictions leave rows empty and remove them (the replay's case)."""
    from tests.conftest import hbm_standin
    eng = Engine(make_settings({"data_dir": str(tmp), "host_capacity": "64KiB",
                                "hbm_capacity": "32KiB", "nvme_capacity": nvme,
                                "segment_bytes": "1MiB", "write_policy": "write_back",
                                "eviction": policy, "eviction_host": policy}),
                 hbm_pool_factory=hbm_standin)
    eng.create_namespace("m", BB)
    rng = np.random.default_rng(seed)
    seen = []
    for step in range(120):
        op = rng.integers(0, 10)
        ids = [int(i) for i in rng.integers(0, 60, int(rng.integers(1, 9)))]
        ids = list(dict.fromkeys(ids))
        if op < 5:
            tier = Tier.HBM if op == 0 else Tier.HOST
            eng.put("m", keys(ids), blocks(len(ids), BB, step),
                    parents=b"\0" * 16 + keys(ids[:-1]), tier=tier)
        elif op < 8:
            res = eng.get("m", keys(ids))
            eng.release(res.lease_id)
            seen.append(res.found.tolist())
        elif op == 8:
            seen.append(eng.delete("m", keys(ids)))
        else:
            seen.append(eng.evict(Tier.HOST, int(rng.integers(1, 6))))
        seen.append(eng.match_prefix("m", keys(ids)))
        ns = eng.namespace("m")
        t = ns.table
        seen.append({name: col[: t.n_rows].tolist() for name, col in t.cols.items()
                     if name != "key"})
        seen.append([t.live, t.version_floor, t.live_rows().tolist(), eng.clock, eng.host_used])
        for st in ns.slots.values():
            seen.append((st.slot_row.tolist(), st.leases.tolist(), st.retired.tolist(),
                         st.pool.free_count))
        seen.append({k.label: v.as_dict() for k, v in eng.counters.tiers.items()})
    eng.close(flush=False)
    return seen


@pytest.mark.parametrize("policy", ["lru", "chain"])
def test_the_c_helpers_leave_the_state_numpy_leaves(tmp_path: Path, policy: str, monkeypatch):
    # The commit's install, a tier's copies dropped, rows left empty by eviction, their
    # removal and the prefix match run in C (kvtier.coherence._fast, kvtier.pagetable._native)
    # with their numpy versions kept as the fallback: the same workload, step by step, must
    # leave the same page table, slot arrays and counters either way.
    from kvtier.coherence import engine as engine_mod, eviction
    from kvtier.coherence.policies import queues, rings
    from kvtier.pagetable import table
    if engine_mod._fast is None or table._native is None or queues._queues is None:
        pytest.skip("the C helpers were not built here")
    with_c = _workload_state(tmp_path / "c", policy, 5)
    for mod, name in ((engine_mod, "_fast"), (eviction, "_fast"), (fastpath, "_fast"),
                      (rings, "_queues"), (queues, "_queues"), (table, "_native")):
        monkeypatch.setattr(mod, name, None)
    assert _workload_state(tmp_path / "numpy", policy, 5) == with_c


@pytest.mark.parametrize("policy", ["lru", "chain"])
def test_the_c_helpers_leave_the_state_numpy_leaves_without_nvme(tmp_path: Path, policy: str,
                                                                  monkeypatch):
    # As above over host and HBM only: every host eviction empties and removes its rows, the
    # path _fast.drop_rows takes (with NVMe below, rows keep a copy and are rarely removed).
    from kvtier.coherence import engine as engine_mod, eviction
    from kvtier.coherence.policies import queues, rings
    from kvtier.pagetable import table
    if eviction._fast is None or table._native is None or queues._queues is None:
        pytest.skip("the C helpers were not built here")
    with_c = _workload_state(tmp_path / "c", policy, 6, nvme="0")
    for mod, name in ((engine_mod, "_fast"), (eviction, "_fast"), (fastpath, "_fast"),
                      (rings, "_queues"), (queues, "_queues"), (table, "_native")):
        monkeypatch.setattr(mod, name, None)
    assert _workload_state(tmp_path / "numpy", policy, 6, nvme="0") == with_c


@pytest.mark.parametrize("policy", ["lru", "chain"])
def test_the_inline_put_leaves_the_state_reserve_and_commit_leave(make_engine, tmp_path, policy,
                                                                 monkeypatch):
    # Engine.put runs a host write_back put as one step (_put_inline; write_through, the
    # default, takes the general path); the same puts through
    # reserve, the pool's write and commit must leave the same table, pools and counters,
    # evictions (a 64-slot host tier, no NVMe: the lowest tier's loop), overwrites and chains
    # included. Chained puts of keys none of which has a row take PageTable.put_new (one C
    # call, where built): counted, so that the comparison is known to cover it.
    from kvtier.pagetable.table import PageTable
    put_new, fused = PageTable.put_new, []

    def counted(self, *args):
        got = put_new(self, *args)
        fused.append(got is not None)
        return got
    monkeypatch.setattr(PageTable, "put_new", counted)
    engines = [make_engine(data_dir=str(tmp_path / name), host_capacity="4KiB",
                           nvme_capacity="0", eviction=policy, write_policy="write_back")
               for name in ("inline", "phased")]
    for eng in engines:
        eng.create_namespace("ns", 64)
    rng = np.random.default_rng(7)
    for step in range(120):
        n = int(rng.integers(1, 20))
        ids = rng.choice(200, n, replace=False).tolist()
        kb = keys(ids)
        pb = keys([i + 1 for i in ids[1:]]) + bytes(16) if step % 3 else None
        data = blocks(n, 64, seed=step)
        got = [engines[0].put("ns", kb, data, parents=pb)]
        res = engines[1].reserve("ns", kb, parents=pb)
        res.ns.slots[Tier.HOST].pool.write(res.slots, data)
        got.append(engines[1].commit(res.rid))
        assert got[0].tolist() == got[1].tolist()
    a, b = (eng.namespace("ns") for eng in engines)
    assert a.table.n_rows == b.table.n_rows and a.table.live == b.table.live
    for name, col in a.table.cols.items():
        assert np.array_equal(col[: a.table.n_rows], b.table.cols[name][: b.table.n_rows]), name
    sa, sb = a.slots[Tier.HOST], b.slots[Tier.HOST]
    assert np.array_equal(sa.slot_row, sb.slot_row) and np.array_equal(sa.leases, sb.leases)
    assert np.array_equal(sa.pool.array, sb.pool.array)
    assert sa.pool.free_count == sb.pool.free_count
    assert engines[0].host_used == engines[1].host_used
    assert engines[0].counters.puts == engines[1].counters.puts
    ca, cb = (eng.counters.tiers[Tier.HOST] for eng in engines)
    assert (ca.evictions, ca.bytes_written) == (cb.evictions, cb.bytes_written)
    assert ca.evictions > 0
    from kvtier.checksums import XXH3_ADDRESS
    from kvtier.pagetable import table as table_mod
    if table_mod._native is not None and XXH3_ADDRESS is not None:
        assert any(fused) and not all(fused)      # both ways were taken
