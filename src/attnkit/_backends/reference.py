"""The readable reference backend: the formula of the seed notebooks, one step per line.

    scores  = query @ key^T                (how well each query matches each key)
    scores *= scale                        (1/sqrt(Dk) by default: keeps the softmax soft)
    scores  = mask(scores)                 (-inf where a query may not attend)
    weights = softmax(scores, dim=-1)      (each row sums to 1; rows with no key are zeros)
    weights = dropout(weights)             (training only; rescaled by 1/(1-p))
    output  = weights @ value              (each query's weighted average of the values)

It materialises the ``[..., Lq, Lk]`` score matrix, so it is the backend that returns
weights, and each step is reported to :mod:`attnkit._steps` for the explainer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._call import AttentionCall
from .._steps import record


def softmax_rows(scores: Tensor) -> Tensor:
    """Softmax over the last dim that gives an all-zero row (not NaN) where every score is -inf.

    Half-precision scores are exponentiated and summed in float32. The row maximum is
    subtracted for stability and detached, which leaves the gradient unchanged (softmax is
    shift-invariant) and keeps fully-masked rows free of ``inf - inf``.
    """
    if scores.shape[-1] == 0:
        return scores
    work_dtype = torch.float32 if scores.dtype in (torch.float16, torch.bfloat16) else scores.dtype
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp((scores - row_max).to(work_dtype))
    total = exp.sum(dim=-1, keepdim=True)
    weights = exp / torch.where(total > 0, total, torch.ones_like(total))
    return weights.to(scores.dtype)


def drop_weights(weights: Tensor, dropout: float, generator: torch.Generator | None) -> Tensor:
    """Zero each weight with probability ``dropout`` and rescale the rest by ``1 / (1 - dropout)``."""
    keep = torch.rand(weights.shape, generator=generator, device=weights.device) >= dropout
    return weights * keep / (1.0 - dropout)


def reference_attention(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    query, key, value = call.query, call.key, call.value
    if call.is_gqa:
        # Query head h reads key/value head h // group_size.
        key = key.repeat_interleave(call.group_size, dim=1)
        value = value.repeat_interleave(call.group_size, dim=1)

    scores = query @ key.transpose(-2, -1)
    record("scores", scores)
    scores = scores * call.scale
    record("scaled_scores", scores)

    mask = call.dense_mask()
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
        record("masked_scores", scores)

    weights = softmax_rows(scores)
    record("weights", weights)

    if call.dropout > 0:
        weights = drop_weights(weights, call.dropout, call.generator)
        record("dropped_weights", weights)

    output = weights @ value
    record("output", output)
    return output, (weights if call.return_weights else None)
