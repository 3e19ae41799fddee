"""Conversions shared by the sync and async clients: keys and blocks in, byte views out.

Accepted block inputs: bytes-like objects, lists of them, numpy arrays and torch tensors on the
CPU (any dtype; their bytes are what is stored). CUDA tensors are the GPU issue's and are refused
here with a message that says so. Nothing here copies unless the input is not contiguous.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from kvtier.checksums import block_checksums
from kvtier.errors import BadRequest


def pack_keys(keys: Any, width: int) -> bytes:
    """Keys as one packed buffer of fixed-width keys."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        raw = bytes(keys)
    elif isinstance(keys, np.ndarray):
        raw = np.ascontiguousarray(keys).tobytes()
    elif isinstance(keys, (list, tuple)):
        for k in keys:
            if len(k) != width:
                raise BadRequest(f"a key is {len(k)} bytes; this namespace's keys are {width}")
        raw = b"".join(bytes(k) for k in keys)
    else:
        raise BadRequest(f"keys must be bytes, a list of bytes or a numpy array, not "
                         f"{type(keys).__name__}")
    if len(raw) % width or not raw:
        raise BadRequest(f"packed keys are {len(raw)} bytes: not a non-empty multiple of the "
                         f"key width {width}")
    return raw


def as_u8(data: Any) -> np.ndarray:
    """A flat uint8 view of bytes-like data, a numpy array or a CPU torch tensor."""
    mod = type(data).__module__
    if mod.startswith("torch"):
        if data.device.type != "cpu":
            raise BadRequest("this call takes host data; CUDA tensors are accepted by "
                             "Namespace.get(out=...) and Namespace.put(blocks=...)")
        t = data.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        return t.view(-1).view(__import__("torch").uint8).numpy()
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if isinstance(data, (list, tuple)):
        return np.frombuffer(b"".join(bytes(memoryview(b).cast("B")) for b in data),
                             dtype=np.uint8)
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)


def blocks_view(data: Any, n: int, block_bytes: int, writable: bool = False) -> np.ndarray:
    """data as an (n, block_bytes) uint8 array; BadRequest when the size is wrong."""
    if (type(data) is np.ndarray and data.dtype == np.uint8 and data.shape == (n, block_bytes)
            and data.flags.c_contiguous and (data.flags.writeable or not writable)):
        return data                     # already the shape asked for: the latency path
    arr = as_u8(data)
    if arr.size != n * block_bytes:
        raise BadRequest(f"{arr.size} bytes for {n} blocks of {block_bytes}; each block must be "
                         f"exactly the namespace's block_bytes")
    if writable and not arr.flags.writeable:
        raise BadRequest("the output buffer is read-only; pass a writable array or tensor")
    return arr.reshape(n, block_bytes)


def checksums(blocks: np.ndarray) -> np.ndarray:
    """xxh3-64 of each row."""
    return block_checksums(blocks)
