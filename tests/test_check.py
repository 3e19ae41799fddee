"""kvtier check: finds damage on disk, lists it, and --repair drops only what is broken."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvtier.check import check, main
from kvtier.errors import DataDirError
from tests.conftest import blocks, key, keys

BB = 4096


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def damaged(make_engine, tmp_path: Path):
    eng = make_engine()
    eng.create_namespace("m", BB)
    eng.put("m", keys(range(6)), blocks(6, BB))
    offsets = {i: eng.entry("m", key(i))["copies"]["nvme"]["offset"] for i in range(6)}
    eng.close(flush=False)
    seg = next((tmp_path / "data" / "nvme").glob("ns-*/seg-*.kvt"))
    return tmp_path / "data", seg, offsets


def test_a_sound_directory_has_no_damage(make_engine, tmp_path: Path):
    eng = make_engine()
    eng.create_namespace("m", BB)
    eng.put("m", keys(range(5)), blocks(5, BB))
    eng.close(flush=False)
    rep = check(tmp_path / "data").as_dict()
    assert rep["records"] == 5 and rep["sound"] == 5 and rep["damaged"] == 0


def test_bit_flip_and_truncation_are_listed(damaged):
    data, seg, offsets = damaged
    _flip(seg, offsets[1] + 10)
    os.truncate(seg, offsets[5] + 100)
    rep = check(data).as_dict()
    assert rep["sound"] == 4
    problems = {d["key"]: d["problem"] for d in rep["damage"]}
    assert problems == {key(1).hex(): "checksum", key(5).hex(): "truncated"}


def test_repair_drops_only_the_damaged_records(damaged, make_engine):
    data, seg, offsets = damaged
    _flip(seg, offsets[2] + 4000)
    rep = check(data, repair=True).as_dict()
    assert rep["repaired"] == 1
    again = check(data).as_dict()
    assert again["damaged"] == 0 and again["sound"] == 5
    eng = make_engine()
    found, out = eng.read("m", keys(range(6)))
    assert found.tolist() == [True, True, False, True, True, True]
    assert (out[found] == blocks(6, BB)[found]).all()
    assert eng.counters.checksum_failures == 0          # nothing bad was left to find


def test_cli_exit_codes_and_json(damaged, capsys):
    data, seg, offsets = damaged
    assert main(["--data-dir", str(data)]) == 0
    _flip(seg, offsets[0])
    assert main(["--data-dir", str(data), "--json"]) == 1
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert out["damaged"] == 1 and out["by_problem"] == {"checksum": 1}
    assert main(["--data-dir", str(data), "--repair"]) == 0


def test_orphan_segments_are_reported_and_removed_on_repair(damaged):
    data, seg, _ = damaged
    from kvtier.tiers.nvme import _HEADER, MAGIC
    orphan = seg.with_name("seg-00000099.kvt")
    orphan.write_bytes(_HEADER.pack(MAGIC, BB, BB, 1, 99, 4096).ljust(4096, b"\0"))  # no records
    foreign = seg.with_name("seg-00000098.kvt")
    foreign.write_bytes(b"someone else's file" * 300)
    rep = check(data).as_dict()
    assert str(orphan) in rep["orphan_segments"]
    assert rep["foreign_files"] == [str(foreign)] and rep["damaged"] == 0
    fixed = check(data, repair=True)
    assert fixed.removed_segments == 1 and not orphan.exists()
    # never ours to delete: moved aside, so that the service can start beside it again
    assert seg.exists() and not foreign.exists()
    assert [Path(p).read_bytes() for p in fixed.quarantined] == [b"someone else's file" * 300]
    assert check(data).as_dict()["sound"] == 6


def test_not_a_data_directory(tmp_path: Path):
    with pytest.raises(DataDirError, match="not a kvtier data directory"):
        check(tmp_path)
    assert main(["--data-dir", str(tmp_path)]) == 2
