"""Replay on hand-made traces whose hit ratios are known by hand, and bad traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.replay import load_trace, main, replay_belady, replay_infinite, run

B = 512     # tokens per block


def _write(tmp_path: Path, reqs: list[list[int]]) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(r),
                                     "output_length": 1, "hash_ids": r}) + "\n"
                         for i, r in enumerate(reqs)))
    return p


def test_infinite_counts_only_the_leading_run():
    # [1,2,3] cold; [1,2,4]: 1,2 hit; [5,2]: 5 misses so 2 does not count; [1,2,3,4]: 4 hits
    trace = [[1, 2, 3], [1, 2, 4], [5, 2], [1, 2, 3, 4]]
    assert replay_infinite(trace) == (6, 12)


def test_lru_by_hand():
    # capacity 2 blocks. [1,2] miss miss -> {1,2}; [1,2]: 2 hits; [3]: evicts 1 -> {2,3};
    # [1,2]: 1 misses (and 2 does not count) -> {1,2}; [2]: hit.  hits = 2 + 1 = 3 of 8
    trace = [[1, 2], [1, 2], [3], [1, 2], [2]]
    r = run(trace, "lru", 2 * B)
    assert (r.hits, r.blocks) == (3, 8)
    assert r.hit_ratio == pytest.approx(3 / 8)


def test_belady_by_hand():
    # capacity 2, every accessed block is inserted. [1,2]; [3]: full, and of the cached blocks
    # 2 is next used furthest away (1 at the next request's first block, 2 after it), so 2 goes.
    # [1,2]: 1 hits, 2 misses and is inserted in place of 3 (never used again). [1]: hit.
    trace = [[1, 2], [3], [1, 2], [1]]
    assert replay_belady(trace, 2) == (2, 6)
    assert replay_belady(trace, 0) == (0, 6)
    assert replay_belady(trace, 10) == replay_infinite(trace)


def test_belady_is_never_worse_than_lru_and_never_better_than_infinite(tmp_path: Path):
    import random
    rnd = random.Random(3)
    trace = [[rnd.randrange(30) for _ in range(rnd.randrange(1, 6))] for _ in range(300)]
    for cap in (2, 5, 10, 20):
        lru = run(trace, "lru", cap * B).hits
        bel = replay_belady(trace, cap)[0]
        inf = replay_infinite(trace)[0]
        assert lru <= bel <= inf


def test_leaf_first_keeps_the_prefix(tmp_path: Path):
    # capacity 3. [1,2,3] -> chain 1<-2<-3 ; [4]: plain LRU evicts 1 (oldest), leaf-first evicts
    # 3 (the leaf); then [1,2,3]: plain LRU gets 0 hits, leaf-first gets 2 (1 and 2).
    trace = [[1, 2, 3], [4], [1, 2, 3]]
    assert run(trace, "lru", 3 * B).hits == 0
    assert run(trace, "lru", 3 * B, leaf_first=True).hits == 2


def test_cli_json_and_curve(tmp_path: Path, capsys):
    p = _write(tmp_path, [[1, 2], [1, 2], [3], [1, 2], [2]])
    assert main([str(p), "--policy", "lru", "--capacity", "1024", "--json",
                 "--metadata-only"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hit_ratio"] == pytest.approx(3 / 8) and out["policy"] == "lru"
    plot = tmp_path / "curve.png"
    assert main([str(p), "--policy", "lru,belady,infinite", "--capacity", "512,1024,2048",
                 "--json", "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["results"]) == 9 and plot.stat().st_size > 1000


@pytest.mark.parametrize("body,match", [
    ("not json\n", ":1: not a Mooncake"),
    ('{"hash_ids": [1, -2]}\n', "non-negative"),
    ('{"timestamp": 1}\n', "hash_ids"),
    ("", "no requests"),
])
def test_garbage_traces_are_refused_with_the_line(tmp_path: Path, body, match):
    p = tmp_path / "bad.jsonl"
    p.write_text(body)
    with pytest.raises(ConfigError, match=match):
        load_trace(p)


def test_bad_options(tmp_path: Path):
    p = _write(tmp_path, [[1]])
    with pytest.raises(ConfigError, match="policy"):
        main([str(p), "--policy", "fifo", "--capacity", "1e6"])
    with pytest.raises(ConfigError, match="below one block"):
        main([str(p), "--capacity", "10"])
    with pytest.raises(ConfigError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("block_bytes", [1, 4096])
def test_tiered_replay_completes_and_nvme_holds_its_capacity(block_bytes: int):
    # Host and NVMe both smaller than the trace's blocks: NVMe has to reclaim throughout.
    import random
    rnd = random.Random(7)
    trace = [[rnd.randrange(400) for _ in range(rnd.randrange(1, 12))] for _ in range(600)]
    for host_blocks in (2, 16, 64):
        r = run(trace, "lru", host_blocks * B, nvme_tokens=48 * B, block_bytes=block_bytes)
        assert r.blocks == sum(len(t) for t in trace)
        assert 0 < r.nvme_blocks_max <= 48
        assert r.tier_hits["nvme"] > 0
