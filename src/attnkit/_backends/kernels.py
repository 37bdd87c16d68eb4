"""Attention on one (query block, key range) piece, returning the log-sum-exp so pieces merge.

The tiled backend cuts a call into pieces; each piece runs one of two kernels with the same
contract, written for a grouped layout ``query [B, Hkv, n, D]``, ``key/value [B, Hkv, m, D]``
(GQA's query heads are stacked as extra rows, so keys are never copied) and an optional
additive ``bias`` broadcastable to ``[B, Hkv, n, m]`` (``-inf`` = masked):

    forward(...)  -> output [B, Hkv, n, Dv], lse [B, Hkv, n] (float32 for half types,
                     -inf where a row has no key in this piece: its output is zeros)
    backward(...) -> grad_query, grad_key, grad_value of this piece, given the *merged*
                     output and lse of the whole row (FlashAttention's split-key backward:
                     with the global lse, P = exp(S - lse) is the piece's slice of the true
                     softmax, so the pieces' gradients simply add up).

``"flash"`` is PyTorch's fused CPU kernel (the one behind ``F.scaled_dot_product_attention``
on CPU), which exposes the lse. ``"math"`` is the same computation in plain tensor ops: any
device, dropout, and a gradient for the lse itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def flash_applies(query: Tensor, value: Tensor, dropout: float) -> bool:
    """The fused CPU kernel serves this call: CPU tensors, no dropout (the kernel has none) and
    one head size for query, key and value (the kernel requires it)."""
    return query.device.type == "cpu" and dropout == 0.0 and query.shape[-1] == value.shape[-1]


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _dropout_keep(shape: torch.Size, dropout: float, seed: int, device: torch.device) -> Tensor:
    """The piece's dropout pattern, a pure function of ``seed`` so backward redraws it exactly."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.rand(shape, generator=generator, device=device) >= dropout


def softmax_and_lse(scores: Tensor) -> tuple[Tensor, Tensor]:
    """Row softmax and log-sum-exp; rows that are all ``-inf`` give zero weights and ``-inf``,
    with finite gradients (the row max is detached and guarded, the log only sees sums > 0)."""
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(scores - row_max)
    total = exp.sum(dim=-1, keepdim=True)
    has_key = total > 0
    safe_total = torch.where(has_key, total, torch.ones_like(total))
    lse = torch.where(has_key, torch.log(safe_total) + row_max, torch.full_like(total, float("-inf")))
    return exp / safe_total, lse.squeeze(-1)


def _scores(query: Tensor, key: Tensor, bias: Tensor | None, scale: float) -> Tensor:
    work = _work_dtype(query.dtype)
    scores = (query.to(work) @ key.to(work).transpose(-2, -1)) * scale
    return scores if bias is None else scores + bias.to(work)


def math_forward(query: Tensor, key: Tensor, value: Tensor, bias: Tensor | None, scale: float,
                 dropout: float = 0.0, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """``(output, lse, weights)`` of one piece in plain ops (differentiable as written); weights
    are the probabilities applied to ``value``, after dropout."""
    weights, lse = softmax_and_lse(_scores(query, key, bias, scale))
    if dropout > 0:
        weights = weights * _dropout_keep(weights.shape, dropout, seed, weights.device) / (1.0 - dropout)
    output = weights @ value.to(weights.dtype)
    return output.to(query.dtype), lse, weights.to(query.dtype)


def math_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                  bias: Tensor | None, scale: float, dropout: float, seed: int,
                  grad_lse: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one piece given the merged ``out`` and ``lse`` of its rows (float32 for half types).

    With P = exp(S - lse): dV = P'^T dO (P' after dropout), dS = P * (dP - D) where
    dP = dO V^T (times the dropout pattern) and D = rowsum(dO * out) - grad_lse."""
    work = _work_dtype(query.dtype)
    q, k, v = query.to(work), key.to(work), value.to(work)
    d_out = grad_out.to(work)
    scores = _scores(query, key, bias, scale)
    finite_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).to(work)
    probs = torch.exp(scores - finite_lse[..., None])  # masked scores are -inf: exactly 0 there
    d_probs = d_out @ v.transpose(-2, -1)
    applied = probs
    if dropout > 0:
        keep = _dropout_keep(probs.shape, dropout, seed, probs.device) / (1.0 - dropout)
        applied = probs * keep
        d_probs = d_probs * keep
    row_dot = (d_out * out.to(work)).sum(-1)
    if grad_lse is not None:
        row_dot = row_dot - grad_lse.to(work)
    d_scores = probs * (d_probs - row_dot[..., None]) * scale
    return d_scores @ k, d_scores.transpose(-2, -1) @ q, applied.transpose(-2, -1) @ d_out


def _head_major(t: Tensor | None) -> Tensor | None:
    """``[B, H, ...]`` -> ``[H, B, ...]`` (a view). The fused kernel runs its (batch, head) tasks
    batch-major; the tiled backend's dim 0 holds consecutive query blocks whose key views overlap
    (a sliding window's blocks share 94% of their keys), so handing it heads as the batch makes
    consecutive tasks re-read keys still in cache: 3-6% faster on the 512 window
    (benchmarks/masks.py, L = 16384), the same elsewhere. Exact: each task is independent."""
    return None if t is None else t.transpose(0, 1)


def flash_forward(query: Tensor, key: Tensor, value: Tensor, bias: Tensor | None,
                  scale: float) -> tuple[Tensor, Tensor]:
    """``(output, lse)`` from the fused CPU kernel. It reports lse 0 for rows with no key;
    the caller, which knows those rows from the mask, sets them to -inf."""
    output, lse = _flash_forward(*map(_head_major, (query, key, value)), attn_mask=_head_major(bias), scale=scale)
    return _head_major(output), _head_major(lse)


def flash_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                   bias: Tensor | None, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The fused CPU kernel's backward, fed the merged ``out`` and ``lse`` (finite: rows with no
    key at all carry lse 0, where every masked score still gives probability 0)."""
    finite_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return _flash_backward(grad_out, query, key, value, out, finite_lse, 0.0, False, attn_mask=bias, scale=scale)
