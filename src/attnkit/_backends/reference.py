"""The readable reference backend: the formula of the seed notebooks, one step per line.

    scores  = query @ key^T                (how well each query matches each key)
    scores *= scale                        (1/sqrt(Dk) by default: keeps the softmax soft)
    scores  = softcap(scores)              (cap * tanh(s / cap), when asked: Gemma 2)
    scores += alibi                        (-slope * distance, when asked: BLOOM, MPT)
    scores  = mask(scores)                 (-inf where a query may not attend)
    weights = softmax(scores, dim=-1)      (each row sums to 1, less with sinks; no key: zeros)
    weights = dropout(weights)             (training only; rescaled by 1/(1-p))
    output  = weights @ value              (each query's weighted average of the values)

It materialises the ``[..., Lq, Lk]`` score matrix, so it is the backend that returns
weights, and each step is reported to :mod:`attnkit._steps` for the explainer. Half-precision
inputs are computed in float32 throughout and the results rounded once. When a masked
input holds NaN or inf, or scores could overflow, the two products run pairwise so that
masked-out pairs are never multiplied (:mod:`.numerics`): the definition every backend follows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._call import AttentionCall
from .._steps import record
from . import dropout as _dropout
from . import layout
from .numerics import alibi_bias, needs_pairwise, pairwise_scores, pairwise_values, soft_cap, softmax_rows, work_dtype

__all__ = ["reference_attention", "drop_weights", "softmax_rows"]


def drop_weights(weights: Tensor, p: float, seed: Tensor) -> Tensor:
    """``weights [..., Lq, Lk]`` with dropout ``p`` applied by attnkit's pattern for ``seed``."""
    return _dropout.apply(layout.fold(weights), seed, p).reshape(weights.shape)


def alibi_of(call: AttentionCall) -> Tensor:
    """The ALiBi bias of the call, ``[N or 1, H, Lq, Lk]`` in the folded layout."""
    slopes = call.alibi_slopes
    slopes = slopes.view(1, -1, 1, 1) if slopes.dim() == 1 else slopes[:, :, None, None]
    device = call.query.device
    rows = torch.arange(call.q_len, device=device)[:, None] + (call.k_len - call.q_len)
    return alibi_bias(slopes, rows, torch.arange(call.k_len, device=device))


def reference_attention(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    # Half-precision inputs are computed in float32, scores, bias and softmax included (as SDPA does)
    work = work_dtype(call.query.dtype)
    query, key, value = (t.to(work) for t in (call.query, call.key, call.value))
    if call.is_gqa:
        # Query head h reads key/value head h // group_size.
        key = key.repeat_interleave(call.group_size, dim=1)
        value = value.repeat_interleave(call.group_size, dim=1)

    mask = call.dense_mask()
    allowed = None if mask is None else mask if mask.dtype == torch.bool else mask != float("-inf")
    pairwise = allowed is not None and needs_pairwise(query, key, value, call.scale)

    scores = pairwise_scores(query, key, allowed) if pairwise else query @ key.transpose(-2, -1)
    record("scores", scores)
    scores = scores * call.scale
    record("scaled_scores", scores)
    if call.softcap is not None:
        scores = soft_cap(scores, call.softcap)
        record("capped_scores", scores)
    if call.alibi_slopes is not None:
        scores = (layout.fold(scores) + alibi_of(call)).reshape(scores.shape)
        record("alibi_scores", scores)

    if mask is not None:
        if mask.dtype != torch.bool:
            scores = scores + mask.to(work).masked_fill(~allowed, 0.0)
        scores = scores.masked_fill(~allowed, float("-inf"))
        record("masked_scores", scores)

    if call.sinks is None:
        weights = softmax_rows(scores)
    else:  # one more logit per head in every row's normaliser
        weights = softmax_rows(layout.fold(scores), call.sinks.view(1, -1, 1, 1)).reshape(scores.shape)
    record("weights", weights)

    if call.dropout > 0:
        weights = drop_weights(weights, call.dropout, call.seed)
        record("dropped_weights", weights)

    output = pairwise_values(weights, value, allowed) if pairwise else weights @ value
    record("output", output)
    dtype = call.query.dtype
    return output.to(dtype), (weights.to(dtype) if call.return_weights else None)
