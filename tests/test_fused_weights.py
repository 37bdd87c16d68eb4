"""The "torch" backend's materialised path (return_weights=True) against the float64 oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from oracle import oracle_attention
from strategies import cases

# fp32 against float64: O(1) randn inputs, sums over <= 9 keys and <= 8 features, as in
# test_core_against_oracle: 1e-5 leaves ~80 ulp.
FP32 = dict(atol=1e-5, rtol=1e-5)


def _repeat_kv(query, value):
    if query.dim() == 4:
        return value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    return value


@given(case=cases(), grad=st.booleans())
def test_weights_and_output_match_oracle(case, grad):
    """Both the in-place (no gradients) and the autograd-safe variants."""
    expected_out, expected_w = oracle_attention(case.query, case.key, case.value, **case.kwargs())
    with torch.set_grad_enabled(grad):
        query = case.query.clone().requires_grad_(grad)
        output, weights = attnkit.attention(query, case.key, case.value, return_weights=True, backend="torch",
                                            **case.kwargs())
    torch.testing.assert_close(weights.double(), expected_w, **FP32)
    torch.testing.assert_close(output.double(), expected_out, **FP32)
    torch.testing.assert_close(output, weights @ _repeat_kv(case.query, case.value), **FP32)


def _max_error(a, b):
    return (a.double() - b.double()).abs().max().item()


@given(case=cases(max_len=24, max_dim=16))
def test_bfloat16_weights_within_twice_the_reference_error(case):
    low = case.to(torch.bfloat16)
    exact_out, exact_w = oracle_attention(low.query, low.key, low.value, **low.kwargs())
    plain_out, plain_w = oracle_attention(low.query, low.key, low.value, dtype=torch.bfloat16, **low.kwargs())
    output, weights = attnkit.attention(low.query, low.key, low.value, return_weights=True, backend="torch",
                                        **low.kwargs())
    assert output.dtype == weights.dtype == torch.bfloat16
    # FlashAttention's rule, with one bf16 ulp at 1 (2**-8) as the floor for tiny exact cases.
    assert _max_error(weights, exact_w) <= 2 * _max_error(plain_w, exact_w) + 2**-8
    assert _max_error(output, exact_out) <= 2 * _max_error(plain_out, exact_out) + 2**-8


GRAD_CONFIGS = {
    "causal gqa": dict(shape=(1, 4, 5, 3), kv_heads=2, lk=5, kwargs=dict(causal=True)),
    "causal lq>lk": dict(shape=(2, 6, 3), kv_heads=None, lk=3, kwargs=dict(causal=True)),
    "bool mask with empty row": dict(shape=(4, 3), kv_heads=None, lk=5, kwargs=dict(
        mask=torch.tensor([[True, False, True, False, True], [False] * 5, [True] * 5, [False, True, False, False, False]]))),
    "additive -inf row": dict(shape=(4, 3), kv_heads=None, lk=5, kwargs=dict(
        mask=torch.tensor([[0.0] * 5, [float("-inf")] * 5, [0.5, -1.0, float("-inf"), 0, 0], [0.0] * 5],
                          dtype=torch.float64))),
}


@pytest.mark.parametrize("name", list(GRAD_CONFIGS))
def test_gradcheck_of_output_and_weights(name):
    config = GRAD_CONFIGS[name]
    g = torch.Generator().manual_seed(0)
    *lead, lq, dk = config["shape"]
    kv_lead = list(lead)
    if config["kv_heads"]:
        kv_lead[1] = config["kv_heads"]
    q = torch.randn(*lead, lq, dk, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(*kv_lead, config["lk"], dk, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(*kv_lead, config["lk"], 2, generator=g, dtype=torch.float64, requires_grad=True)
    fn = lambda q, k, v: attnkit.attention(q, k, v, return_weights=True, backend="torch",  # noqa: E731
                                           **config["kwargs"])
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_learned_additive_bias_gets_its_gradient():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(5, 5, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda b: attnkit.attention(q, k, v, mask=b, return_weights=True, backend="torch"), (bias,))


def test_dropout_draws_the_same_pattern_as_the_reference():
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 2, 7, 8, generator=g), torch.randn(2, 2, 7, 3)
    ours = attnkit.attention(q, k, v, causal=True, dropout=0.3, generator=torch.Generator().manual_seed(5),
                             return_weights=True, backend="torch")
    reference = attnkit.attention(q, k, v, causal=True, dropout=0.3, generator=torch.Generator().manual_seed(5),
                                  return_weights=True, backend="reference")
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b)


def test_auto_returns_weights_from_the_torch_backend():
    from attnkit import _backends
    from attnkit._call import make_call

    q = torch.randn(3, 4)
    call = make_call(q, q, q, mask=None, causal=False, scale=None, dropout=0.0, generator=None,
                     return_weights=True)
    assert _backends.resolve("auto", call)[0].name == "torch"
