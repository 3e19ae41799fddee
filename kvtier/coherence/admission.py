"""What a connected peer may ask of the service: checked before anything is allocated or stored.

Any process of an allowed uid can reach the socket, so every request that makes the service
allocate or persist something is bounded here, with an error that names the setting to change
(issue 20):

    layout       a namespace's layout metadata is JSON-like (string keys; str, int, float,
                 bool, None, lists and maps), at most LAYOUT_BYTES packed and LAYOUT_DEPTH
                 deep. It is stored in LMDB and read back at every start, so a value msgpack
                 can carry but the catalog cannot read back (a map with integer keys, as the
                 frame decoder's strict_map_key=False allows) once made the data directory
                 unusable.
    slots        a namespace's host pool costs 17 bytes of slot metadata per slot (slot_row,
                 leases, retired: coherence.namespace; the free stack: tiers.slots), allocated
                 at create and at every start: block_bytes=1 at a 64 MiB tier asked ~786 MB
                 under the engine lock. max_host_slots bounds it.
                 Every namespace's pool spans the whole host_capacity (the budget is shared),
                 so n namespaces cost n times that metadata: max_slot_metadata bounds the sum
                 (1,000 namespaces of 16 KiB blocks at 1 GiB took ~1 GB of RSS).
    namespaces   each costs a memfd and segment files (about 3 fds); max_namespaces
                 bounds their number (LMDB's max_dbs is sized from the store's ceiling).
                 NVMe AIO is one context per process (tiers.aio.acquire_shared), not one
                 per namespace.

These functions hold no state; the engine and the server call them.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack

from kvtier.errors import BadRequest, CapacityError, NamespaceError

LAYOUT_BYTES = 4096            # a layout describes a model (dtype, layers, heads...): tiny
LAYOUT_DEPTH = 4
LAYOUT_KEY_CHARS = 128
LAYOUT_ENTRIES = 256           # items of one map or list
SLOT_METADATA_BYTES = 17       # per host slot: slot_row i8, leases u4, retired, free stack i4


def layout(value: Any) -> dict[str, Any]:
    """A validated copy of a namespace layout; BadRequest naming the offending part."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"layout must be a map of strings to JSON-like values, got "
                         f"{type(value).__name__}")
    _check_value(value, "layout", 0)
    size = len(msgpack.packb(value, use_bin_type=True))
    if size > LAYOUT_BYTES:
        raise BadRequest(f"layout is {size} bytes packed; at most {LAYOUT_BYTES}: keep "
                         "per-block data out of the namespace layout")
    return dict(value)


def _check_value(value: Any, where: str, depth: int) -> None:
    if value is None or isinstance(value, (bool, str)):
        if isinstance(value, str) and len(value) > LAYOUT_BYTES:
            raise BadRequest(f"{where} is a string of {len(value)} characters; the whole "
                             f"layout is at most {LAYOUT_BYTES} bytes")
        return
    if isinstance(value, int):
        if not -(1 << 63) <= value < (1 << 64):
            raise BadRequest(f"{where} is an integer outside 64 bits")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise BadRequest(f"{where} is {value!r}; layout numbers must be finite (JSON)")
        return
    if depth >= LAYOUT_DEPTH and isinstance(value, (list, tuple, dict)):
        raise BadRequest(f"{where} nests deeper than {LAYOUT_DEPTH} levels")
    if isinstance(value, (list, tuple)):
        if len(value) > LAYOUT_ENTRIES:
            raise BadRequest(f"{where} has {len(value)} items; at most {LAYOUT_ENTRIES}")
        for i, item in enumerate(value):
            _check_value(item, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        if len(value) > LAYOUT_ENTRIES:
            raise BadRequest(f"{where} has {len(value)} entries; at most {LAYOUT_ENTRIES}")
        for k, item in value.items():
            if not isinstance(k, str):
                raise BadRequest(f"{where} has a key {k!r} of type {type(k).__name__}; layout "
                                 "keys are strings (JSON objects)")
            if not 0 < len(k) <= LAYOUT_KEY_CHARS:
                raise BadRequest(f"{where} has a key of {len(k)} characters; keys are 1 to "
                                 f"{LAYOUT_KEY_CHARS}")
            _check_value(item, f"{where}[{k!r}]", depth + 1)
        return
    raise BadRequest(f"{where} is of type {type(value).__name__}; layout values are strings, "
                     "numbers, booleans, null, lists and maps")


def host_slots(block_bytes: int, host_capacity: int, max_host_slots: int,
               slots_in_use: int = 0, max_slot_metadata: int | None = None) -> int:
    """The host pool's slot count for a new namespace, or CapacityError naming the settings.
    slots_in_use: the host slots of the namespaces already open, which max_slot_metadata
    (bytes, all namespaces together) bounds with the new one's."""
    n = host_capacity // block_bytes
    if n > max_host_slots:
        least = -(-host_capacity // max_host_slots)
        raise CapacityError(
            f"block_bytes={block_bytes} at host_capacity={host_capacity} needs {n:,} host slots "
            f"(~{n * SLOT_METADATA_BYTES >> 20} MiB of slot metadata); max_host_slots is "
            f"{max_host_slots:,}: use blocks of at least {least} bytes, or raise max_host_slots")
    if max_slot_metadata is not None and (slots_in_use + n) * SLOT_METADATA_BYTES \
            > max_slot_metadata:
        raise CapacityError(
            f"a namespace of {block_bytes}-byte blocks adds {n:,} host slots "
            f"({n * SLOT_METADATA_BYTES >> 10} KiB of slot metadata) to the {slots_in_use:,} "
            f"of the open namespaces, past max_slot_metadata ({max_slot_metadata} bytes): use "
            "larger blocks, fewer namespaces, a smaller host_capacity, or raise "
            "max_slot_metadata")
    return n


def namespace_count(existing: int, max_namespaces: int) -> None:
    if existing >= max_namespaces:
        raise NamespaceError(f"this service holds {existing} namespaces, max_namespaces is "
                             f"{max_namespaces}: delete unused ones' data or raise "
                             "max_namespaces")
