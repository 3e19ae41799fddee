"""LMDB records of page-table rows, and the check that a row still holds a key: shared by the
NVMe store (coherence.persist) and its space manager (coherence.space)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvtier.pagetable.store import FLAG_PARENT, record_dtype

if TYPE_CHECKING:
    from kvtier.coherence.namespace import Namespace


def records_of(ns: "Namespace", rows: np.ndarray, versions: np.ndarray,
             sums: np.ndarray) -> np.ndarray:
    """LMDB records of rows (segment and offset filled in after the append)."""
    cols = ns.table.cols
    rec = np.zeros(rows.size, dtype=record_dtype(ns.key_width))
    rec["size"] = ns.block_bytes
    rec["version"], rec["checksum"] = versions, sums
    par = cols["parent"][rows]
    has = par >= 0
    rec["flags"] = np.where(has, FLAG_PARENT, 0)
    if has.any():
        rec["parent"][has] = cols["key"][par[has]]
    return rec


def same_key(ns: "Namespace", rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Rows that still hold these keys (a removed row may have been reused by another)."""
    t = ns.table
    live = rows < t.n_rows
    out = np.zeros(rows.size, dtype=bool)
    r = rows[live]
    out[live] = (t.cols["key"][r] == keys[live]) & (t.cols["version"][r] > 0)
    return out
