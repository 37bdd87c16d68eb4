"""The attention vocabulary of real models, each piece against a float64 reference written from its
model's or FlashAttention's definition (not from attnkit): full-precision biases in half-precision
calls, ..."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnkit

BACKENDS = ["reference", "torch", "tiled", "auto"]


def _alibi_like_bias(heads: int, length: int) -> torch.Tensor:
    """``slope_h * (j - Lk + 1)`` with causal -inf: the issue's float32 bias (slopes not powers of
    two, so bf16 cannot hold it exactly)."""
    slopes = torch.tensor([0.37, 0.71, 0.13, 0.05][:heads])
    keys = torch.arange(length)
    bias = slopes[:, None, None] * (keys - length + 1).float()
    return bias.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))[None]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_float32_bias_keeps_its_precision_in_half_precision_calls(backend, dtype):
    """FlashAttention's rule against PyTorch's own fused kernel: with bf16/fp16 inputs and a float32
    bias (which SDPA keeps in float32), attnkit's error against float64 is at most twice SDPA's;
    rounded to the inputs' dtype the bias alone would cost ~20x (0.56 vs 0.014 in bf16)."""
    length, heads = 256, 4
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, 64, generator=g) for _ in range(3))
    bias = _alibi_like_bias(heads, length)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias.double())
    low = [t.to(dtype) for t in (q, k, v)]
    sdpa_error = (F.scaled_dot_product_attention(*low, attn_mask=bias).double() - exact).abs().max().item()
    ours = attnkit.attention(*low, mask=bias, backend=backend)
    assert ours.dtype == dtype
    assert (ours.double() - exact).abs().max().item() <= 2 * sdpa_error


# -- soft-capping, ALiBi, sinks: float64 references written from the models' own code ---------------


def _inputs(batch=2, heads=4, kv_heads=2, lq=20, lk=20, dim=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, h, n, dim, generator=g, dtype=dtype) * 1.5
            for h, n in ((heads, lq), (kv_heads, lk), (kv_heads, lk))]


def _causal_mask(lq, lk, dtype=torch.float64):
    """transformers' causal mask for a query block at the end of the keys: 0 or -inf."""
    rows = torch.arange(lq)[:, None] + (lk - lq)
    return torch.zeros(lq, lk, dtype=dtype).masked_fill(torch.arange(lk) > rows, float("-inf"))


def _repeat_kv(t, heads):
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def gemma2_eager(q, k, v, softcap, scale):
    """Gemma 2's eager attention: scale, soft-cap, then the causal mask, softmax in float32 (here 64)."""
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    weights = q @ k.transpose(2, 3) * scale
    weights = torch.tanh(weights / softcap) * softcap
    weights = weights + _causal_mask(q.shape[2], k.shape[2], q.dtype)
    return torch.softmax(weights, dim=-1) @ v


def gpt_oss_eager(q, k, v, sinks, scale):
    """GPT-OSS's eager attention: the sink logit joins each row as one more column, then is dropped."""
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    weights = q @ k.transpose(2, 3) * scale + _causal_mask(q.shape[2], k.shape[2], q.dtype)
    column = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1)
    combined = torch.cat([weights, column], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)
    return probs[..., :-1] @ v, torch.logsumexp(torch.cat([weights, column], dim=-1), dim=-1)


def flash_alibi(q, k, v, slopes, scale, causal):
    """FlashAttention's alibi_slopes: ``-slope * |i + Lk - Lq - j|`` added to every score."""
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    lq, lk = q.shape[2], k.shape[2]
    distance = (torch.arange(lq)[:, None] + lk - lq - torch.arange(lk)).abs().double()
    slopes = slopes.reshape(-1, q.shape[1], 1, 1) if slopes.dim() == 2 else slopes.reshape(1, -1, 1, 1)
    scores = q @ k.transpose(2, 3) * scale - slopes * distance
    if causal:
        scores = scores + _causal_mask(lq, lk)
    return torch.softmax(scores, dim=-1) @ v


def bloom_alibi(q, k, v, slopes, scale):
    """BLOOM's ALiBi (causal): ``slope * key_position`` added to every row, which the softmax sees as
    FlashAttention's ``-slope * (p - j)`` (they differ by a constant per row)."""
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    alibi = slopes.reshape(1, -1, 1, 1) * torch.arange(k.shape[2]).double()
    scores = q @ k.transpose(2, 3) * scale + alibi + _causal_mask(q.shape[2], k.shape[2])
    return torch.softmax(scores, dim=-1) @ v


