"""The ``"tiled"`` backend: block-sparse attention that skips masked blocks, exactly, in O(L) memory.

A structured mask gives every query row one key interval ``[lo, hi)``; the backend folds the call
into the ``[N, H, L, D]`` layout (:mod:`.layout`), computes the rows' intervals and runs one custom
op, ``attnkit::interval_attention`` (:mod:`.interval_op`): attnkit's native CPU kernel where it
applies, PyTorch's kernels block by block elsewhere (:mod:`.blockwise`). ``torch.compile`` traces
the op as one node, so compiled code keeps the structure (no ``Lq x Lk`` mask is built).

Training keeps O(L) memory: the op saves only query, key, value, output and lse, and its backward
recomputes the weights from the lse. A dense tensor mask rides along as an additive bias (its
gradient included); the structured part still decides which blocks run.

Conventions: ``lse[..., i]`` is the natural-log sum of ``exp(scale * q.k + bias)`` over the keys
row ``i`` may attend, before dropout (float32 for half-precision inputs), and ``-inf`` for a row
with no key, whose output is zeros. Dropout follows :mod:`.dropout` (one pattern on every path).

``return_weights=True`` computes each block over the span of its key ranges in differentiable
plain ops (the weights are ``Lq x Lk`` anyway); while ``torch.compile`` traces, or with
soft-capping, ALiBi or sinks, the whole score matrix at once (the same numbers to rounding).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._call import AttentionCall, bias_dtype
from . import blockwise, interval_op, kernels, layout, numerics
from .interval_op import IntervalAttention
from . import tiled_plan
from .tiled_plan import Group, Problem, block_ranges, combined, row_bounds, settings

__all__ = ["tiled_attention", "auto_tiled_attention", "tiled_gradients", "auto_tiled_gradients", "visited_fraction",
           "plan_of", "interval_inputs", "causal_only"]


def interval_inputs(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """The call in the op's layout: ``query, key, value [N, H(kv), L, D]``, the rows' key intervals
    ``lo, hi [S, R, Lq]`` on the inputs' device, and the dense mask as an additive bias
    ``[Nm, Hm, Lq, Lk]`` (None without one)."""
    query, key, value = (layout.fold(t) for t in (call.query, call.key, call.value))
    lo, hi = (t.to(query.device) for t in row_bounds(call))
    bias = None
    if call.mask is not None:
        bias = layout.fold_mask(call.mask, tuple(call.scores_shape))
        if bias.dtype == torch.bool:
            allowed = bias
            bias = torch.zeros(allowed.shape, dtype=bias_dtype(query.dtype), device=query.device)
            bias = bias.masked_fill_(~allowed, float("-inf"))
    return query, key, value, lo, hi, bias


def auto_tiled_attention(call: AttentionCall) -> tuple[Tensor, Tensor | None, Tensor]:
    """:func:`tiled_attention` whose op may pick the fused kernel over the dense mask where that is
    faster (what ``"auto"`` runs, :func:`attnkit._backends.policy.kernel_for`)."""
    return tiled_attention(call, sparse_only=False)


def tiled_attention(call: AttentionCall, sparse_only: bool = True) -> tuple[Tensor, Tensor | None, Tensor]:
    """Run ``call``; returns ``(output, weights or None, lse)`` in the call's layout."""
    query, key, value, lo, hi, bias = interval_inputs(call)
    weights = None
    if call.return_weights and (torch.compiler.is_compiling() or call.modifies_scores):
        out, weights, lse = _dense_weights(call, query, key, value, lo, hi, bias)
    elif call.return_weights:
        out, weights, lse = _with_weights(call, query, key, value, lo, hi, bias)
    else:
        out, lse = IntervalAttention.apply(query, key, value, lo, hi, bias, call.alibi_slopes, call.sinks, call.scale,
                                           call.softcap, call.dropout, call.seed, causal_only(call), sparse_only)
    lead = tuple(call.query.shape[:-2])
    if weights is not None:
        weights = layout.unfold(weights, lead)
    return layout.unfold(out, lead), weights, layout.unfold(lse, lead)


