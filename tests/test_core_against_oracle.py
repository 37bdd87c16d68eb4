"""Every backend against the independent float64 oracle and against PyTorch's own SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from oracle import oracle_attention
from strategies import cases

BACKENDS = ["reference", "torch", "tiled", "auto"]

# fp32 against float64: inputs are O(1) randn and sums run over <= 9 keys and <= 8 features,
# so rounding stays within a few ulp (eps = 1.2e-7) of each O(1) output; 1e-5 leaves ~80 ulp.
FP32 = dict(atol=1e-5, rtol=1e-5)
FP64 = dict(atol=1e-12, rtol=1e-12)


@given(case=cases(), backend=st.sampled_from(BACKENDS), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_output_matches_float64_oracle(case, backend, dtype):
    case = case.to(dtype)
    expected, _ = oracle_attention(case.query, case.key, case.value, **case.kwargs())
    output = attnkit.attention(case.query, case.key, case.value, backend=backend, **case.kwargs())
    assert output.dtype == dtype and output.shape == expected.shape
    torch.testing.assert_close(output.double(), expected, **(FP32 if dtype == torch.float32 else FP64))


@given(case=cases())
def test_weights_match_oracle_and_reproduce_output(case):
    expected_out, expected_w = oracle_attention(case.query, case.key, case.value, **case.kwargs())
    output, weights = attnkit.attention(case.query, case.key, case.value, return_weights=True, **case.kwargs())
    assert weights.shape == expected_w.shape
    torch.testing.assert_close(weights.double(), expected_w, **FP32)
    torch.testing.assert_close(output.double(), expected_out, **FP32)
    value = case.value
    if case.query.dim() == 4:
        value = value.repeat_interleave(case.query.shape[1] // value.shape[1], dim=1)
    torch.testing.assert_close(output, weights @ value, **FP32)


@given(case=cases(gqa=True), backend=st.sampled_from(BACKENDS))
def test_agrees_with_pytorch_sdpa(case, backend):
    """Same masks, same convention as F.scaled_dot_product_attention (its causal is top-left,
    so causal cases are compared with the equivalent explicit mask)."""
    mask = case.mask
    if case.causal:
        lq, lk = case.query.shape[-2], case.key.shape[-2]
        causal = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        mask = causal if mask is None else (mask & causal if mask.dtype == torch.bool
                                            else mask.masked_fill(~causal, float("-inf")))
    gqa = case.query.dim() == 4 and case.key.shape[1] != case.query.shape[1]
    expected = F.scaled_dot_product_attention(
        case.query.double(), case.key.double(), case.value.double(),
        attn_mask=None if mask is None else (mask if mask.dtype == torch.bool else mask.double()),
        scale=case.scale, enable_gqa=gqa,
    )
    output = attnkit.attention(case.query, case.key, case.value, backend=backend, **case.kwargs())
    torch.testing.assert_close(output.double(), expected.nan_to_num(0.0), **FP32)


def _max_error(a, b):
    return (a.double() - b.double()).abs().max().item()


@given(case=cases(max_len=24, max_dim=16), backend=st.sampled_from(BACKENDS))
def test_bfloat16_within_twice_the_reference_error(case, backend):
    """FlashAttention's rule: our bf16 error against float64 is at most twice the error of the
    plain bf16 computation (the oracle run in bf16) against float64."""
    low = case.to(torch.bfloat16)
    exact, _ = oracle_attention(low.query, low.key, low.value, **low.kwargs())
    plain, _ = oracle_attention(low.query, low.key, low.value, dtype=torch.bfloat16, **low.kwargs())
    output = attnkit.attention(low.query, low.key, low.value, backend=backend, **low.kwargs())
    assert output.dtype == torch.bfloat16
    # The floor is one bf16 ulp at 1 (2**-8): with tiny cases the plain error can be exactly 0.
    assert _max_error(output, exact) <= 2 * _max_error(plain, exact) + 2**-8


@given(backend=st.sampled_from(BACKENDS), seed=st.integers(0, 1000), lq=st.integers(1, 40), lk=st.integers(1, 40))
def test_stable_for_logits_up_to_1e4(backend, seed, lq, lk):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(2, lq, 16, generator=g) * 25.0
    key = torch.randn(2, lk, 16, generator=g) * 25.0
    value = torch.randn(2, lk, 8, generator=g)
    # |score| reaches ~1e4 with scale 1: the softmax sees enormous logits.
    exact, _ = oracle_attention(query, key, value, scale=1.0)
    plain, _ = oracle_attention(query, key, value, scale=1.0, dtype=torch.float32)
    assert plain.abs().max() > 0  # sanity: the case is not degenerate
    output = attnkit.attention(query, key, value, scale=1.0, backend=backend)
    assert torch.isfinite(output).all()
    assert _max_error(output, exact) <= 2 * _max_error(plain, exact) + 1e-5


def test_under_autocast_every_backend_computes_as_sdpa_does():
    """torch.autocast lists SDPA among its lower-precision ops: float32 inputs run in the autocast
    dtype and the output comes back in it. Every backend and "auto"'s every pick does the same (the
    native kernel computed float32 and returned it, SDPA bfloat16), within twice SDPA's own error
    against float64 (the FlashAttention rule), gradients reaching the float32 inputs."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 200, 32, generator=g) for _ in range(3))
    window = attnkit.masks.sliding_window(64)
    allowed = window.dense(200, 200)
    expected = oracle_attention(q.double(), k.double(), v.double(), mask=allowed)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    sdpa_error = (sdpa.double() - expected).abs().max()
    for backend in BACKENDS:
        for mask in (window, None):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = attnkit.attention(*inputs, mask=mask, backend=backend)
            assert out.dtype == torch.bfloat16, (backend, mask)
            want = expected if mask is not None else oracle_attention(q.double(), k.double(), v.double())[0]
            assert (out.double() - want).abs().max() <= 2 * sdpa_error, (backend, mask)
            out.float().sum().backward()
            assert all(t.grad is not None and t.grad.dtype == torch.float32 for t in inputs)