def _compare(ours_fn, reference_fn, inputs, atol=1e-9):
    """Forward and gradients (of a fixed random projection of the output) against the reference."""
    ours_inputs = [t.clone().requires_grad_() for t in inputs]
    ref_inputs = [t.clone().requires_grad_() for t in inputs]
    ours, expected = ours_fn(*ours_inputs), reference_fn(*ref_inputs)
    torch.testing.assert_close(ours, expected, atol=atol, rtol=1e-7)
    up = torch.randn(expected.shape, generator=torch.Generator().manual_seed(3), dtype=expected.dtype)
    for got, want in zip(torch.autograd.grad(ours, ours_inputs, up), torch.autograd.grad(expected, ref_inputs, up)):
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lq", [20, 7])
def test_softcap_is_gemma2s(backend, lq):
    q, k, v = _inputs(lq=lq)
    scale = 0.29

    def ours(q, k, v):
        return attnkit.attention(q, k, v, causal=True, scale=scale, softcap=2.5, backend=backend)

    _compare(ours, lambda q, k, v: gemma2_eager(q, k, v, 2.5, scale), [q, k, v])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_sequence", [False, True])
def test_alibi_slopes_are_flashattentions_and_blooms(backend, per_sequence):
    q, k, v = _inputs(lq=9, lk=20)
    slopes = torch.tensor([[0.5, 0.25, 0.125, 0.0625], [0.37, 0.71, 0.13, 0.05]], dtype=torch.float64)
    slopes = slopes if per_sequence else slopes[1]
    for causal in (True, False):
        def ours(q, k, v):
            return attnkit.attention(q, k, v, causal=causal, alibi_slopes=slopes, backend=backend)

        _compare(ours, lambda q, k, v: flash_alibi(q, k, v, slopes, 8**-0.5, causal), [q, k, v])
    if not per_sequence:
        _compare(lambda q, k, v: attnkit.attention(q, k, v, causal=True, alibi_slopes=slopes, backend=backend),
                 lambda q, k, v: bloom_alibi(q, k, v, slopes, 8**-0.5), [q, k, v])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_are_gpt_osss_with_their_gradient(backend):
    q, k, v = _inputs()
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)

    def ours(q, k, v, sinks):
        return attnkit.attention(q, k, v, causal=True, sinks=sinks, backend=backend)

    _compare(ours, lambda q, k, v, sinks: gpt_oss_eager(q, k, v, sinks, 8**-0.5)[0], [q, k, v, sinks])
    if backend in ("tiled", "auto"):
        _, lse = attnkit.attention(q, k, v, causal=True, sinks=sinks, backend=backend, return_lse=True)
        torch.testing.assert_close(lse, gpt_oss_eager(q, k, v, sinks, 8**-0.5)[1])
    # a row with no key keeps zeros; its lse is its sink
    empty = attnkit.attention(q, k[:, :, :0], v[:, :, :0], sinks=sinks, backend="tiled", return_lse=True)
    assert (empty[0] == 0).all() and torch.equal(empty[1], sinks.view(1, -1, 1).expand(2, 4, 20))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["reference", "tiled", "auto"])
def test_the_vocabulary_in_half_precision_within_twice_the_plain_error(backend, dtype):
    """FlashAttention's rule: in bf16/fp16, at most twice the error against float64 of the models'
    own eager code run in that dtype; one ulp at 1 as a floor."""
    q, k, v = _inputs(batch=1, lq=64, lk=64, dim=32)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    low = [t.to(dtype) for t in (q, k, v)]
    cases = {
        "softcap": (dict(softcap=2.5), lambda q, k, v: gemma2_eager(q, k, v, 2.5, 0.2)),
        "sinks": (dict(sinks=sinks), lambda q, k, v: gpt_oss_eager(q, k, v, sinks.to(q.dtype), 0.2)[0]),
    }
    for name, (kwargs, eager) in cases.items():
        exact = eager(q, k, v)
        plain_error = max((eager(*low).double() - exact).abs().max().item(), torch.finfo(dtype).eps)
        ours = attnkit.attention(*low, causal=True, scale=0.2, backend=backend, **kwargs)
        assert ours.dtype == dtype
        assert (ours.double() - exact).abs().max().item() <= 2 * plain_error, name
