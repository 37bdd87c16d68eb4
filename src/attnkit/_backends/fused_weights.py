"""The ``"torch"`` backend's path when weights are asked for: materialised, with fused ops.

Same formula as the reference backend, written for speed rather than for reading:

    scores  = baddbmm(query, key^T, alpha=scale)   (the scale folded into the matmul)
    scores  = mask(scores)                         (in place: -inf or + bias)
    weights = softmax(scores)                      (in place when nothing needs gradients)
    weights = zero the rows with no key
    output  = bmm(weights, value)

Grouped-query attention folds the query heads of a group into the row dimension, so key and
value are never repeated. Rows with no allowed key get a harmless key before the softmax
and are zeroed after it: the softmax never sees an all ``-inf`` row, so neither the weights
nor the gradients can become NaN. That costs one extra pass over the weights, taken only
when a row can be empty (an explicit mask, or causal with ``Lq > Lk``). A call whose inputs hold
NaN or inf (or whose scores could overflow) runs the reference formula instead: pairwise products
that never multiply a masked-out pair (:mod:`.numerics`), and a row whose scores are all -inf
weighs its keys 0 (``torch.softmax`` makes it NaN).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import _torch_private
from .._call import AttentionCall
from .empty_rows import give_empty_rows_a_key
from .numerics import needs_pairwise, work_dtype
from .reference import drop_weights, reference_attention


def fused_weights_attention(call: AttentionCall) -> tuple[Tensor, Tensor]:
    query, key, value = call.query, call.key, call.value
    if needs_pairwise(query, key, value, call.scale):
        # a masked-out pair's NaN would enter the products (0 * NaN), and softmax makes a row whose
        # scores are all -inf NaN, where the definition weighs its keys 0: the reference formula
        output, weights = reference_attention(call)
        return output, weights
    lead, dtype = query.shape[:-2], query.dtype
    # [groups, rows, D]: with GQA a group is one key/value head and its rows are the query
    # rows of every query head that reads it (head h reads key/value head h // group_size).
    # Half precision runs in float32 (scores, bias, softmax), rounded once at the end.
    work = work_dtype(dtype)
    groups = math.prod(key.shape[:-2])
    rows = call.group_size * call.q_len
    query3 = query.reshape(groups, rows, query.shape[-1]).to(work)
    key3 = key.reshape(groups, call.k_len, key.shape[-1]).to(work)
    value3 = value.reshape(groups, call.k_len, value.shape[-1]).to(work)

    scores = torch.baddbmm(query3.new_zeros(()), query3, key3.transpose(1, 2), beta=0.0, alpha=call.scale)
    scores = scores.view(call.scores_shape)

    mask = call.dense_mask()
    no_key = None
    if mask is not None and (call.mask is not None or call.q_len > call.k_len):
        mask, no_key = give_empty_rows_a_key(mask)
    if mask is not None:
        if mask.dtype != torch.bool:  # a removed pair is set to -inf, not added to (inf - inf is NaN)
            removed = mask == float("-inf")
            scores.add_(mask.masked_fill(removed, 0.0))
            mask = ~removed
        scores.masked_fill_(~mask, float("-inf"))

    in_place = not call.needs_grad and not _torch_private.functorch_active()  # vmap has no rule for softmax(out=)
    if in_place:
        weights = torch.softmax(scores, dim=-1, out=scores)
    else:
        weights = torch.softmax(scores, dim=-1)
    if no_key is not None:
        weights = weights.masked_fill_(no_key, 0.0) if in_place else weights.masked_fill(no_key, 0.0)

    if call.dropout > 0:
        weights = drop_weights(weights, call.dropout, call.seed)

    output = torch.bmm(weights.view(groups, rows, call.k_len), value3)
    return output.view(*lead, call.q_len, value.shape[-1]).to(dtype), weights.to(dtype)
