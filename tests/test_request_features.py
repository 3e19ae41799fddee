"""bench/request_features.py and the ceiling's extra classes: what a request's arrival adds to a
block's own history (issue 18, gap6)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np

from bench.policy_ceiling import ceiling, ceiling_transfer
from bench.request_features import Requests, access_features, next_stack_distance
from kvtier.replay import Trace

ROOT = Path(__file__).resolve().parents[1]


def _trace(ids):
    return Trace([list(r) for r in ids], [512 * len(r) for r in ids])


def test_a_feature_that_marks_the_reused_block_buys_its_first_reuse():
    """0 is asked for every other request, 1000.. never again. Alone, 0's first access shares
    its class with the one-off blocks and its first reuse is not bought (18 hits); an extra
    feature that sets 0's accesses apart buys it too (19)."""
    ids = [[0] if i % 2 == 0 else [1000 + i] for i in range(40)]
    flat = np.array([b for r in ids for b in r])
    assert ceiling(_trace(ids), 2)["hits"] == 18
    got = ceiling(_trace(ids), 2, extra=(flat == 0).astype(np.int64))
    assert got["hits"] == 19 and got["occupancy_blocks"] <= 2


def test_cutoffs_chosen_on_a_part_itself_are_its_ceiling_and_a_class_it_lacks_keeps_nothing():
    ids = [[0] if i % 2 == 0 else [1000 + i] for i in range(40)]
    t = _trace(ids)
    flat = np.array([b for r in ids for b in r])
    mark = (flat == 0).astype(np.int64)
    assert ceiling_transfer((t, mark), (t, mark), 2)["hits"] == ceiling(t, 2, mark)["hits"]
    # trained where block 0 is marked 1, tested where it is marked 2: nothing learned applies
    assert ceiling_transfer((t, mark), (t, 2 * mark), 2)["hits"] == 0
    # a split by noise buys a hit in its own part (hindsight: the cell of 0's first access holds
    # a third of the one-offs); shrunk past every split class's count, it learns what the
    # unsplit classes learn
    noise = np.arange(flat.size) % 3
    assert ceiling_transfer((t, noise), (t, noise), 2)["hits"] == 19
    assert (ceiling_transfer((t, noise), (t, noise), 2, shrink=10**6)["hits"]
            == ceiling_transfer((t, None), (t, None), 2)["hits"])


def test_next_stack_distance_is_lru_s():
    rnd = random.Random(7)
    ids = [[rnd.randrange(12) for _ in range(rnd.randint(1, 4))] for _ in range(60)]
    flat = [b for r in ids for b in r]
    got = next_stack_distance(_trace(ids))
    for pos, b in enumerate(flat):
        later = [q for q in range(pos + 1, len(flat)) if flat[q] == b]
        want = len(set(flat[pos + 1:later[0]])) + 1 if later else np.inf
        assert got[pos] == want, pos


def test_a_conversation_s_turns_gaps_and_roles():
    """Two conversations under the shared root 0: a's second turn 40 s after its first extends
    it by one block (its last block changes, as a partial block does), b is new; a's third turn
    comes 200 s after its second."""
    recs = [
        {"timestamp": 0, "input_length": 1500, "output_length": 30, "hash_ids": [0, 1, 2]},
        {"timestamp": 10_000, "input_length": 1000, "output_length": 600, "hash_ids": [0, 5, 6]},
        {"timestamp": 40_000, "input_length": 2000, "output_length": 100,
         "hash_ids": [0, 1, 3, 4]},
        {"timestamp": 240_000, "input_length": 3000, "output_length": 100,
         "hash_ids": [0, 1, 3, 4, 7, 8]},
    ]
    req = Requests(recs)
    f = access_features(req)
    starts = [0, 3, 6, 10]
    assert [int(f["turn"][s]) for s in starts] == [0, 0, 1, 2]
    assert [int(f["gap"][s]) for s in starts] == [0, 0, 2, 3]      # none, none, < 120, more
    assert [int(f["output"][s]) for s in starts] == [0, 3, 1, 1]
    assert [int(f["new"][s]) for s in starts] == [1, 1, 1, 1]       # 3, 2, 2, 2 new blocks
    assert [int(f["oracle"][s]) for s in starts] == [1, 0, 2, 0]    # a: next turn in 40, 200 s
    # roles of the third request's blocks: 0 and 1 seen, 3 new, 4 its last block
    assert f["role"][6:10].tolist() == [0, 0, 1, 2]
    assert len(f["turn"]) == sum(len(r["hash_ids"]) for r in recs)


def test_the_script_runs_on_a_small_trace_and_reports_each_part_and_the_transfer(tmp_path):
    trace = tmp_path / "t.jsonl"
    rnd = random.Random(5)
    convs: list[list[int]] = []
    lines = []
    for i in range(120):
        if not convs or rnd.random() < 0.4:
            convs.append([0])
        c = rnd.choice(convs)
        c.extend(1000 * (i + 1) + j for j in range(rnd.randint(1, 3)))
        lines.append(json.dumps({"timestamp": 1000 * i, "input_length": 512 * len(c),
                                 "output_length": rnd.randint(1, 900), "hash_ids": list(c)}))
    trace.write_text("\n".join(lines) + "\n")
    out = subprocess.run(
        [sys.executable, "bench/request_features.py", str(trace), "--capacity", "8192,32768",
         "--features", "turn,output,turnxoutput", "--shrink", "50", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["machine"]["cores"] >= 1 and len(r["rows"]) == 2
    for row in r["rows"]:
        c = row["ceiling_gap_closed"]
        assert set(c) == {"none", "turn", "output", "turnxoutput"}
        assert {"whole", "part0", "part1", "part0_cutoffs_from_part1",
                "part1_cutoffs_from_part0", "part0_cutoffs_from_part1_shrink50"} <= set(c["turn"])
        info = row["at_candidacy"]
        assert 0 <= info["label_rate"] <= 1 and info["class_bits"] <= info["label_bits"] + 1e-9
        assert all(v["bits_beyond_class"] >= -1e-9 for v in info["features"].values())


def test_the_ceiling_with_ages_in_seconds_matches_accesses_when_one_access_is_one_second():
    from bench.request_features import seconds_ceiling
    ids = [[0] if i % 2 == 0 else [1000 + i] for i in range(40)]
    req = Requests([{"timestamp": 1000 * i, "hash_ids": r} for i, r in enumerate(ids)])
    assert round(seconds_ceiling(req, 2) * 40) == ceiling(_trace(ids), 2)["hits"] == 18
    # the same accesses at half the pace: cutoffs learned there (0 kept >= 4 s) still keep 0
    # here, where it comes back every 2 s
    slow = Requests([{"timestamp": 2000 * i, "hash_ids": r} for i, r in enumerate(ids)])
    assert round(seconds_ceiling(req, 2, train=slow) * 40) == 18
