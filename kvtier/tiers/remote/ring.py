"""Consistent hashing over independent Redis servers: 160 virtual nodes per server (seed 3.3).

Each server owns the arcs that end at its virtual nodes' points on a 64-bit ring (xxh3-64 of
"server#i"). A key goes to the first point at or after its own hash. Adding an Nth server moves
only the keys on the arcs its new points take, about 1/N of them; lookups of a batch are one
numpy searchsorted.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import xxhash

VNODES = 160


class HashRing:
    def __init__(self, nodes: Sequence[str], vnodes: int = VNODES) -> None:
        if not nodes:
            raise ValueError("a hash ring needs at least one node")
        self.nodes = list(nodes)
        points, owners = [], []
        for idx, node in enumerate(self.nodes):
            for i in range(vnodes):
                points.append(xxhash.xxh3_64_intdigest(f"{node}#{i}".encode()))
                owners.append(idx)
        order = np.argsort(np.array(points, dtype=np.uint64), kind="stable")
        self._points = np.array(points, dtype=np.uint64)[order]
        self._owners = np.array(owners, dtype=np.int64)[order]

    def lookup(self, keys: Sequence[bytes]) -> np.ndarray:
        """The index (into nodes) of each key's server."""
        h = np.fromiter((xxhash.xxh3_64_intdigest(k) for k in keys), dtype=np.uint64,
                        count=len(keys))
        pos = np.searchsorted(self._points, h, side="left")
        pos[pos == self._points.size] = 0          # wrap around the ring
        return self._owners[pos]
