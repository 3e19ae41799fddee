"""Host-side rows= and Pages for Namespace.get/put, against a real `kvtier serve`.

The shapes are vLLM's: a CPU KV cache per layer (num_blocks, heads, block_size, 2 * head) and
a K/V-split one (2, num_blocks, ...), as numpy arrays and CPU torch tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.api.client import Client
from kvtier.api.layouts import Pages
from kvtier.errors import BadRequest, NamespaceError
from tests.conftest import keys


def _layers(n_layers: int, num_blocks: int, seed: int, split: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, 2, 4, 8) if split else (num_blocks, 2, 4, 16)
    return [torch.randn(shape, generator=g, dtype=torch.bfloat16) for _ in range(n_layers)]


def _block(layers: list[torch.Tensor], b: int, split: bool = False) -> bytes:
    if split:
        return b"".join(t[kv, b].contiguous().view(torch.uint8).numpy().tobytes()
                        for t in layers for kv in (0, 1))
    return b"".join(t[b].contiguous().view(torch.uint8).numpy().tobytes() for t in layers)


@pytest.mark.parametrize("split", [False, True])
def test_pages_put_then_get_into_other_block_ids(service, split):
    src = _layers(3, 16, seed=1, split=split)
    dst = _layers(3, 16, seed=2, split=split)
    pages_src = Pages.from_layers(src, block_dim=1 if split else 0)
    pages_dst = Pages.from_layers(dst, block_dim=1 if split else 0)
    untouched = [t.clone() for t in dst]
    with Client(service.socket) as c:
        ns = c.namespace("pages", block_bytes=pages_src.block_bytes, key_width=32)
        ns.put(keys(range(5), 32), pages_src, rows=[3, 4, 5, 9, 1])
        # The blocks are the engine's bytes, in page order.
        _, plain = ns.get(keys(range(5), 32))
        assert [plain[i].tobytes() for i in range(5)] == [_block(src, b, split)
                                                           for b in (3, 4, 5, 9, 1)]
        found, _ = ns.get(keys([0, 1, 2, 77, 4], 32), out=pages_dst, rows=[0, 1, 2, 7, 15])
    assert found.tolist() == [True, True, True, False, True]
    for b_dst, b_src in ((0, 3), (1, 4), (2, 5), (15, 1)):
        assert _block(dst, b_dst, split) == _block(src, b_src, split)
    for b in set(range(16)) - {0, 1, 2, 15}:        # the missing key's block 7 too
        assert _block(dst, b, split) == _block(untouched, b, split)


def test_rows_into_a_numpy_row_buffer_and_scattered_slots(service):
    rng = np.random.default_rng(0)
    buf = rng.integers(0, 256, (40, 512), dtype=np.uint8)
    with Client(service.socket) as c:
        ns = c.namespace("rows", block_bytes=512)
        rows = rng.permutation(40)[:24]                    # scattered: the fancy-copy branch
        ns.put(keys(range(24)), buf, rows=rows)
        out = np.zeros((40, 512), dtype=np.uint8)
        found, got = ns.get(keys(range(24)), out=out, rows=np.arange(24)[::-1], verify=True)
    assert found.all() and got is out
    for i in range(24):
        assert (out[23 - i] == buf[rows[i]]).all()
    assert not out[24:].any()


def test_pages_through_pipelined_chunks(service):
    # More keys than two chunks: pipeline.put / pipeline.get with the page moves.
    src = [np.random.default_rng(s).integers(0, 256, (3000, 1, 64), dtype=np.uint8)
           for s in (1, 2)]
    dst = [np.zeros_like(t) for t in src]
    with Client(service.socket) as c:
        ns = c.namespace("chunks", block_bytes=128)
        ns.put(keys(range(2500)), Pages.from_layers(src), rows=np.arange(2500) + 500)
        found, _ = ns.get(keys(range(2500)), out=Pages.from_layers(dst), rows=np.arange(2500))
    assert found.all()
    for s, d in zip(src, dst):
        assert (d[:2500] == s[500:]).all()


def test_inline_handle_moves_pages_too(service):
    src = _layers(2, 8, seed=3)
    dst = _layers(2, 8, seed=4)
    pages = Pages.from_layers(src)
    with Client(service.socket) as c:
        ns = c.namespace("inline-pages", block_bytes=pages.block_bytes, inline=True)
        ns.put(keys(range(2)), pages, rows=[6, 7])
        found, _ = ns.get(keys([0, 1]), out=Pages.from_layers(dst), rows=[1, 2])
    assert found.all()
    assert _block(dst, 1) == _block(src, 6) and _block(dst, 2) == _block(src, 7)


def test_garbage_rows_and_pages_are_refused(service):
    src = _layers(2, 8, seed=5)
    pages = Pages.from_layers(src)
    with Client(service.socket) as c:
        ns = c.namespace("garbage", block_bytes=pages.block_bytes)
        with pytest.raises(BadRequest, match="outside"):
            ns.put(keys(range(2)), pages, rows=[0, 8])
        with pytest.raises(BadRequest, match="integer block ids"):
            ns.put(keys(range(2)), pages, rows=[0.5, 1])
        with pytest.raises(BadRequest, match="one per key"):
            ns.get(keys(range(2)), out=pages, rows=[0])
        with pytest.raises(BadRequest, match="pass out"):
            ns.get(keys(range(2)), rows=[0, 1])
        with pytest.raises(BadRequest, match="KV layout"):
            c.namespace("garbage-small", block_bytes=64).put(keys(range(1)), pages, rows=[0])
        ro = np.zeros((8, pages.block_bytes), dtype=np.uint8)
        ro.flags.writeable = False
        with pytest.raises(BadRequest, match="read-only"):
            ns.get(keys(range(1)), out=ro, rows=[0])
        strided = np.zeros((8, 2 * pages.block_bytes), dtype=np.uint8)[:, ::2]
        with pytest.raises(BadRequest, match="contiguous"):
            ns.get(keys(range(1)), out=strided, rows=[0])
        assert ns.match_prefix(keys(range(2))) == 0          # nothing half-stored


def test_namespace_with_another_layout_of_the_same_size_is_refused(service):
    a = {"kv_layout": "LBHNC", "dtype": "bfloat16", "block_size": 32}
    b = {**a, "kv_layout": "BLHNC"}
    with Client(service.socket) as c:
        c.namespace("layout", block_bytes=4096, key_width=32, layout=a)
        assert c.namespace("layout", block_bytes=4096, key_width=32, layout=a).layout == a
        with pytest.raises(NamespaceError) as err:
            c.namespace("layout", block_bytes=4096, key_width=32, layout=b)
        assert "LBHNC" in str(err.value) and "BLHNC" in str(err.value)
    service.stop()
    service.start()             # the stored layout survives a restart
    with Client(service.socket) as c:
        with pytest.raises(NamespaceError, match="BLHNC"):
            c.namespace("layout", block_bytes=4096, key_width=32, layout=b)
        assert c.namespace("layout").layout == a
