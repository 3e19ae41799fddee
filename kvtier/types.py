"""Names shared by every layer: tier identities and the NewTypes for keys and slots."""

from __future__ import annotations

from enum import IntEnum
from typing import NewType

BlockKey = NewType("BlockKey", bytes)
SlotId = NewType("SlotId", int)
LeaseId = NewType("LeaseId", int)


class Tier(IntEnum):
    """A place a copy can live. The integer is a column index in the page table, nothing more:
    no logic compares tiers by value. The order of service is SERVE_ORDER, written out below."""

    HBM = 0
    HOST = 1
    NVME = 2
    REMOTE = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> "Tier":
        try:
            return cls[text.upper()]
        except KeyError:
            from kvtier.errors import BadRequest
            raise BadRequest(f"unknown tier {text!r}; use one of "
                             f"{', '.join(t.label for t in cls)}") from None


NTIERS = len(Tier)

# Reads are served from the first tier in this list that holds the current version; eviction
# from one tier may rely on a copy in any tier after it ("a lower tier").
SERVE_ORDER: tuple[Tier, ...] = (Tier.HBM, Tier.HOST, Tier.NVME, Tier.REMOTE)


def lower_tiers(tier: Tier) -> tuple[Tier, ...]:
    return SERVE_ORDER[SERVE_ORDER.index(tier) + 1:]
