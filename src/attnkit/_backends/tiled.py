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

import functools
import warnings

import torch
from torch import Tensor

from .. import _torch_private
from .._call import AttentionCall, bias_dtype, built_for
from . import blockwise, flex, interval_op, kernels, layout, numerics
from .engines import GpuEngines
from .transfer import to_device
from .interval_inputs import INTERVALS_ONLY, IntervalInputs
from .policy import Route
from .second_order import twice_differentiable
from . import tiled_plan
from .tiled_plan import BlockRun, Problem, block_ranges, combined, intervals, row_bounds, settings

__all__ = ["tiled_attention", "tiled_gradients", "visited_fraction",
           "plan_of", "interval_inputs", "causal_only"]


def interval_inputs(call: AttentionCall) -> IntervalInputs:
    """The call as the op's record: ``query, key, value [N, H(kv), L, D]``, the rows' key intervals
    ``lo, hi [S, R, Lq]`` on the inputs' device, the dense mask as an additive bias ``[Nm, Hm, Lq,
    Lk]`` (None without one), the score modifiers, dropout, and the kernel the call's route names
    (``""``: the op chooses; an explicit ``backend="tiled"`` leaves the dense kernel out)."""
    route = call.route if call.route is not None else Route("tiled")
    kernel = route.kernel or _forced_kernel()
    if call.mask is not None and kernel in INTERVALS_ONLY:  # before anything is built or cached
        raise ValueError(f"the {kernel!r} kernel (tuning(kernel={kernel!r})) reads only each row's key intervals and "
                         f"cannot apply a dense tensor mask of shape {tuple(call.mask.shape)}: pass a structured "
                         f"mask (attnkit.masks), or leave the kernel to the backend")
    query, key, value = (layout.fold(t) for t in (call.query, call.key, call.value))
    lo, hi = _row_bounds_on(call, query.device)
    bias = None
    if call.mask is not None:
        bias = layout.fold_mask(call.mask, tuple(call.scores_shape))
        if bias.dtype == torch.bool:
            allowed = bias
            bias = torch.zeros(allowed.shape, dtype=bias_dtype(query.dtype), device=query.device)
            bias = bias.masked_fill_(~allowed, float("-inf"))
    return IntervalInputs(query, key, value, lo, hi, bias, call.alibi_slopes, call.sinks, call.scale, call.softcap,
                          call.dropout, call.seed, causal_only(call), not route.dense_allowed, kernel)


@_torch_private.assume_constant_result
def _forced_kernel() -> str:
    """``tuning(kernel=...)`` (a context variable, read once per trace under ``torch.compile``)."""
    return settings().kernel


def tiled_attention(call: AttentionCall) -> tuple[Tensor, Tensor | None, Tensor]:
    """Run ``call`` on the route it carries (``call.route``: the kernel, or the op's choice);
    returns ``(output, weights or None, lse)`` in the call's layout."""
    inputs = interval_inputs(call)
    query, key, value, lo, hi, bias = inputs.query, inputs.key, inputs.value, inputs.lo, inputs.hi, inputs.bias
    weights = None
    if call.return_weights and (torch.compiler.is_compiling() or call.modifies_scores):
        out, weights, lse = _dense_weights(call, query, key, value, lo, hi, bias)
    elif call.return_weights:
        out, weights, lse = _with_weights(call, query, key, value, lo, hi, bias)
    elif inputs.kernel == "flex" and _torch_private.beyond_first_order():
        out, lse = interval_op.run(_instead_of_flex(inputs))  # FlexAttention has no forward-mode rule
    elif inputs.kernel == "flex":
        out, lse = _flex(call, inputs)
    else:
        out, lse = interval_op.run(inputs)
    lead = tuple(call.query.shape[:-2])
    if weights is not None:
        weights = layout.unfold(weights, lead)
    return layout.unfold(out, lead), weights, layout.unfold(lse, lead)


