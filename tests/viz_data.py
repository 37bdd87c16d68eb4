"""Attention-like weights for the viz tests: softmax of random scores plus the patterns real
heads show (previous token, first token, self), optionally causal, with padded keys that get
exactly zero weight."""

from __future__ import annotations

import torch
from torch import Tensor


def attention_like(
    layers: int,
    heads: int,
    tokens: int,
    *,
    seed: int = 0,
    causal: bool = False,
    padded: int = 0,
    sharpness: float = 4.0,
) -> Tensor:
    """``[layers, heads, tokens, tokens]`` rows summing to 1.

    Head ``h`` favours, by ``h % 4``: the previous token, the first token, itself, nothing in
    particular. ``causal`` masks future keys; the last ``padded`` keys are masked for every
    query (their columns are exactly 0), as a padded batch gives.
    """
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(layers, heads, tokens, tokens, generator=generator, dtype=torch.float64)
    query = torch.arange(tokens)[:, None]
    key = torch.arange(tokens)[None, :]
    patterns = [key == (query - 1).clamp(min=0), key == 0, key == query, torch.zeros(tokens, tokens, dtype=torch.bool)]
    for head in range(heads):
        scores[:, head] += sharpness * patterns[head % 4]
    allowed = torch.ones(tokens, tokens, dtype=torch.bool)
    if causal:
        allowed &= key <= query
    if padded:
        allowed &= key < tokens - padded
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return weights.float()


def words(count: int) -> list[str]:
    """``count`` distinct, readable tokens."""
    base = ["[CLS]", "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", ".", "[SEP]"]
    return base[:count] if count <= len(base) else [f"{base[i % len(base)]}{i}" for i in range(count)]
