"""MultiHeadAttention.from_torch / to_torch: weights move both ways, outputs equal PyTorch's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnkit import masks
from attnkit.nn import MultiHeadAttention

# fp32, O(1) inputs, embed 16: both sides do the same projections and a softmax over <= 7 keys
# in a different order of operations; differences are a few ulp. The issue asks for 1e-5.
CLOSE = dict(atol=1e-5, rtol=1e-5)
B, L, S, E, H = 2, 5, 7, 16, 4


def _torch_masks(kind: str, g: torch.Generator, *, self_attention: bool):
    """PyTorch's masks (True = ignore), with every query keeping at least one key."""
    keys = L if self_attention else S
    kpm = am = None
    if "kpm" in kind:
        kpm = torch.zeros(B, keys, dtype=torch.bool)
        kpm[1, -2:] = True  # the second sequence is padded
        if "float" in kind:
            kpm = torch.zeros(B, keys).masked_fill(kpm, float("-inf")) + torch.randn(B, keys, generator=g)
    if "attn" in kind:
        am = torch.rand(L, keys, generator=g) < 0.4
        am[:, 0] = False
        if "3d" in kind:
            am = am.expand(B * H, L, keys).clone()
            am[1, :, 1] = True  # a different mask for one (batch, head)
        if "float" in kind:
            am = torch.randn(*am.shape, generator=g).masked_fill(am, float("-inf"))
    return kpm, am


def _our_mask(kpm, am):
    return masks.combine(
        None if kpm is None else masks.from_torch_key_padding_mask(kpm),
        None if am is None else masks.from_torch_attn_mask(am, num_heads=H),
    )


MASKS = ["none", "kpm", "kpm-float", "attn", "attn-float", "attn-3d", "kpm+attn", "kpm-float+attn-float"]


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("mode", ["train", "eval", "eval-no-grad"])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("self_attention", [True, False])
def test_from_torch_matches_torch(mask_kind, mode, need_weights, self_attention):
    g = torch.Generator().manual_seed(2 * MASKS.index(mask_kind) + self_attention)
    torch.manual_seed(0)
    kdim, vdim = (None, None) if self_attention else (6, 3)
    theirs = nn.MultiheadAttention(E, H, batch_first=True, kdim=kdim, vdim=vdim)
    with torch.no_grad():  # PyTorch starts with zero biases; make them matter
        theirs.in_proj_bias.normal_(generator=g)
        theirs.out_proj.bias.normal_(generator=g)
    theirs.train(mode == "train")
    ours = MultiHeadAttention.from_torch(theirs)
    assert ours.training == theirs.training

    query = torch.randn(B, L, E, generator=g)
    key = query if self_attention else torch.randn(B, S, 6, generator=g)
    value = query if self_attention else torch.randn(B, S, 3, generator=g)
    kpm, am = _torch_masks(mask_kind, g, self_attention=self_attention)
    with torch.set_grad_enabled(mode != "eval-no-grad"):
        expected, expected_weights = theirs(query, key, value, key_padding_mask=kpm, attn_mask=am,
                                            need_weights=need_weights, average_attn_weights=False)
        kv = {} if self_attention else dict(key=key, value=value)
        result = ours(query, **kv, mask=_our_mask(kpm, am), need_weights=need_weights)
    output = result[0] if need_weights else result
    torch.testing.assert_close(output, expected, **CLOSE)
    if need_weights:
        torch.testing.assert_close(result[1], expected_weights, **CLOSE)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("bias", [True, False])
def test_to_torch_matches_ours_including_gqa_and_mqa(num_kv_heads, bias):
    torch.manual_seed(1)
    ours = MultiHeadAttention(E, H, num_kv_heads=num_kv_heads, bias=bias)
    theirs = ours.to_torch()
    assert theirs.batch_first and (theirs.in_proj_bias is not None) == bias
    query = torch.randn(B, L, E)
    padded = torch.tensor([[False] * L, [False] * (L - 2) + [True] * 2])
    expected, weights = theirs(query, query, query, key_padding_mask=padded, average_attn_weights=False)
    output, our_weights = ours(query, mask=masks.from_torch_key_padding_mask(padded), need_weights=True)
    torch.testing.assert_close(output, expected, **CLOSE)
    torch.testing.assert_close(our_weights, weights, **CLOSE)


def test_round_trip_keeps_the_weights_exactly():
    torch.manual_seed(2)
    ours = MultiHeadAttention(E, H, kdim=5, vdim=9)
    back = MultiHeadAttention.from_torch(ours.to_torch())
    for name, parameter in ours.named_parameters():
        assert torch.equal(parameter, back.get_parameter(name)), name


def test_fully_masked_rows_give_zeros_where_torch_gives_nan():
    torch.manual_seed(3)
    theirs = nn.MultiheadAttention(E, H, batch_first=True, bias=False)
    ours = MultiHeadAttention.from_torch(theirs)
    query = torch.randn(B, L, E, requires_grad=True)
    padded = torch.zeros(B, L, dtype=torch.bool)
    padded[1] = True  # the second sequence has no key at all
    expected, _ = theirs(query, query, query, key_padding_mask=padded, need_weights=True)
    assert expected[1].isnan().all(), "PyTorch's materialised path gives NaN here (documented difference)"
    output, weights = ours(query, mask=masks.from_torch_key_padding_mask(padded), need_weights=True)
    assert (output[1] == 0).all() and (weights[1] == 0).all()  # no bias: the zero heads stay zero
    torch.testing.assert_close(output[0], expected[0], **CLOSE)
    output.sum().backward()
    assert torch.isfinite(query.grad).all()


def test_unsupported_torch_features_are_refused():
    with pytest.raises(ValueError, match="add_bias_kv=True and add_zero_attn=True"):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(E, H, add_bias_kv=True))
    with pytest.raises(TypeError, match="must be a torch.nn.MultiheadAttention"):
        MultiHeadAttention.from_torch(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs head_dim = value_head_dim = embed_dim // num_heads"):
        MultiHeadAttention(E, H, head_dim=3).to_torch()
    with pytest.raises(ValueError, match="needs head_dim"):
        MultiHeadAttention(E, H, output_projection=False).to_torch()