def tiled_gradients(call: AttentionCall, out: Tensor, lse: Tensor, grad_out: Tensor,
                    grad_lse: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of ``call`` (shaped like its query, key and value) from the ``out [..., Lq, Dv]``
    and ``lse [..., Lq]`` that :func:`tiled_attention` returned for it and their gradients
    (``grad_lse`` None where the lse was not used): what the op's autograd runs
    (:func:`.interval_op.gradients`: ``attnkit::interval_attention_backward``, the kernel chosen
    from the same data as the forward's), so nothing is recomputed. Gradients of a dense mask's
    bias or of sinks are not returned."""
    inputs = interval_inputs(call)
    if inputs.kernel == "flex":  # FlexAttention's backward needs its forward's graph: the op's kernels
        inputs = _instead_of_flex(inputs)
    rows = inputs.query.shape[:2]
    grads = interval_op.gradients(
        layout.fold(grad_out), None if grad_lse is None else grad_lse.reshape(*rows, -1), layout.fold(out),
        lse.reshape(*rows, -1), inputs)
    return tuple(layout.unfold(grad, tuple(like.shape[:-2]))
                 for grad, like in zip(grads, (call.query, call.key, call.value)))


# -- what is built once per mask object (:func:`attnkit._call.built_for`) ---------------------------


def _row_bounds_on(call: AttentionCall, device: torch.device) -> tuple[Tensor, Tensor]:
    """:func:`row_bounds` of the call on ``device`` (copied without stalling a GPU, cached per mask:
    a model's layers share one mask object; on the CPU they took ~0.1 ms a call to build, a sixth of
    a [1, 8, 128, 64] window call's time). Nothing writes into them."""
    if call.structure is None and not torch.compiler.is_compiling() and not _torch_private.functorch_active():
        return _unstructured_bounds(call.causal, call.q_len, call.k_len, device)
    cache = built_for(call, device)
    if cache is not None and "bounds" in cache:
        return cache["bounds"]
    bounds = tuple(to_device(t, device) for t in row_bounds(call))
    if cache is not None:
        cache["bounds"] = bounds
    return bounds


@functools.lru_cache(maxsize=32)
def _unstructured_bounds(causal: bool, q_len: int, k_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The bounds of a call with no mask object (every key, or ``causal=True``), which follow from
    its shape alone: kept per shape (the causal ones took ~0.05 ms a call to build)."""
    return tuple(to_device(t, device) for t in intervals(None, causal, q_len, k_len))


def _flex(call: AttentionCall, inputs: IntervalInputs) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` in the op's layout by FlexAttention (compiled on a GPU, eager elsewhere) on a
    BlockMask built from the intervals; differentiable through FlexAttention's own autograd."""
    if inputs.dropout > 0:
        raise ValueError("FlexAttention has no dropout: use the Triton kernel (tuning(kernel='triton')) or 'auto'")
    q_len, k_len = inputs.query.shape[2], inputs.key.shape[2]
    block_mask, every_row_attends = None, False
    if q_len and k_len:
        cache = built_for(call, inputs.query.device)
        block_mask = None if cache is None else cache.get("block_mask")
        if block_mask is None:
            mask_mod = flex.mask_mod_for(call.structure, call.causal, q_len, k_len, inputs.lo, inputs.hi)
            block_mask = flex.block_mask_from_bounds(inputs.lo, inputs.hi, q_len, k_len, mask_mod=mask_mod)
            if cache is not None:  # once per mask: whether any row is empty (a host sync, then never)
                cache["block_mask"] = block_mask
                cache["every_row_attends"] = bool(numerics.rows_with_keys(inputs.lo, inputs.hi).all())
        every_row_attends = cache is not None and cache["every_row_attends"]
    try:
        out, lse = flex.flex_interval_attention(
            inputs.query, inputs.key, inputs.value, inputs.lo, inputs.hi, scale=inputs.scale,
            softcap=inputs.softcap, alibi_slopes=inputs.alibi_slopes, sinks=inputs.sinks, block_mask=block_mask,
            compiled=inputs.query.device.type != "cpu", every_row_attends=every_row_attends,
            backend="inductor" if torch.compiler.is_compiling() else tiled_plan.settings().flex_backend)
    except flex.FlexUnavailable as error:  # never FlexAttention unfused: the op's interval kernels instead
        _warn_once(f"{error}: running attnkit's interval kernels instead")
        return interval_op.run(_instead_of_flex(inputs))
    out, lse = blockwise.pairwise_if_not_finite(out, lse, inputs.query, inputs.key, inputs.value, inputs.lo,
                                                inputs.hi, None, inputs.scale, 0.0, None, softcap=inputs.softcap,
                                                alibi=inputs.alibi_slopes, sinks=inputs.sinks)
    if inputs.sinks is None or not inputs.sinks.requires_grad:  # FlexAttention's backward has no derivative
        out = twice_differentiable(out, lambda q, k, v: interval_op.plain_ops(inputs.replace(
            query=q, key=k, value=v))[0], inputs.query, inputs.key, inputs.value)
    return out, lse


def _instead_of_flex(inputs: IntervalInputs) -> IntervalInputs:
    """The record on the op's interval kernel that stands in for FlexAttention: Triton on a GPU
    that has it, else PyTorch's kernels block by block."""
    return inputs.replace(kernel="triton" if GpuEngines.find().triton and inputs.query.is_cuda else "blocks")


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


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


def plan_of(call: AttentionCall) -> list[BlockRun]:
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
    heads_per_kv, value_dim, k_len = pieces.heads_per_kv, value.shape[-1], call.k_len
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
            span = BlockRun(slice(b, b + 1), q0, rows, 1, start, 0, stop - start, False, slot=None)
            bias_piece, _ = pieces.bias(span, b)
            output, lse, weight = kernels.math_forward(
                pieces.queries(span, b), pieces.keys(span, b, key), pieces.keys(span, b, value),
                bias_piece, call.scale, call.dropout, pieces.keep(span, b))
            out_rows.append(blockwise._unstack_query_heads(output, heads_per_kv))
            lse_rows.append(blockwise._unstack_query_heads(lse, heads_per_kv).to(work))
            weight = blockwise._unstack_query_heads(weight, heads_per_kv)
            weight_rows.append(torch.nn.functional.pad(weight, (span.key_start, k_len - span.key_start - span.length)))
        outs.append(torch.cat(out_rows, dim=2))
        weights.append(torch.cat(weight_rows, dim=2))
        lses.append(torch.cat(lse_rows, dim=2))
    results = torch.cat(outs), torch.cat(weights), torch.cat(lses)
    inputs = [t for t in (query, key, value, bias) if t is not None and t.requires_grad]
    if inputs and torch.is_grad_enabled() and not results[0].requires_grad:
        # no row attends any key: every piece is zeros made here, outside the graph; a 0 summed
        # from empty slices of the inputs puts them in it (gradients of 0, whatever they hold)
        link = sum(t.narrow(-1, 0, 0).sum() for t in inputs)
        results = tuple(r + link.to(r.dtype) for r in results)
    return results


def _dense_weights(call: AttentionCall, query: Tensor, key: Tensor, value: Tensor, lo: Tensor, hi: Tensor,
                   bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Output, weights and lse over the whole score matrix (see the module docstring)."""
    out, lse, weights = blockwise.dense_attention(query, key, value, lo, hi, bias, call.scale, call.dropout, call.seed,
                                                  exact=numerics.needs_pairwise(query, key, value, call.scale),
                                                  softcap=call.softcap, alibi=call.alibi_slopes, sinks=call.sinks)
    return out, weights, lse
