"""The seed formulations of multi-head attention are one computation.

A list of heads (seeds 000, 002), stacked per-head weights used with bmm (seed 001) and one
matrix split into heads (seeds 002, 003) agree to 1e-6 in fp32, and all equal a float64
computation written here from the weights with the test oracle.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnkit.nn import HeadList, MultiHeadAttention, SelfAttention, StackedHeads
from oracle import oracle_attention

# Same weights, same inputs, only the order of fp32 sums differs (per-head vs fused matmuls of
# <= 8 terms, O(1) values): a few ulp of 1.2e-7 apart, so 1e-6 is tight but safe.
SAME = dict(atol=1e-6, rtol=1e-6)
# Against float64: fp32 rounding of projections, softmax and sums, O(1) values: ~1e-6.
FP32 = dict(atol=1e-5, rtol=1e-5)


@st.composite
def setups(draw):
    heads = draw(st.integers(1, 4))
    d_in, d_qk, d_v = draw(st.integers(1, 6)), draw(st.integers(1, 5)), draw(st.integers(1, 5))
    d_context = draw(st.integers(1, 6))
    lq, lk = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    cross = draw(st.booleans())
    batch = draw(st.sampled_from([None, 1, 2]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the layer's initial weights
    lead = () if batch is None else (batch,)
    x = torch.randn(*lead, lq, d_in, generator=g)
    context = torch.randn(*lead, lk, d_context, generator=g) if cross else None
    keys = lk if cross else lq
    mask_kind = draw(st.sampled_from(["none", "shared", "per-head", "additive"]))
    mask = None
    if mask_kind == "shared":
        mask = torch.rand(lq, keys, generator=g) < 0.7
    elif mask_kind == "per-head":
        mask = torch.rand(*lead, heads, lq, keys, generator=g) < 0.7
    elif mask_kind == "additive":
        mask = torch.randn(*lead, 1, lq, keys, generator=g)
    stacked = StackedHeads(d_in, d_qk, heads, d_v, d_context=d_context if cross else None,
                           causal=draw(st.booleans()))
    return stacked, x, context, mask


def _heads_from_stacked(stacked: StackedHeads) -> HeadList:
    listed = HeadList(stacked.d_in, stacked.d_qk, stacked.num_heads, stacked.d_v, d_context=stacked.d_context,
                      causal=stacked.causal)
    with torch.no_grad():
        for h, head in enumerate(listed.heads):
            head.q_proj.weight.copy_(stacked.w_query[h])
            head.k_proj.weight.copy_(stacked.w_key[h])
            head.v_proj.weight.copy_(stacked.w_value[h])
    return listed


def _float64_reference(stacked, x, context, mask):
    """Per head: project with the stacked matrices, attend with the float64 oracle, concatenate."""
    x = x.double()
    context = x if context is None else context.double()
    outputs, weights = [], []
    for h in range(stacked.num_heads):
        w_q, w_k, w_v = (w[h].detach().double() for w in (stacked.w_query, stacked.w_key, stacked.w_value))
        head_mask = mask if mask is None or mask.dim() < 3 else mask.select(-3, min(h, mask.shape[-3] - 1))
        out, weight = oracle_attention(x @ w_q.T, context @ w_k.T, context @ w_v.T, mask=head_mask,
                                       causal=stacked.causal, scale=1 / math.sqrt(stacked.d_qk))
        outputs.append(out)
        weights.append(weight)
    return torch.cat(outputs, -1), torch.stack(weights, -3)


@given(setup=setups())
def test_list_of_heads_stacked_weights_and_split_matrix_agree(setup):
    stacked, x, context, mask = setup
    listed = _heads_from_stacked(stacked)
    fused_from_stacked = MultiHeadAttention.from_stacked(stacked.w_query, stacked.w_key, stacked.w_value,
                                                         causal=stacked.causal)
    fused_from_heads = MultiHeadAttention.from_heads(listed)
    expected_out, expected_w = _float64_reference(stacked, x, context, mask)

    results = {
        "stacked": stacked(x, context, mask=mask, need_weights=True),
        "list": listed(x, context, mask=mask, need_weights=True),
        "fused from stacked": fused_from_stacked(x, context, mask=mask, need_weights=True),
        "fused from heads": fused_from_heads(x, context, mask=mask, need_weights=True),
    }
    base_out, base_w = results["stacked"]
    for name, (out, weights) in results.items():
        assert out.shape == expected_out.shape and weights.shape == expected_w.shape, name
        torch.testing.assert_close(out, base_out, **SAME, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(weights, base_w, **SAME, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(out.double(), expected_out, **FP32, msg=lambda m: f"{name}: {m}")
        # The fast path (no weights) computes the same output.
        fast = {"stacked": stacked, "list": listed, "fused from stacked": fused_from_stacked,
                "fused from heads": fused_from_heads}[name](x, context, mask=mask)
        torch.testing.assert_close(fast, base_out, **FP32, msg=lambda m: f"{name} without weights: {m}")


def test_seed001_bmm_formula_equals_stacked_heads():
    """Seed 001's literal code: stacked inputs, torch.bmm with the [H, d_out, d_in] weights."""
    g = torch.Generator().manual_seed(0)
    stacked = StackedHeads(16, 24, 3, d_v=28)
    sentence = torch.randn(9, 16, generator=g)
    with torch.no_grad():
        stacked_inputs = sentence.T.repeat(3, 1, 1)  # [3, 16, 9]
        keys = torch.bmm(stacked.w_key, stacked_inputs).permute(0, 2, 1)
        values = torch.bmm(stacked.w_value, stacked_inputs).permute(0, 2, 1)
        queries = torch.bmm(stacked.w_query, stacked_inputs).permute(0, 2, 1)
        omega = torch.bmm(queries, keys.transpose(1, 2))
        weights = torch.softmax(omega / 24**0.5, dim=-1)
        expected = torch.bmm(weights, values).permute(1, 0, 2).reshape(9, 3 * 28)
        torch.testing.assert_close(stacked(sentence), expected, atol=1e-5, rtol=1e-5)
        fused = MultiHeadAttention.from_stacked(stacked.w_query, stacked.w_key, stacked.w_value)
        torch.testing.assert_close(fused(sentence), expected, atol=1e-5, rtol=1e-5)


def test_list_with_output_projection_and_biases_converts_exactly():
    torch.manual_seed(0)
    listed = HeadList(8, 3, 4, d_v=2, qkv_bias=True, out_dim=5, causal=True)
    fused = MultiHeadAttention.from_heads(listed)
    assert fused.causal and isinstance(fused.out_proj, torch.nn.Linear) and fused.out_proj.out_features == 5
    x = torch.randn(2, 7, 8)
    torch.testing.assert_close(fused(x), listed(x), **SAME)
    # A plain Python list of heads works too (no output projection then).
    plain = MultiHeadAttention.from_heads(list(listed.heads))
    torch.testing.assert_close(plain(x), torch.cat([h(x) for h in listed.heads], -1), **SAME)


def test_from_heads_refuses_heads_that_differ():
    with pytest.raises(ValueError, match=r"same \(d_in, d_context, d_qk, d_v, causal, dropout\)"):
        MultiHeadAttention.from_heads([SelfAttention(4, 2), SelfAttention(4, 3)])
    with pytest.raises(TypeError, match="HeadList or a non-empty sequence of SelfAttention"):
        MultiHeadAttention.from_heads([])
