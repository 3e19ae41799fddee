"""kvtier.api.layouts: the Pages descriptor of blocks spread over per-layer tensors."""

import numpy as np
import pytest
import torch

from kvtier.api.layouts import Pages
from kvtier.errors import BadRequest


def test_from_layers_kv_split_orders_pages_layer_then_kv():
    layers = [torch.arange(2 * 4 * 3 * 8, dtype=torch.float16).reshape(2, 4, 3, 8) + 1000 * i
              for i in range(2)]
    p = Pages.from_layers(layers, block_dim=1)
    assert p.num_blocks == 4
    assert p.page_bytes == (48, 48, 48, 48)
    assert p.block_bytes == 192
    # page 3 of block 2 is layer 1's V page of block 2
    assert torch.equal(p.views[3][2], layers[1][1, 2].reshape(-1).view(torch.uint8))
    p.views[0][1].fill_(0)                       # a view, not a copy
    assert (layers[0][0, 1] == 0).all()


def test_from_layers_numpy_block_first():
    layers = [np.zeros((5, 2, 16), np.float32) for _ in range(3)]
    p = Pages.from_layers(layers)
    assert p.page_bytes == (128, 128, 128) and p.num_blocks == 5
    p.views[2][4, :] = 7
    assert (layers[2][4].view(np.uint8) == 7).all()


def test_non_contiguous_page_is_refused():
    t = torch.zeros(4, 8, 6).transpose(1, 2)
    with pytest.raises(BadRequest, match="contiguous"):
        Pages.from_layers([t])


def test_views_must_cover_the_same_blocks():
    with pytest.raises(BadRequest, match="same blocks"):
        Pages((np.zeros((3, 8), np.uint8), np.zeros((4, 8), np.uint8)))
