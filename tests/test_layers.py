"""The layers themselves: against a float64 reference, every dtype and device, compile, steps, errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from attnkit import masks, trace
from attnkit.nn import HeadList, KVCache, MultiHeadAttention, SelfAttention, StackedHeads
from oracle import oracle_attention

FP32 = dict(atol=1e-5, rtol=1e-5)  # fp32 vs float64, O(1) values, short sums: a few ulp


def _reference(layer: MultiHeadAttention, query, key, value, dtype=torch.float64, **kwargs):
    """MultiHeadAttention written out with plain ops and the test oracle, in ``dtype``."""
    def linear(x, module):
        return F.linear(x.to(dtype), module.weight.to(dtype), None if module.bias is None else module.bias.to(dtype))

    batch, lq, lk = query.shape[0], query.shape[1], key.shape[1]
    q = linear(query, layer.q_proj).view(batch, lq, layer.num_heads, layer.head_dim).transpose(1, 2)
    k = linear(key, layer.k_proj).view(batch, lk, layer.num_kv_heads, layer.head_dim).transpose(1, 2)
    v = linear(value, layer.v_proj).view(batch, lk, layer.num_kv_heads, layer.value_head_dim).transpose(1, 2)
    heads, weights = oracle_attention(q, k, v, dtype=dtype, **kwargs)
    concatenated = heads.transpose(1, 2).reshape(batch, lq, -1)
    return linear(concatenated, layer.out_proj), weights


@given(
    heads_and_kv=st.sampled_from([(1, 1), (2, 2), (4, 2), (4, 1), (6, 3)]),
    head_dim=st.integers(1, 4), lq=st.integers(1, 7), lk=st.integers(1, 7), batch=st.integers(1, 2),
    cross=st.booleans(), causal=st.booleans(), padded=st.booleans(), seed=st.integers(0, 2**16),
)
def test_multi_head_attention_matches_a_float64_reference(heads_and_kv, head_dim, lq, lk, batch, cross, causal,
                                                          padded, seed):
    heads, kv_heads = heads_and_kv
    torch.manual_seed(seed)
    layer = MultiHeadAttention(heads * head_dim, heads, num_kv_heads=kv_heads, kdim=5 if cross else None,
                               vdim=3 if cross else None)
    query = torch.randn(batch, lq, heads * head_dim)
    key = torch.randn(batch, lk, 5) if cross else query
    value = torch.randn(batch, lk, 3) if cross else query
    keys = lk if cross else lq
    mask = masks.padding_mask(torch.randint(0, keys + 1, (batch,)), keys) if padded else None
    expected, expected_weights = _reference(layer, query, key, value, mask=mask, causal=causal)
    kv = dict(key=key, value=value) if cross else {}
    output, weights = layer(query, **kv, mask=mask, causal=causal, need_weights=True)
    torch.testing.assert_close(output.double(), expected, **FP32)
    torch.testing.assert_close(weights.double(), expected_weights, **FP32)
    torch.testing.assert_close(layer(query, **kv, mask=mask, causal=causal).double(), expected, **FP32)


def test_bfloat16_within_twice_the_plain_computation_error():
    """FlashAttention's rule: our bf16 error against float64 is at most twice that of the
    same layer written with plain ops in bf16."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(64, 4, num_kv_heads=2)
    query = torch.randn(2, 33, 64)
    exact, _ = _reference(layer, query, query, query, causal=True)
    plain, _ = _reference(layer, query, query, query, dtype=torch.bfloat16, causal=True)
    low = layer.to(torch.bfloat16)
    for need_weights in (False, True):
        result = low(query.bfloat16(), causal=True, need_weights=need_weights)
        output = result[0] if need_weights else result
        assert output.dtype == torch.bfloat16
        error = (output.double() - exact).abs().max()
        assert error <= 2 * (plain.double() - exact).abs().max() + 2**-8


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_every_layer_keeps_dtype_and_device(dtype):
    """float64/bf16/fp16 on CPU, and the meta device: no hidden float32 or CPU tensors inside."""
    for device in ("cpu", "meta"):
        x = torch.randn(2, 5, 8, dtype=dtype, device=device)
        layers = [SelfAttention(8, 4, 3, dtype=dtype, device=device), HeadList(8, 4, 2, out_dim=8, dtype=dtype,
                  device=device), StackedHeads(8, 4, 2, dtype=dtype, device=device),
                  MultiHeadAttention(8, 2, num_kv_heads=1, dtype=dtype, device=device)]
        for layer in layers:
            output, weights = layer(x, need_weights=True, mask=torch.ones(5, 5, dtype=torch.bool, device=device))
            assert output.dtype == weights.dtype == dtype and output.device == x.device
        mha = layers[-1]
        cache = mha.new_cache(2, 6)
        assert cache.keys.dtype == dtype and cache.keys.device == x.device
        assert mha(x, cache=cache).shape == (2, 5, 8)


