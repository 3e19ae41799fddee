"""rev9: stall8's C checks (kvtier/coherence/_gets.c victims_covered, must_bring) against
inputs outside what eviction and try_get pass. The wide table's finding was fixed after
stall9's merge (the tier loop stops at the 64 tiers lowers can name)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.coherence import eviction

pytestmark = pytest.mark.skipif(eviction._victims_covered is None, reason="_gets not built")


@pytest.mark.parametrize("nt,lowers,match", [(65, 1, 64), (67, 1 << 2, 66)])
def test_victims_covered_of_a_table_wider_than_64_tiers_never_reads_an_unset_lower(
        nt, lowers, match):
    # Tier 1's copy at version 5; the one lower tier named (0 or 2) holds another version;
    # a column past 63 holds 5. Not covered: False (or a ValueError, as for a tier past the
    # columns), never True.
    copy_ver = np.zeros((1, nt), dtype=np.uint64)
    copy_ver[0, 1], copy_ver[0, 2], copy_ver[0, match] = 5, 4, 5
    slot_row = np.zeros(1, dtype=np.int64)
    victims = np.zeros(1, dtype=np.int64)
    try:
        out = eviction._victims_covered(copy_ver, slot_row, victims, 1, lowers)
    except ValueError:
        return
    assert out is False
