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

from .. import _torch_private
from .numerics import soft_cap, softmax_with_lse, work_dtype

_FLASH = _torch_private.flash_cpu_ops()


def flash_applies(query: Tensor, value: Tensor, dropout: float) -> bool:
    """The fused CPU kernel serves this call: CPU tensors, no dropout (the kernel has none), one
    head size for query, key and value (the kernel requires it), and a torch whose private kernel
    signature attnkit was tested with."""
    return (_FLASH is not None and query.device.type == "cpu" and dropout == 0.0
            and query.shape[-1] == value.shape[-1])


def _raw_scores(query: Tensor, key: Tensor, scale: float) -> Tensor:
    work = work_dtype(query.dtype)
    return (query.to(work) @ key.to(work).transpose(-2, -1)) * scale


def _scores(raw: Tensor, bias: Tensor | None, softcap: float | None) -> Tensor:
    """Soft-capped (Gemma 2) raw scores plus the bias (ALiBi and mask, -inf where masked)."""
    scores = soft_cap(raw, softcap)
    return scores if bias is None else scores + bias.to(scores.dtype)


def math_forward(query: Tensor, key: Tensor, value: Tensor, bias: Tensor | None, scale: float,
                 dropout: float = 0.0, keep: Tensor | None = None,
                 softcap: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(output, lse, weights)`` of one piece in plain ops (differentiable as written); weights
    are the probabilities applied to ``value``, after dropout (``keep``: the piece's pattern)."""
    weights, lse = softmax_with_lse(_scores(_raw_scores(query, key, scale), bias, softcap))
    if dropout > 0:
        weights = weights * keep / (1.0 - dropout)
    output = weights @ value.to(weights.dtype)
    return output.to(query.dtype), lse, weights.to(query.dtype)


def math_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                  bias: Tensor | None, scale: float, keep: Tensor | None, dropout: float,
                  grad_lse: Tensor | None, softcap: float | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of one piece given the merged ``out`` and ``lse`` of its rows (float32 for half
    types): ``(dq, dk, dv, d_bias)``, ``d_bias`` the gradient of the additive scores (after the
    soft cap, whose derivative ``1 - tanh^2`` reaches dq and dk).

    With P = exp(S - lse): dV = P'^T dO (P' after dropout), dS = P * (dP - D) where
    dP = dO V^T (times the dropout pattern) and D = rowsum(dO * out) - grad_lse."""
    work = work_dtype(query.dtype)
    q, k, v = query.to(work), key.to(work), value.to(work)
    d_out = grad_out.to(work)
    raw = _raw_scores(query, key, scale)
    scores = _scores(raw, bias, softcap)
    finite_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).to(work)
    probs = torch.exp(scores - finite_lse[..., None])  # masked scores are -inf: exactly 0 there
    d_probs = d_out @ v.transpose(-2, -1)
    applied = probs
    if dropout > 0:
        factor = keep.to(probs.dtype) / (1.0 - dropout)
        applied = probs * factor
        d_probs = d_probs * factor
    row_dot = (d_out * out.to(work)).sum(-1)
    if grad_lse is not None:
        row_dot = row_dot - grad_lse.to(work)
    d_bias = probs * (d_probs - row_dot[..., None])
    d_scores = d_bias * scale
    if softcap is not None:  # d/ds cap * tanh(s / cap) = 1 - tanh^2
        d_scores = d_scores * (1 - torch.tanh(raw / softcap).square())
    return d_scores @ k, d_scores.transpose(-2, -1) @ q, applied.transpose(-2, -1) @ d_out, d_bias


def _head_major(t: Tensor | None) -> Tensor | None:
    """``[B, H, ...]`` -> ``[H, B, ...]`` (a view). The fused kernel runs its (batch, head) tasks
    batch-major; the tiled backend's dim 0 holds consecutive query blocks whose key views overlap
    (a sliding window's blocks share 94% of their keys), so handing it heads as the batch makes
    consecutive tasks re-read keys still in cache: 3-6% faster on the 512 window
    (benchmarks/masks.py, L = 16384), the same elsewhere. Exact: each task is independent."""
    return None if t is None else t.transpose(0, 1)


def flash_forward(query: Tensor, key: Tensor, value: Tensor, bias: Tensor | None,
                  scale: float, causal: bool = False) -> tuple[Tensor, Tensor]:
    """``(output, lse)`` from the fused CPU kernel (``causal``: its own top-left causal mask). It
    reports lse 0 for rows with no key; the caller, which knows those rows from the mask, sets
    them to -inf."""
    output, lse = _FLASH[0](*map(_head_major, (query, key, value)), is_causal=causal,
                            attn_mask=_head_major(bias), scale=scale)
    return _head_major(output), _head_major(lse)


def flash_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                   bias: Tensor | None, scale: float, causal: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The fused CPU kernel's backward, fed the merged ``out`` and ``lse`` (finite: rows with no
    key at all carry lse 0, where every masked score still gives probability 0)."""
    finite_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return _FLASH[1](grad_out, query, key, value, out, finite_lse, 0.0, causal, attn_mask=bias, scale=scale)