LAYERS = {
    "SelfAttention": lambda: SelfAttention(8, 4, 3, qkv_bias=True),
    "HeadList": lambda: HeadList(8, 4, 2, out_dim=8),
    "StackedHeads": lambda: StackedHeads(8, 4, 2),
    "MultiHeadAttention": lambda: MultiHeadAttention(8, 2),
    "GQA": lambda: MultiHeadAttention(8, 4, num_kv_heads=2, head_dim=3),
}


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("training", [False, True])
def test_compiles_without_graph_breaks(name, training):
    layer = LAYERS[name]().train(training)
    x = torch.randn(2, 6, 8)
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), layer(x))


def test_multi_head_weights_and_mask_path_compiles():
    layer = MultiHeadAttention(8, 4, num_kv_heads=2)
    x = torch.randn(2, 6, 8)
    mask = masks.padding_mask(torch.tensor([6, 3]))
    for grad in (True, False):  # the weights path is out of place with autograd, in place without
        with torch.set_grad_enabled(grad):
            compiled = torch.compile(lambda x: layer(x, mask=mask, causal=True, need_weights=True), fullgraph=True,
                                     backend="eager")
            for ours, expected in zip(compiled(x), layer(x, mask=mask, causal=True, need_weights=True)):
                torch.testing.assert_close(ours, expected)


def test_each_layer_call_is_one_traced_call_with_named_intermediates():
    layer = MultiHeadAttention(12, 4, num_kv_heads=2, vdim=5, value_head_dim=2)
    query, key, memory = torch.randn(2, 3, 12), torch.randn(2, 7, 12), torch.randn(2, 7, 5)
    with trace.record() as recorded:
        output = layer(query, key, memory)
    assert len(recorded) == 1 and recorded[0].module is layer and recorded[0].layer == 0
    shapes = {name: tuple(t.shape) for name, t in recorded[0].steps.items()}
    names = ("inputs", "queries", "keys", "values", "heads", "concatenated", "projected")
    assert {name: shapes[name] for name in names} == {
        "inputs": (2, 3, 12), "queries": (2, 4, 3, 3), "keys": (2, 2, 7, 3), "values": (2, 2, 7, 2),
        "heads": (2, 4, 3, 2), "concatenated": (2, 3, 8), "projected": (2, 3, 12),
    }
    assert shapes["weights"] == (2, 4, 3, 7)  # the core's steps land in the layer's call
    torch.testing.assert_close(recorded[0]["projected"], output)

    stacked, listed = StackedHeads(12, 3, 2), HeadList(12, 3, 2, out_dim=4)
    with trace.record() as recorded:
        stacked(query)
        listed(query)
    assert [call.module for call in recorded] == [stacked, *listed.heads]  # a list's heads are separate calls
    assert recorded[0]["concatenated"].shape == (2, 3, 6) and recorded[0]["weights"].shape == (2, 2, 3, 3)


def test_dropout_only_in_training():
    layer = MultiHeadAttention(16, 4, dropout=0.5)
    x = torch.randn(2, 9, 16)
    eval_out = layer.eval()(x)
    torch.testing.assert_close(layer(x), eval_out)
    torch.manual_seed(0)
    _, weights = layer.train()(x, need_weights=True)
    assert 0.3 < (weights == 0).float().mean() < 0.7  # ~ half of 648 weights dropped
    assert not torch.allclose(layer(x), eval_out)


def test_unbatched_inputs_and_per_query_mask():
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 2)
    x = torch.randn(5, 8)
    mask = masks.causal_mask(5)
    output, weights = layer(x, mask=mask, need_weights=True)
    assert output.shape == (5, 8) and weights.shape == (2, 5, 5)
    batched, batched_weights = layer(x[None], causal=True, need_weights=True)
    torch.testing.assert_close(output, batched[0])
    torch.testing.assert_close(weights, batched_weights[0])


def test_causal_default_and_override():
    layer = MultiHeadAttention(8, 2, causal=True)
    x = torch.randn(1, 4, 8)
    _, weights = layer(x, need_weights=True)
    assert (weights[..., 0, 1:] == 0).all()
    _, weights = layer(x, causal=False, need_weights=True)
    assert (weights[..., 0, 1:] > 0).all()


def test_extra_repr_describes_each_layer():
    assert "embed_dim=8, num_heads=4, num_kv_heads=2, head_dim=2" in repr(MultiHeadAttention(8, 4, num_kv_heads=2))
    assert "out_dim=3" in repr(MultiHeadAttention(8, 4, out_dim=3))
    assert "output_projection=False" in repr(MultiHeadAttention(8, 4, output_projection=False))
    assert "d_in=3, d_qk=2, d_v=2, causal=True" in repr(SelfAttention(3, 2, causal=True))
    assert "num_heads=3, d_in=16, d_qk=24, d_v=28" in repr(StackedHeads(16, 24, 3, d_v=28))
    assert "num_heads=2" in repr(HeadList(4, 2, 2))
    assert "max_length=5" in repr(KVCache(1, 5, 2, 4))


