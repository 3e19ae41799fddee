"""Replay on hand-made traces whose hit ratios are known by hand, and bad traces and options."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.replay import (Tiers, Trace, load_trace, main, replay_belady, replay_infinite, run,
                           sweep)

B = 512     # tokens per block


def _trace(reqs: list[list[int]]) -> Trace:
    return Trace(reqs, [B * len(r) for r in reqs])


def _write(tmp_path: Path, reqs: list[list[int]], tokens: list[int] | None = None) -> Path:
    p = tmp_path / "t.jsonl"
    tokens = tokens or [B * len(r) for r in reqs]
    p.write_text("".join(json.dumps({"timestamp": i, "input_length": t, "output_length": 1,
                                     "hash_ids": r}) + "\n"
                         for i, (r, t) in enumerate(zip(reqs, tokens))))
    return p


def test_infinite_counts_only_the_leading_run():
    # [1,2,3] cold; [1,2,4]: 1,2 hit; [5,2]: 5 misses so 2 does not count; [1,2,3,4]: 4 hits
    assert replay_infinite(_trace([[1, 2, 3], [1, 2, 4], [5, 2], [1, 2, 3, 4]])) == [0, 2, 0, 4]


def test_lru_by_hand():
    # capacity 2 blocks. [1,2] miss miss -> {1,2}; [1,2]: 2 hits; [3]: evicts 1 -> {2,3};
    # [1,2]: 1 misses (and 2 does not count) -> {1,2}; [2]: hit.  hits = 2 + 1 = 3 of 8
    r = run(_trace([[1, 2], [1, 2], [3], [1, 2], [2]]), "lru", Tiers(2))
    assert (r.hits, r.blocks) == (3, 8)
    assert r.hit_ratio == pytest.approx(3 / 8)


def test_belady_by_hand_with_and_without_bypass():
    # capacity 2. [1,2]; [3]: full. Storing every block, 2 goes (next used furthest away), then
    # [1,2]: 1 hits, 2 misses and replaces 3; [1]: hit -> 2 hits. With bypass, 3 (never used
    # again) is not stored at all, so [1,2] hits twice and [1] once -> 3 hits.
    t = _trace([[1, 2], [3], [1, 2], [1]])
    assert sum(replay_belady(t, 2, bypass=False)) == 2
    assert sum(replay_belady(t, 2)) == 3
    assert sum(replay_belady(t, 0)) == 0
    assert replay_belady(t, 10) == replay_infinite(t)


def test_belady_bounds_every_policy_and_infinite_bounds_belady():
    rnd = random.Random(3)
    t = _trace([[rnd.randrange(30) for _ in range(rnd.randrange(1, 6))] for _ in range(300)])
    for cap in (2, 5, 10, 20):
        bel = sum(replay_belady(t, cap))
        assert sum(replay_belady(t, cap, bypass=False)) <= bel <= sum(replay_infinite(t))
        for policy in ("lru", "s3fifo", "chain"):
            assert run(t, policy, Tiers(cap)).hits <= bel


def test_chain_keeps_the_prefix_that_lru_loses():
    # capacity 3. [1,2,3] -> chain 1<-2<-3; [4]: LRU evicts 1 (the oldest), chain evicts 3 (the
    # deepest block of the batch goes first); then [1,2,3]: LRU 0 hits, chain 2 (1 and 2).
    t = _trace([[1, 2, 3], [4], [1, 2, 3]])
    assert run(t, "lru", Tiers(3)).hits == 0
    assert run(t, "chain", Tiers(3)).hits == 2
    assert run(t, "chain", Tiers(3), params={"leaf_first": "false"}).hits == 0


def test_token_ratio_counts_the_partial_last_block(tmp_path: Path):
    # [1,2] of 700 tokens (the last block holds 188), twice: 2 blocks hit of 4, 700 tokens of 1400
    r = run(load_trace(_write(tmp_path, [[1, 2], [1, 2]], [700, 700])), "lru", Tiers(4))
    assert (r.hits, r.blocks, r.hit_tokens, r.tokens) == (2, 4, 700, 1400)


def test_tiered_replay_counts_every_tier_and_the_optimum_sees_the_total():
    # host 4 + NVMe 16 blocks: the working set of 9 fits the two tiers together, not the host.
    t = _trace([[1, 2, 3], [4, 5, 6], [7, 8, 9]] * 3)
    assert run(t, "lru", Tiers(4)).hits == 0
    tiered = run(t, "lru", Tiers(4, nvme=16))
    assert tiered.hits == 18 and tiered.tier_hits["nvme"] > 0
    assert run(t, "belady", Tiers(4, nvme=16)).hits == 18
    hbm = run(t, "chain", Tiers(4, hbm=2, nvme=16))
    assert hbm.hits == 18 and set(hbm.tier_hits) == {"hbm", "host", "nvme"}


def test_cli_json_csv_curve_and_gap(tmp_path: Path, capsys):
    p = _write(tmp_path, [[1, 2], [1, 2], [3], [1, 2], [2]])
    assert main([str(p), "--policy", "lru", "--capacity", "1024", "--json",
                 "--metadata-only"]) == 0
    out = json.loads(capsys.readouterr().out)
    lru = [r for r in out["results"] if r["policy"] == "lru"]
    assert lru[0]["hit_ratio"] == pytest.approx(3 / 8) and lru[0]["gap_closed"] == 0
    plot, table = tmp_path / "curve.png", tmp_path / "r.csv"
    assert main([str(p), "--policy", "chain,infinite", "--capacity", "512,1024",
                 "--sweep", "1024:2048:2", "--small", "0.2,0.5", "--json", "--plot", str(plot),
                 "--csv", str(table), "--metadata-only"]) == 0
    out = json.loads(capsys.readouterr().out)
    # 4 points x (lru, belady, infinite, chain at 2 settings of small)
    assert len(out["results"]) == 4 * 5 and plot.stat().st_size > 1000
    with table.open(encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 20 and {r["params"] for r in rows} >= {"small=0.2", "small=0.5"}
    bel = [r for r in out["results"] if r["policy"] == "belady"]
    assert all(r["gap_closed"] in (1, None) for r in bel)


def test_sweep_is_log_spaced():
    assert sweep("1e6:4e6:3") == [1_000_000, 2_000_000, 4_000_000]
    assert sweep("5e5:5e5:1") == [500_000]


@pytest.mark.parametrize("body,match", [
    ("not json\n", ":1: not a Mooncake"),
    ('{"hash_ids": [1, -2]}\n', "non-negative"),
    ('{"timestamp": 1}\n', "hash_ids"),
    ('{"hash_ids": [1], "input_length": "many"}\n', "input_length"),
    ('[1, 2]\n', "not a Mooncake"),
    ("", "no requests"),
])
def test_garbage_traces_are_refused_with_the_line(tmp_path: Path, body, match):
    p = tmp_path / "bad.jsonl"
    p.write_text(body)
    with pytest.raises(ConfigError, match=match):
        load_trace(p)


@pytest.mark.parametrize("args,match", [
    (["--policy", "fifo", "--capacity", "1e6"], "policy"),
    (["--capacity", "10"], "below one block"),
    (["--capacity", "lots"], "expected a size"),
    (["--capacity", "1e999"], "give tokens"),
    ([], "--sweep"),
    (["--sweep", "6e6:5e5:3"], "LO:HI:N"),
    (["--sweep", "1e6"], "LO:HI:N"),
    (["--capacity", "1e6", "--nvme-capacity=-2x"], "multiple of the host"),
    (["--capacity", "1e6", "--ghost", "lots"], "eviction_ghost"),
    (["--capacity", "1e6", "--small", "1.5"], "eviction_small"),
    (["--capacity", "1e6", "--leaf-first", "maybe"], "eviction_leaf_first"),
    (["--capacity", "1e6", "--leaf-first", "host:true,gpu:false"], "eviction_leaf_first"),
    (["--capacity", "1e6", "--leaf-first", "host:maybe"], "eviction_leaf_first"),
])
def test_bad_options(tmp_path: Path, args, match):
    p = _write(tmp_path, [[1]])
    with pytest.raises(ConfigError, match=match):
        main([str(p), "--no-progress", *args])


def test_tier_value_pairs_are_one_variant_and_commas_separate_the_rest():
    import argparse
    from kvtier.replay import _param_variants
    args = argparse.Namespace(small=None, freq_max=None, ghost=["host:2x,hbm:1x", "3x,4x"],
                              leaf_first=["host:true,nvme:false"])
    assert _param_variants(args) == [
        {"ghost": g, "leaf_first": "host:true,nvme:false"} for g in ("host:2x,hbm:1x", "3x", "4x")]


def test_missing_trace_file(tmp_path: Path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("block_bytes", [1, 4096])
def test_tiered_replay_completes_and_nvme_holds_its_capacity(block_bytes: int):
    # Host and NVMe both smaller than the trace's blocks: NVMe has to reclaim throughout.
    import random
    rnd = random.Random(7)
    trace = [[rnd.randrange(400) for _ in range(rnd.randrange(1, 12))] for _ in range(600)]
    for host_blocks in (2, 16, 64):
        r = run(_trace(trace), "lru", Tiers(host_blocks, nvme=48), block_bytes=block_bytes)
        assert r.blocks == sum(len(t) for t in trace)
        assert 0 < r.nvme_blocks_max <= 48
        assert r.tier_hits["nvme"] > 0
