"""A decoding step (one query row) by the definition, with no read of the device.

The ``"torch"`` backend runs SDPA and then reads its output back to the host, because SDPA may
differ from attnkit's definition where an input holds NaN or inf (``fused._may_differ_from_definition``).
On an accelerator that read waits for the device's queue to drain, once per layer and token in a
model's ``generate()``. Here one query row is computed in plain ops whose result *is* the
definition, so nothing is read:

    scores  = (query @ key^T) * scale        float32 (half precision upcast, as the reference)
    scores  = where(allowed, scores, -inf)   a masked-out pair's NaN or inf is dropped here
    e       = exp(scores - max)              max clamped to float32's lowest: a row of -inf gives 0s
    output  = (e @ where(allowed, value, 0)) / max(sum(e), tiny)

- a NaN or +inf attended score makes ``sum(e)`` NaN, so the whole row is NaN;
- a row with no key, or only scores of -inf, has ``e = 0``: zeros, and NaN only where an attended
  value is infinite or NaN (``0 x inf``), as the definition's products give;
- a masked-out key's value never reaches the row: the values are zeroed where the mask (shared by
  the heads) removes the key, or, for a mask that differs between heads, summed pair by pair.

It costs more launches than SDPA (about ten, against SDPA and the check's four), and is O(Lk) per
head: one query row has no ``Lq x Lk``. Forward only (a decoding step records no graph); no
dropout, weights, soft-capping, ALiBi or sinks: the caller keeps those calls on its other paths.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._call import AttentionCall
from . import layout
from .numerics import pairwise_values, work_dtype


def serves_decode_step(call: AttentionCall) -> bool:
    """Whether :func:`decode_step_attention` computes ``call``: one query row over at least one key,
    nothing to differentiate, and none of the features it leaves to the other paths."""
    return (call.q_len == 1 and call.k_len > 0 and call.dropout == 0 and not call.return_weights and not call.return_lse
            and not call.modifies_scores and not call.needs_grad)


def decode_step_attention(call: AttentionCall) -> Tensor:
    """``output [..., 1, Dv]`` of a call :func:`serves_decode_step` takes, by the definition (see the module
    docstring), with no read of the device."""
    work = work_dtype(call.query.dtype)
    query, key, value = (layout.fold(t).to(work) for t in (call.query, call.key, call.value))
    batch, heads = query.shape[:2]
    kv_heads, group = key.shape[1], heads // key.shape[1]
    # the G heads of a group as G rows over their one key/value head: [N, Hkv, G, D]
    rows = query.reshape(batch, kv_heads, group, query.shape[-1])
    scores = (rows @ key.transpose(-2, -1)).mul_(call.scale)  # [N, Hkv, G, Lk]

    mask = call.dense_mask()
    allowed, shared = None, True
    if mask is not None:
        mask = layout.fold_mask(mask, tuple(call.scores_shape))  # [Nm, 1 or H, 1, Lk]
        allowed = mask if mask.dtype == torch.bool else mask != float("-inf")
        shared = mask.shape[1] == 1
        as_rows = (lambda t: t) if shared else (lambda t: t.reshape(t.shape[0], kv_heads, group, t.shape[-1]))
        allowed = as_rows(allowed)
        if mask.dtype != torch.bool:
            scores = scores + as_rows(mask.to(work)).masked_fill(~allowed, 0.0)
        scores = torch.where(allowed, scores, float("-inf"))

    row_max = scores.amax(dim=-1, keepdim=True).clamp_(min=torch.finfo(work).min)  # NaN and +inf stay
    weights = scores.sub_(row_max).exp_()
    total = weights.sum(dim=-1, keepdim=True).clamp_(min=torch.finfo(work).tiny)
    if allowed is None:
        output = weights @ value
    elif shared:  # one mask for every head: the removed keys' values are zeros
        output = weights @ torch.where(allowed.transpose(-2, -1), value, 0.0)
    else:  # a mask per head: the attended pairs only
        output = pairwise_values(weights, value, allowed)
    output = output.div_(total).reshape(batch, heads, 1, value.shape[-1])
    return layout.unfold(output, tuple(call.query.shape[:-2])).to(call.query.dtype)
