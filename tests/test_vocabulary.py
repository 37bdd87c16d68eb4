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