BAD = {
    "embed not divisible": (ValueError, r"embed_dim \(10\) must be divisible by num_heads \(4\)",
                            lambda: MultiHeadAttention(10, 4)),
    "kv heads not dividing": (ValueError, r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)",
                              lambda: MultiHeadAttention(8, 4, num_kv_heads=3)),
    "zero heads": (ValueError, r"num_heads must be a positive int, got 0", lambda: MultiHeadAttention(8, 0)),
    "dropout": (ValueError, r"dropout must be a float in \[0, 1\), got 1.5", lambda: SelfAttention(3, 2, dropout=1.5)),
    "backend": (ValueError, r"unknown backend 'flash'", lambda: MultiHeadAttention(8, 2, backend="flash")),
    "out_dim without projection": (ValueError, r"without an output projection the output has .* = 8 features",
                                   lambda: MultiHeadAttention(8, 2, out_dim=4, output_projection=False)),
    "query features": (ValueError, r"query must be \[B, L, 8\] or \[L, 8\], got shape \(2, 3, 7\)",
                       lambda: MultiHeadAttention(8, 2)(torch.randn(2, 3, 7))),
    "query rank": (ValueError, r"query must be \[B, L, 8\] or \[L, 8\], got shape \(1, 2, 3, 8\)",
                   lambda: MultiHeadAttention(8, 2)(torch.randn(1, 2, 3, 8))),
    "key features": (ValueError, r"key must be \[B, L, 5\] or \[L, 5\], got shape \(2, 4, 8\)",
                     lambda: MultiHeadAttention(8, 2, kdim=5)(torch.randn(2, 3, 8), torch.randn(2, 4, 8))),
    "key batch": (ValueError, r"key must have the query's batch dims \(2,\).*got key \(3, 4, 8\)",
                  lambda: MultiHeadAttention(8, 2)(torch.randn(2, 3, 8), torch.randn(3, 4, 8))),
    "value length": (ValueError, r"key and value must have the same batch and length.*key \(2, 4, 8\).*\(2, 5, 8\)",
                     lambda: MultiHeadAttention(8, 2)(torch.randn(2, 3, 8), torch.randn(2, 4, 8),
                                                      torch.randn(2, 5, 8))),
    "self-attention with kdim": (ValueError, r"key \(defaulting to query\) must be \[B, L, 5\]",
                                lambda: MultiHeadAttention(8, 2, kdim=5)(torch.randn(2, 3, 8))),
    "value defaulting to key": (ValueError, r"value \(defaulting to key\) must be \[B, L, 3\]",
                                lambda: MultiHeadAttention(8, 2, vdim=3)(torch.randn(2, 3, 8), torch.randn(2, 4, 8))),
    "value without key": (ValueError, r"value was given without key",
                          lambda: MultiHeadAttention(8, 2)(torch.randn(2, 3, 8), value=torch.randn(2, 3, 8))),
    "not a tensor": (TypeError, r"x must be a torch.Tensor \[B, L, 3\]", lambda: SelfAttention(3, 2)([[1.0]])),
    "context features": (ValueError, r"context must be \[B, L, 3\] or \[L, 3\], got shape \(2, 4, 5\)",
                         lambda: SelfAttention(3, 2)(torch.randn(2, 4, 3), torch.randn(2, 4, 5))),
    "context defaulting to x": (ValueError, r"context \(defaulting to x\) must be \[B, L, 5\]",
                                lambda: StackedHeads(3, 2, 2, d_context=5)(torch.randn(2, 4, 3))),
    "raw key padding mask": (ValueError, r"mask of shape \(2, 4\) does not broadcast",
                             lambda: MultiHeadAttention(8, 2)(torch.randn(2, 3, 8), mask=torch.ones(2, 4).bool())),
    "stacked shapes": (ValueError, r"w_key must be \[2, 3, kdim\]",
                       lambda: MultiHeadAttention.from_stacked(torch.randn(2, 3, 4), torch.randn(2, 4, 4),
                                                               torch.randn(2, 3, 4))),
    "from_weights shapes": (ValueError, r"w_query, w_key, w_value must be 2-D",
                            lambda: SelfAttention.from_weights(torch.randn(2, 3, 4), torch.randn(3, 4),
                                                               torch.randn(3, 4))),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_arguments_raise_clear_errors(name):
    error, pattern, call = BAD[name]
    with pytest.raises(error, match=pattern):
        call()


def test_layers_are_exported_from_attnkit():
    assert attnkit.nn.MultiHeadAttention is MultiHeadAttention
    assert math.isclose(1 / math.sqrt(MultiHeadAttention(8, 2).head_dim), 0.5)
