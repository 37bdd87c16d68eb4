"""Mask builders and converters, checked against explicit definitions and PyTorch's conventions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from attnkit import masks


@given(lq=st.integers(0, 12), lk=st.integers(0, 12))
def test_causal_mask_is_bottom_right(lq, lk):
    mask = masks.causal_mask(lq, lk)
    assert mask.shape == (lq, lk) and mask.dtype == torch.bool
    for i in range(lq):
        for j in range(lk):
            assert bool(mask[i, j]) == (j <= i + lk - lq)


def test_causal_mask_square_is_lower_triangle_and_draws():
    assert torch.equal(masks.causal_mask(4), torch.ones(4, 4).tril().bool())
    assert masks.to_string(masks.causal_mask(2, 5)) == "# # # # .\n# # # # #"
    assert masks.to_string(masks.causal_mask(3, 2)).splitlines() == [". .", "# .", "# #"]


def test_padding_mask_from_lengths_and_keep():
    lengths = torch.tensor([3, 1, 4])
    mask = masks.padding_mask(lengths)
    assert mask.shape == (3, 1, 1, 4)
    expected = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask[:, 0, 0], expected)
    assert torch.equal(masks.padding_mask(expected, ndim=3), expected[:, None, :])
    assert masks.padding_mask(lengths, key_length=6).shape == (3, 1, 1, 6)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 2\]"):
        masks.padding_mask(lengths, key_length=2)
    with pytest.raises(TypeError, match=r"lengths must be a 1-D sequence of ints \[B\], got a torch.float32 tensor"):
        masks.lengths_to_keep(torch.tensor([1.5]))


def test_padding_mask_matches_pytorch_key_padding_mask():
    """attnkit's padding mask fed to attention equals SDPA/MHA semantics with PyTorch's True = ignore."""
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(3, 2, 5, 4, generator=g) for _ in range(3))
    torch_kpm = torch.tensor([[False] * 5, [False, False, True, True, True], [False] * 4 + [True]])
    ours = masks.from_torch_key_padding_mask(torch_kpm)
    assert torch.equal(ours, masks.padding_mask(torch.tensor([5, 2, 4])))
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=~torch_kpm[:, None, None])
    torch.testing.assert_close(attnkit.attention(query, key, value, mask=ours), expected)


def test_from_torch_attn_mask_inverts_bool_and_splits_heads():
    bool_mask = torch.tensor([[False, True], [False, False]])
    assert torch.equal(masks.from_torch_attn_mask(bool_mask), ~bool_mask)
    per_head = torch.zeros(6, 3, 4)
    assert masks.from_torch_attn_mask(per_head, num_heads=3).shape == (2, 3, 3, 4)
    with pytest.raises(ValueError, match="num_heads"):
        masks.from_torch_attn_mask(per_head)


def test_bool_additive_round_trip_and_combine():
    keep = torch.tensor([[True, False], [True, True]])
    additive = masks.to_additive(keep)
    assert additive.dtype == torch.float32
    assert torch.equal(additive, torch.tensor([[0.0, float("-inf")], [0.0, 0.0]]))
    assert torch.equal(masks.to_bool(additive), keep)
    other = torch.tensor([[True, True], [False, True]])
    assert torch.equal(masks.combine(keep, None, other), keep & other)
    bias = torch.tensor([[0.5, 0.5], [1.0, -1.0]])
    mixed = masks.combine(keep, bias)
    assert torch.equal(mixed, torch.tensor([[0.5, float("-inf")], [1.0, -1.0]]))
    assert masks.combine(None, None) is None
    assert masks.combine(keep[None], masks.causal_mask(2)).shape == (1, 2, 2)


@given(seed=st.integers(0, 10_000))
def test_bool_and_additive_forms_give_the_same_attention(seed):
    g = torch.Generator().manual_seed(seed)
    query, key, value = torch.randn(4, 3, generator=g), torch.randn(5, 3, generator=g), torch.randn(5, 2, generator=g)
    keep = torch.rand(4, 5, generator=g) < 0.5
    torch.testing.assert_close(attnkit.attention(query, key, value, mask=keep),
                               attnkit.attention(query, key, value, mask=masks.to_additive(keep)))