def tiled_gradients(call: AttentionCall, out: Tensor, lse: Tensor, grad_out: Tensor, grad_lse: Tensor | None,
                    sparse_only: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of ``call`` (shaped like its query, key and value) from the ``out [..., Lq, Dv]``
    and ``lse [..., Lq]`` that :func:`tiled_attention` returned for it and their gradients
    (``grad_lse`` None where the lse was not used): what the op's autograd runs
    (:func:`.interval_op.gradients`: ``attnkit::interval_attention_backward``, the kernel chosen
    from the same data as the forward's), so nothing is recomputed. Gradients of a dense mask's
    bias or of sinks are not returned."""
    query, key, value, lo, hi, bias = interval_inputs(call)
    rows = query.shape[:2]
    grads = interval_op.gradients(
        layout.fold(grad_out), None if grad_lse is None else grad_lse.reshape(*rows, -1), query, key, value,
        layout.fold(out), lse.reshape(*rows, -1), lo, hi, bias, call.alibi_slopes, call.sinks, call.scale,
        call.softcap, call.dropout, call.seed, causal_only(call), sparse_only)
    return tuple(layout.unfold(grad, tuple(like.shape[:-2]))
                 for grad, like in zip(grads, (call.query, call.key, call.value)))


def auto_tiled_gradients(call: AttentionCall, out: Tensor, lse: Tensor, grad_out: Tensor,
                         grad_lse: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`tiled_gradients` of :func:`auto_tiled_attention`'s call (its kernel choice)."""
    return tiled_gradients(call, out, lse, grad_out, grad_lse, sparse_only=False)


def causal_only(call: AttentionCall) -> bool:
    """The call's mask is plain causal (the op's fused dense kernel applies that itself)."""
    structure = combined(call.structure, call.causal)
    return structure is not None and structure.is_causal


def visited_fraction(call: AttentionCall) -> float:
    """Share of the ``Lq x Lk`` (query, key) pairs, over the batch, that the block plan on
    PyTorch's kernels computes for ``call``."""
    lo, hi = row_bounds(call)
    batch = layout.batch_heads(tuple(call.query.shape))[0]
    return tiled_plan.visited_fraction(Problem(lo, hi, call.q_len, call.k_len, batch, call.mask is not None))


def plan_of(call: AttentionCall) -> list[Group]:
    """The block plan the tiled backend runs ``call`` by on PyTorch's kernels (cached)."""
    lo, hi = row_bounds(call)
    batch = layout.batch_heads(tuple(call.query.shape))[0]
    return tiled_plan.plans.plan(Problem(lo, hi, call.q_len, call.k_len, batch, call.mask is not None))


# -- weights ------------------------------------------------------------------------------------------


def _with_weights(call: AttentionCall, query: Tensor, key: Tensor, value: Tensor, lo: Tensor, hi: Tensor,
                  bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Output, weights ``[N, H, Lq, Lk]`` and lse: each query block over the span of its key
    ranges, in differentiable plain ops (the whole matrix at once when an input is not finite)."""
    pieces = blockwise._Call(query, key, value, lo, hi, bias, call.scale, call.dropout, call.seed)
    group, value_dim, k_len = pieces.group, value.shape[-1], call.k_len
    if numerics.needs_pairwise(query, key, value, call.scale):
        return _dense_weights(call, query, key, value, lo, hi, bias)
    work = numerics.work_dtype(query.dtype)
    size = settings().block_size
    outs, weights, lses = [], [], []
    for b in range(query.shape[0]):
        s = b if lo.shape[0] > 1 else 0
        out_rows, weight_rows, lse_rows = [], [], []
        per_slot = [block_ranges(lo[s, r].cpu(), hi[s, r].cpu(), size, settings().merge_span)
                    for r in range(lo.shape[1])]
        for index, ranges in enumerate(sorted(sum(slots, []), key=lambda r: r.start) for slots in zip(*per_slot)):
            q0 = index * size
            rows = min(size, call.q_len - q0)
            if not ranges:
                out_rows.append(query.new_zeros(1, query.shape[1], rows, value_dim))
                weight_rows.append(query.new_zeros(1, query.shape[1], rows, k_len))
                lse_rows.append(torch.full((1, query.shape[1], rows), float("-inf"), dtype=work, device=query.device))
                continue
            start, stop = ranges[0].start, max(r.stop for r in ranges)  # one span over every range: slot None
            span = Group(slice(b, b + 1), q0, rows, 1, start, 0, stop - start, False, slot=None)
            bias_piece, _ = pieces.bias(span, b)
            output, lse, weight = kernels.math_forward(
                pieces.queries(span, b), pieces.keys(span, b, key), pieces.keys(span, b, value),
                bias_piece, call.scale, call.dropout, pieces.keep(span, b))
            out_rows.append(blockwise._ungroup_heads(output, group))
            lse_rows.append(blockwise._ungroup_heads(lse, group).to(work))
            weight = blockwise._ungroup_heads(weight, group)
            weight_rows.append(torch.nn.functional.pad(weight, (span.key_start, k_len - span.key_start - span.length)))
        outs.append(torch.cat(out_rows, dim=2))
        weights.append(torch.cat(weight_rows, dim=2))
        lses.append(torch.cat(lse_rows, dim=2))
    return torch.cat(outs), torch.cat(weights), torch.cat(lses)


def _dense_weights(call: AttentionCall, query: Tensor, key: Tensor, value: Tensor, lo: Tensor, hi: Tensor,
                   bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Output, weights and lse over the whole score matrix (see the module docstring)."""
    out, lse, weights = blockwise.dense_attention(query, key, value, lo, hi, bias, call.scale, call.dropout, call.seed,
                                                  exact=numerics.needs_pairwise(query, key, value, call.scale),
                                                  softcap=call.softcap, alibi=call.alibi_slopes, sinks=call.sinks)
    return out, weights, lse
