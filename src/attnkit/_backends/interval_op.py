"""The tiled backend's computation as PyTorch custom ops: ``attnkit::interval_attention`` and its
backward, so that ``torch.compile``, ``torch.func`` and autograd hooks see one op, not Python.

    torch.ops.attnkit.interval_attention(query, key, value, lo, hi, bias, alibi_slopes, sinks,
        scale, softcap, dropout, seed, causal_only, sparse_only, kernel, keep_residual)
        -> (output [N, H, Lq, Dv], lse [N, H, Lq], kernel index, residual)

Row ``i`` of sequence ``n`` attends keys ``lo[s, r, i] <= j < hi[s, r, i]`` for each of its R
ranges (``lo, hi [S, R, Lq]``, int64, disjoint, ``s = n`` or 0 when S = 1), plus an optional additive ``bias`` broadcastable to ``[N, H, Lq, Lk]``
(as ``[Nm, Hm, Lq, Lk]``); ``query [N, H, Lq, D]``, ``key [N, Hkv, Lk, D]``, ``value [N, Hkv, Lk,
Dv]`` with ``H % Hkv == 0`` (GQA). Scores are ``scale * q.k``, soft-capped (``softcap * tanh(s /
softcap)``), plus ALiBi (``-slope * |p - j|``, ``alibi_slopes [H]`` or ``[N, H]``), plus the bias;
``sinks [H]`` joins every row's normaliser. Dropout ``dropout`` from the int64 scalar ``seed``
(or ``[seed, h0, i0, j0]`` for a piece of a larger call, :func:`.dropout.at_positions`). The lse is
float32 for half-precision inputs, ``-inf`` for rows with no key (and no sink). The residual is
what rounding took off a half-precision CPU output (:func:`_split`), for the backward's row term,
where ``keep_residual`` asks for it; an empty tensor elsewhere.

Layers of this module:
- the ops' implementation picks its kernel at run time from the data (:func:`.policy.kernel_for`):
  attnkit's native kernel (CPU, float32 or half precision where it serves it, no bias, kernel
  built), PyTorch's kernels block by block (:mod:`.blockwise`), or, unless ``sparse_only`` (an
  explicit ``backend="tiled"``), PyTorch's fused kernel over the dense mask where that is faster
  (``causal_only``: the mask is plain causal, which that kernel applies itself). All agree to
  rounding and draw the same dropout pattern, so a forward on one and a backward on another is
  still exact. Sinks are folded in around the kernels (:func:`.numerics.fold_sinks`): they only
  rescale rows;
- fake implementations give shapes for tracing (no data is read);
- autograd (registered on the op, and the same functions as :class:`IntervalAttention`, the
  ``torch.func``-ready form the tiled backend calls): ``setup_context`` saves tensors through
  ``save_for_backward`` only (so ``saved_tensors_hooks``, offloading and checkpointing see them),
  gradients flow to ``bias`` and ``sinks`` too, and with ``create_graph=True`` the backward
  recomputes the call densely in differentiable ops (O(Lq x Lk) memory), so second-order
  gradients are exact;
- vmap rules fold the vmapped dim into ``N`` (so ``torch.func.vmap`` and ``jacrev`` work; under
  vmap dropout positions count sequences across the vmapped dim).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import _torch_private
from . import blockwise, native, policy
from . import dropout as _dropout
from .interval_inputs import KERNELS, TENSOR_FIELDS, IntervalInputs
from .numerics import all_finite, can_read, fold_sinks, needs_pairwise, pairwise_fits, work_dtype

__all__ = ["interval_attention", "IntervalAttention", "IntervalInputs", "run", "forward_op", "backward_op", "gradients"]


def _seed_value(seed: Tensor | None) -> tuple[int, tuple[int, int, int]]:
    """The kernel's seed and the piece's (head, row, key) offsets (see :func:`.dropout.at_positions`)."""
    if seed is None:
        return 0, (0, 0, 0)
    if _dropout.has_offsets(seed):
        value, heads, rows, keys = (int(x) for x in seed.tolist())
        return value, (heads, rows, keys)
    return int(seed), (0, 0, 0)


def _keeps_residual(query: Tensor, keep_residual: bool) -> bool:
    """Whether the op returns a residual with its output: asked for (a backward will follow), and
    half precision on the CPU, where the native kernel computes in float32 and its backward can
    read the output as computed. The fake implementation decides from the same, so the shapes agree
    whichever kernel runs. (Writing and reading it: -7% to +9% of the native kernel's time, within
    the noise; docs/performance.md, the ninth session.)"""
    return keep_residual and query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16)


def _split(exact: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """A float32 output rounded to ``dtype``, and what the rounding took off (in ``dtype`` too):
    ``out + residual`` holds ``exact`` to about 16 more bits (the native kernel's forward writes the
    same pair itself, ``csrc/half.h``)."""
    out = exact.to(dtype)
    low = torch.where(torch.isfinite(exact), exact - out.float(), 0.0)  # as the kernel: 0 where not finite
    return out, low.to(dtype)


def _exact(out: Tensor, residual: Tensor | None) -> Tensor:
    """``out`` as computed: ``out + residual`` in float32 where there is a residual, else ``out``."""
    if residual is None or residual.numel() == 0:
        return out
    return out.float() + residual.float()


def _sink_gradient(grad_out: Tensor, grad_lse: Tensor | None, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """d loss / d sink_h = sum over rows of p_sink * (d lse - dO . O), ``p_sink = exp(sink - lse)``:
    the sink's probability, which takes mass from every key and adds to the lse."""
    p_sink = torch.exp(sinks.view(1, -1, 1).to(lse.dtype) - lse)
    row = -torch.einsum("...d,...d->...", grad_out.to(lse.dtype), out.to(lse.dtype))
    if grad_lse is not None:
        row = row + grad_lse
    return (p_sink * row).sum((0, 2)).to(sinks.dtype)


def _merge(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Results over disjoint key ranges merged by their lse (a row with no key anywhere: zeros, -inf)."""
    out, lse = parts[0]
    for part, part_lse in parts[1:]:
        merged = torch.logaddexp(lse, part_lse)
        finite = torch.where(torch.isfinite(merged), merged, torch.zeros_like(merged))
        out = out * torch.exp(lse - finite)[..., None] + part * torch.exp(part_lse - finite)[..., None]
        lse = merged
    return out, lse


def _in_float32(ranges: int, *tensors: Tensor) -> tuple[Tensor, ...]:
    """Half-precision tensors as float32 where the rows have several ranges: each range's result is
    merged with the others (outputs by their lse, gradients summed) before the one rounding to the
    call's dtype. With one range the kernel reads half precision itself (``csrc/half.h``)."""
    if ranges == 1 or tensors[0].dtype == torch.float32:
        return tensors
    return tuple(t.float() for t in tensors)


def _native_forward(inputs: IntervalInputs) -> tuple[Tensor, Tensor, Tensor]:
    """The native kernel over each of the rows' ranges (one call each), merged: ``(out, lse,
    residual)``, the residual empty for float32 and where neither the backward nor sinks (folded
    into the output as computed, so its bits do not depend on grad mode) need it."""
    seed_value, offsets = _seed_value(inputs.seed)
    ranges = inputs.lo.shape[1]
    query, key, value = _in_float32(ranges, inputs.query, inputs.key, inputs.value)
    keep = _keeps_residual(inputs.query, inputs.keep_residual or inputs.sinks is not None)
    results = [native.interval_forward(query, key, value, inputs.lo[:, r], inputs.hi[:, r], inputs.scale,
                                       dropout=inputs.dropout, seed=seed_value, dropout_start=offsets,
                                       softcap=inputs.softcap, alibi_slopes=inputs.alibi_slopes,
                                       residual=keep and ranges == 1)
               for r in range(ranges)]
    if ranges == 1:
        out, lse, *residual = results[0]
        return out, lse, residual[0] if residual else out.new_empty(0)
    out, lse = _merge([(out, lse) for out, lse, *_ in results])
    if not keep:
        return out.to(inputs.query.dtype), lse, out.new_empty(0)
    out, residual = _split(out, inputs.query.dtype)
    return out, lse, residual


def _native_backward(grad_out: Tensor, grad_lse: Tensor | None, out: Tensor, lse: Tensor, residual: Tensor | None,
                     inputs: IntervalInputs) -> tuple[Tensor, Tensor, Tensor]:
    """Its gradients: each range's, from the merged output and lse (split-key), summed. The row
    term reads the output with its residual where the forward left one."""
    seed_value, offsets = _seed_value(inputs.seed)
    ranges = inputs.lo.shape[1]
    if ranges > 1:
        out, residual = _exact(out, residual), None
    grad_out, out, query, key, value = _in_float32(ranges, grad_out, out, inputs.query, inputs.key, inputs.value)
    grads = [native.interval_backward(grad_out, query, key, value, out, lse, inputs.lo[:, r], inputs.hi[:, r],
                                      inputs.scale, grad_lse, dropout=inputs.dropout, seed=seed_value,
                                      dropout_start=offsets, softcap=inputs.softcap,
                                      alibi_slopes=inputs.alibi_slopes, out_low=residual,
                                      split_weights=inputs.sinks is not None)
             for r in range(ranges)]
    return tuple(sum(parts[1:], parts[0]).to(inputs.query.dtype) for parts in zip(*grads))


def _forward(inputs: IntervalInputs) -> tuple[Tensor, Tensor, Tensor, str]:
    """``(out, lse, residual, kernel)``: the kernel :func:`.policy.kernel_for` picks (or the record
    names), run. Sinks are folded into the output as computed, then rounded once. The kernels that
    return only a rounded output give a residual of zeros where the op keeps one."""
    kernel = policy.kernel_for(inputs)
    if kernel == "flex":
        raise ValueError("the interval op does not run FlexAttention: the tiled backend calls it directly")
    residual = None
    if kernel == "native":
        out, lse, residual = _native_forward(inputs)
    elif kernel == "triton":  # keeps masked-out pairs out itself: no check of its output (no host sync)
        out, lse = _triton().forward(inputs.query, inputs.key, inputs.value, inputs.lo, inputs.hi,
                                     scale=inputs.scale, softcap=inputs.softcap, alibi_slopes=inputs.alibi_slopes,
                                     dropout=inputs.dropout, seed=inputs.seed)
    else:
        out, lse = blockwise.forward(inputs.query, inputs.key, inputs.value, inputs.lo, inputs.hi, inputs.bias,
                                     inputs.scale, inputs.dropout, inputs.seed, softcap=inputs.softcap,
                                     alibi=inputs.alibi_slopes, dense=kernel == "dense",
                                     causal_only=inputs.causal_only)
    if inputs.sinks is not None:  # into the output as computed (the native kernel's residual), rounded once
        out, lse = fold_sinks(_exact(out, residual), lse, inputs.sinks)
        if out.dtype != inputs.query.dtype:
            out, residual = _split(out, inputs.query.dtype)
    if not _keeps_residual(inputs.query, inputs.keep_residual):
        residual = out.new_empty(0)
    elif residual is None:
        residual = torch.zeros_like(out)
    return out, lse, residual, kernel


def _backward_kernels(grad_out: Tensor, grad_lse: Tensor | None, out: Tensor, lse: Tensor, residual: Tensor | None,
                      kernel: str, inputs: IntervalInputs,
                      bias_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    if kernel == "native":
        return (*_native_backward(grad_out, grad_lse, out, lse, residual, inputs), None)
    if kernel == "triton":
        return (*_triton().backward(grad_out, grad_lse, inputs.query, inputs.key, inputs.value, out, lse, inputs.lo,
                                    inputs.hi, scale=inputs.scale, softcap=inputs.softcap,
                                    alibi_slopes=inputs.alibi_slopes, dropout=inputs.dropout, seed=inputs.seed),
                None)
    return blockwise.backward(grad_out, grad_lse, inputs.query, inputs.key, inputs.value, out, lse, inputs.lo,
                              inputs.hi, inputs.bias, inputs.scale, inputs.dropout, inputs.seed, bias_grad,
                              softcap=inputs.softcap, alibi=inputs.alibi_slopes, dense=kernel == "dense",
                              causal_only=inputs.causal_only)


def _triton():
    """attnkit's Triton kernel, imported on first use (triton is not a dependency of the core)."""
    from . import triton as triton_kernel

    return triton_kernel


# The op's schema lists IntervalInputs' fields in order (interval_inputs.py); the forward also returns
# the index of the kernel it ran (KERNELS, an int64 CPU scalar) for the backward to run the same one,
# and the output's residual (:func:`_keeps_residual`) for the backward's row term.
@torch.library.custom_op("attnkit::interval_attention", mutates_args=())
def interval_attention(query: Tensor, key: Tensor, value: Tensor, lo: Tensor, hi: Tensor, bias: Tensor | None,
                       alibi_slopes: Tensor | None, sinks: Tensor | None, scale: float, softcap: float | None,
                       dropout: float, seed: Tensor | None, causal_only: bool, sparse_only: bool,
                       kernel: str, keep_residual: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out, lse, residual, chosen = _forward(IntervalInputs(query, key, value, lo, hi, bias, alibi_slopes, sinks, scale,
                                                         softcap, dropout, seed, causal_only, sparse_only, kernel,
                                                         keep_residual))
    return out, lse, torch.tensor(KERNELS.index(chosen), dtype=torch.int64), residual


@interval_attention.register_fake
def _(query, key, value, lo, hi, bias, alibi_slopes, sinks, scale, softcap, dropout, seed, causal_only, sparse_only,
      kernel, keep_residual):
    out = query.new_empty(*query.shape[:-1], value.shape[-1])
    residual = out.new_empty(out.shape) if _keeps_residual(query, keep_residual) else out.new_empty(0)
    return (out, query.new_empty(query.shape[:-1], dtype=work_dtype(query.dtype)), torch.empty((), dtype=torch.int64),
            residual)


@torch.library.custom_op("attnkit::interval_attention_backward", mutates_args=())
def interval_attention_backward(grad_out: Tensor, grad_lse: Tensor | None, out: Tensor, lse: Tensor,
                                ran: Tensor | None, query: Tensor, key: Tensor, value: Tensor, lo: Tensor,
                                hi: Tensor, bias: Tensor | None, alibi_slopes: Tensor | None, sinks: Tensor | None,
                                scale: float, softcap: float | None, dropout: float, seed: Tensor | None,
                                causal_only: bool, sparse_only: bool, kernel: str, keep_residual: bool,
                                bias_grad: bool, residual: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dbias, dsinks)``; ``dbias`` shaped like ``bias`` when ``bias_grad``, ``dsinks``
    like ``sinks``, else empty. ``out`` and ``lse`` are the forward's (sinks included: the keys'
    weights are ``exp(s - lse)`` all the same); ``ran`` the kernel index the forward returned (None:
    chosen again from the same data, as the forward chose); ``residual`` the forward's (None or
    empty: ``out`` as it is, for callers that merged several calls' outputs)."""
    inputs = IntervalInputs(query, key, value, lo, hi, bias, alibi_slopes, sinks, scale, softcap, dropout, seed,
                            causal_only, sparse_only, kernel, keep_residual)
    chosen = policy.kernel_for(inputs) if ran is None else KERNELS[int(ran)]
    dq, dk, dv, dbias = _backward_kernels(grad_out, grad_lse, out, lse, residual, chosen, inputs, bias_grad)
    dsinks = query.new_empty(0) if sinks is None else _sink_gradient(grad_out, grad_lse, _exact(out, residual), lse,
                                                                     sinks)
    return dq, dk, dv, query.new_empty(0) if dbias is None else dbias, dsinks


@interval_attention_backward.register_fake
def _(grad_out, grad_lse, out, lse, ran, query, key, value, lo, hi, bias, alibi_slopes, sinks, scale, softcap,
      dropout, seed, causal_only, sparse_only, kernel, keep_residual, bias_grad, residual):
    dbias = bias.new_empty(bias.shape) if bias_grad else query.new_empty(0)
    dsinks = query.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), dbias, dsinks


def forward_op(inputs: IntervalInputs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``torch.ops.attnkit.interval_attention`` on a record: ``(out, lse, kernel index, residual)``."""
    return torch.ops.attnkit.interval_attention(*inputs.as_tuple())


def backward_op(grad_out: Tensor, grad_lse: Tensor | None, out: Tensor, lse: Tensor, ran: Tensor | None,
                inputs: IntervalInputs, bias_grad: bool = False,
                residual: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``torch.ops.attnkit.interval_attention_backward`` on a record; ``residual`` is
    :func:`forward_op`'s, where ``out`` is that call's own output."""
    return torch.ops.attnkit.interval_attention_backward(grad_out, grad_lse, out, lse, ran, *inputs.as_tuple(),
                                                         bias_grad, residual)


# -- autograd ----------------------------------------------------------------------------------------

_NAMES = IntervalInputs.names()
_SCALARS = tuple(name for name in _NAMES if name not in TENSOR_FIELDS)
_NO_GRADIENTS = IntervalInputs(*([None] * len(_NAMES)))


def _setup_context(ctx, inputs, output) -> None:
    record = IntervalInputs(*inputs)
    out, lse, ran, residual = output
    ctx.save_for_backward(*record.tensors(), out, lse, ran, residual)
    ctx.mark_non_differentiable(ran, residual)  # the residual serves the backward only
    ctx.scalars = {name: getattr(record, name) for name in _SCALARS}
    ctx.set_materialize_grads(False)  # an unused lse gets no gradient: the fused kernels' backward applies


def _backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None, _grad_ran: Tensor | None = None,
              _grad_residual: Tensor | None = None):
    *tensors, out, lse, ran, residual = ctx.saved_tensors
    inputs = IntervalInputs(**dict(zip(TENSOR_FIELDS, tensors)), **ctx.scalars)
    wants = dict(zip(_NAMES, ctx.needs_input_grad))
    bias_grad = inputs.bias is not None and wants["bias"]
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    grads = None
    create_graph = torch.is_grad_enabled()  # create_graph=True: this backward must be differentiable too
    if create_graph or _needs_dense_backward(grad_out, ran, inputs):
        grads = _dense_backward(wants, grad_out, grad_lse, inputs, create_graph)
    if grads is None:
        grads = backward_op(grad_out, grad_lse, out, lse, ran, inputs, bias_grad, residual)
    dq, dk, dv, dbias, dsinks = grads
    return _NO_GRADIENTS.replace(
        query=dq, key=dk, value=dv, bias=dbias if bias_grad else None,
        sinks=dsinks if inputs.sinks is not None and wants["sinks"] else None).as_tuple()


def _needs_dense_backward(grad_out: Tensor, ran: Tensor | None, inputs: IntervalInputs) -> bool:
    """Whether the kernels' backward could differ from the definition where it meets NaN or inf:
    the block kernels multiply masked-out pairs, so whenever an input is not finite; the native
    kernel keeps them out itself, but a NaN or inf in grad_out meets delta = rowsum(dO * O), which
    differs from autograd's sum over the keys there. Not beyond the pairwise products' limit
    (``numerics.pairwise_fits``): the kernels' gradients then stand."""
    if not can_read(inputs.query, grad_out) or _torch_private.legacy_batched(grad_out):
        return False
    if _runs_native(ran, inputs):
        return pairwise_fits(inputs.query, inputs.key) and not all_finite(grad_out)
    return needs_pairwise(inputs.query, inputs.key, inputs.value, inputs.scale, grad_out)


def _runs_native(ran: Tensor | None, inputs: IntervalInputs) -> bool:
    """Whether the backward runs the native kernel (which keeps masked-out pairs out itself)."""
    return (policy.kernel_for(inputs) if ran is None else KERNELS[int(ran)]) == "native"


@dataclass(frozen=True)
class _Saved:
    """What :func:`_backward` reads of an autograd context, for :func:`gradients`."""

    saved_tensors: tuple
    needs_input_grad: tuple[bool, ...]
    scalars: dict


def gradients(grad_out: Tensor, grad_lse: Tensor | None, out: Tensor, lse: Tensor,
              inputs: IntervalInputs) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of the op's call from its ``out`` and ``lse``, as its autograd computes them
    (the kernels' backward, or the dense recomputation where an input is not finite), for callers
    that ran the op outside autograd and kept only its output and lse (``attnkit.distributed``'s
    Ulysses, group by group). The kernel is chosen from the same data as the forward's was."""
    wants = tuple(name in ("query", "key", "value") for name in _NAMES)
    ctx = _Saved((*inputs.tensors(), out, lse, None, None), wants, {name: getattr(inputs, name) for name in _SCALARS})
    return _backward(ctx, grad_out, grad_lse)[:3]


def _dense_backward(wants: dict[str, bool], grad_out: Tensor, grad_lse: Tensor | None, inputs: IntervalInputs,
                    create_graph: bool):
    """The gradients by autograd through the call recomputed densely in plain ops (pairwise products
    where an input is not finite, so masked-out pairs stay out): for second-order uses
    (``create_graph``, the gradients then form a graph) and for inputs holding NaN or inf (the
    kernels' products would let a masked-out NaN in). None where there is no graph to
    differentiate (inside ``torch.func`` transforms, which differentiate on their own levels)."""
    names = ["query", "key", "value"] + [name for name in ("bias", "sinks") if getattr(inputs, name) is not None]
    candidates = {name: getattr(inputs, name) for name in names}
    if not create_graph:
        candidates = {name: t.detach().requires_grad_(wants[name]) for name, t in candidates.items()}
    chosen = [name for name, t in candidates.items() if wants[name] and t.requires_grad]
    if not chosen:
        return None
    exact = needs_pairwise(inputs.query, inputs.key, inputs.value, inputs.scale)
    with torch.enable_grad():
        out, lse, _ = blockwise.dense_attention(candidates["query"], candidates["key"], candidates["value"], inputs.lo,
                                                inputs.hi, candidates.get("bias"), inputs.scale, inputs.dropout,
                                                inputs.seed, exact=exact, softcap=inputs.softcap,
                                                alibi=inputs.alibi_slopes, sinks=candidates.get("sinks"))
        # in the graph too: a backward runs with grad mode off, and an lse outside the graph has no
        # gradient to give
        lse = lse.masked_fill(torch.isneginf(lse), 0.0)  # rows with no key: a constant
    if not out.requires_grad:
        return None
    outputs, grads = [out], [grad_out]
    if grad_lse is not None and lse.requires_grad:  # it does not depend on the values alone
        outputs.append(lse)
        grads.append(grad_lse)
    found = torch.autograd.grad(outputs, [candidates[name] for name in chosen], grads, create_graph=create_graph,
                                allow_unused=True)
    result: dict[str, Tensor | None] = dict(zip(chosen, found))
    return tuple(_zeros_if_none(result.get(name), getattr(inputs, name))
                 for name in ("query", "key", "value", "bias", "sinks"))


def _zeros_if_none(grad: Tensor | None, like: Tensor | None) -> Tensor | None:
    return None if like is None else grad if grad is not None else torch.zeros_like(like)


interval_attention.register_autograd(_backward, setup_context=_setup_context)
_torch_private.eager_first_call(interval_attention)
_torch_private.eager_first_call(interval_attention_backward)


class IntervalAttention(torch.autograd.Function):
    """The op with the same autograd, as a ``torch.autograd.Function`` with ``setup_context``: the
    form ``torch.func`` transforms accept (``grad``, ``vmap``, ``jacrev``; ops registered with
    ``torch.library.register_autograd`` are refused by them in torch 2.13), and which
    ``torch.compile`` traces into forward and backward graphs. The tiled backend calls
    :func:`run`, which applies it to a record."""

    generate_vmap_rule = True  # vmaps forward and backward, i.e. the two ops' vmap rules below

    @staticmethod
    def forward(query, key, value, lo, hi, bias, alibi_slopes, sinks, scale, softcap, dropout, seed, causal_only,
                sparse_only, kernel, keep_residual):  # IntervalInputs' fields (Dynamo needs them spelled out)
        return torch.ops.attnkit.interval_attention(query, key, value, lo, hi, bias, alibi_slopes, sinks, scale,
                                                    softcap, dropout, seed, causal_only, sparse_only, kernel,
                                                    keep_residual)

    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)


class IntervalAttentionForwardMode(IntervalAttention):
    """:class:`IntervalAttention` with a forward-mode rule, for calls under forward-mode AD only
    (Dynamo refuses to trace a Function that defines ``jvp``)."""

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _setup_context(ctx, inputs, output)
        tensors = IntervalInputs(*inputs).tensors()
        ctx.save_for_forward(*(t for t in tensors if t is not None))
        ctx.present = tuple(t is not None for t in tensors)

    @staticmethod
    def jvp(ctx, *tangents):
        """Forward-mode AD (``torch.func.jvp``, ``jacfwd``, ``torch.autograd.forward_ad``): the
        tangents of ``(out, lse)`` through the call recomputed densely in plain ops, as second-order
        gradients are (:func:`_dense_backward`): by ``torch.func.jvp`` inside ``torch.func``
        transforms, else by two reverse passes (the tangent is the derivative of ``vjp(u) .
        tangent`` with respect to ``u``), as forward mode cannot nest inside ``forward_ad``'s dual
        level and reverse mode cannot run on a transform's tensors."""
        saved = iter(ctx.saved_tensors)
        tensors = [next(saved) if present else None for present in ctx.present]
        inputs = IntervalInputs(**dict(zip(TENSOR_FIELDS, tensors)), **ctx.scalars)
        tangent_of = dict(zip(_NAMES, tangents))
        moving = [name for name in ("query", "key", "value", "bias", "alibi_slopes", "sinks")
                  if getattr(inputs, name) is not None and tangent_of[name] is not None]
        if not moving:
            return None, None, None, None

        def recomputed(*values):  # the call in plain ops; the lse of a row with no key a constant
            out, lse = plain_ops(inputs.replace(**dict(zip(moving, values))))
            return out, lse.masked_fill(torch.isneginf(lse), 0.0)

        primals = tuple(getattr(inputs, name) for name in moving)
        directions = tuple(tangent_of[name] for name in moving)
        if _torch_private.functorch_active():
            return (*torch.func.jvp(recomputed, primals, directions)[1], None, None)
        with torch.enable_grad():
            primals = tuple(t.detach().requires_grad_() for t in primals)
            outputs = recomputed(*primals)
            moved = [t for t in outputs if t.requires_grad]  # the lse does not move with the values
            cotangents = [torch.zeros_like(t, requires_grad=True) for t in moved]
            vjps = torch.autograd.grad(moved, primals, cotangents, create_graph=True, allow_unused=True)
            used = [(vjp, t) for vjp, t in zip(vjps, directions) if vjp is not None and vjp.requires_grad]
            found = iter(torch.autograd.grad([vjp for vjp, _ in used], cotangents, [t for _, t in used],
                                             allow_unused=True) if used else [None] * len(moved))
        tangents_out = [next(found) if t.requires_grad else None for t in outputs]
        return (*(torch.zeros_like(o) if t is None else t for o, t in zip(outputs, tangents_out)), None, None)


def run(inputs: IntervalInputs) -> tuple[Tensor, Tensor]:
    """``(out [N, H, Lq, Dv], lse [N, H, Lq])`` of the op on ``inputs``, differentiable. In plain
    eager calls the op itself (its registered autograd is the same): ``autograd.Function.apply``
    with ``setup_context`` binds its arguments by ``inspect.signature`` on every call, a quarter of
    a small call's host time (measured: 0.24 of 0.9 ms, benchmarks/gpu_overhead.py's profile)."""
    if _torch_private.nested_differentiation():
        return plain_ops(inputs)
    # a backward may follow (under torch.func transforms the wrapped inputs may not say so: kept there)
    if torch.is_grad_enabled() and (any(t is not None and t.requires_grad for t in inputs.tensors())
                                    or _torch_private.functorch_active()):
        inputs = inputs.replace(keep_residual=True)
    if _torch_private.forward_ad_active():
        out, lse, *_ = IntervalAttentionForwardMode.apply(*inputs.as_tuple())
    elif torch.compiler.is_compiling() or any(_torch_private.without_values(t) for t in inputs.tensors()
                                               if t is not None):
        out, lse, *_ = IntervalAttention.apply(*inputs.as_tuple())
    else:
        out, lse, *_ = torch.ops.attnkit.interval_attention(*inputs.as_tuple())
    return out, lse


def plain_ops(inputs: IntervalInputs) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of the call in plain differentiable ops over the whole score matrix, for
    ``torch.func`` transforms that differentiate twice (``hessian``, ``jacfwd(jacfwd(f))``,
    ``grad(grad(f))``, ``jacrev(jacrev(f))``): the op's backward and its forward-mode rule are
    kernels that the outer level cannot differentiate, and would take for constants (second
    derivatives silently missing terms), where plain ops compose at every level."""
    out, lse, _ = blockwise.dense_attention(inputs.query, inputs.key, inputs.value, inputs.lo, inputs.hi,
                                            inputs.bias, inputs.scale, inputs.dropout, inputs.seed, exact=False,
                                            softcap=inputs.softcap, alibi=inputs.alibi_slopes, sinks=inputs.sinks)
    return out, lse


# -- vmap: the vmapped dim joins the batch ------------------------------------------------------------


def _batched(t: Tensor, dim: int | None, size: int) -> Tensor:
    """``t`` with its vmapped dim first (``[V, ...]``), expanded when it is not vmapped."""
    return t.movedim(dim, 0) if dim is not None else t.expand(size, *t.shape)


def _fold_rows(t: Tensor, dim: int | None, size: int, batch: int) -> Tensor:
    """Per-sequence data ``[S, ...]`` (S = 1 shared, or ``batch``) for the folded batch
    ``[size * batch, ...]``; left shared (``[1, ...]``) when neither vmapped nor per-sequence."""
    if dim is None and t.shape[0] == 1:
        return t
    t = _batched(t, dim, size)
    return t.expand(size, batch, *t.shape[2:]).reshape(size * batch, *t.shape[2:])


def _fold(t: Tensor, dim: int | None, size: int) -> Tensor:
    t = _batched(t, dim, size)
    return t.reshape(size * t.shape[1], *t.shape[2:])


def _fold_slopes(slopes: Tensor | None, dim: int | None, size: int, batch: int) -> Tensor | None:
    """ALiBi slopes ``[H]`` (shared, left alone) or ``[N, H]`` for the folded batch."""
    if slopes is None or (dim is None and slopes.dim() == 1):
        return slopes
    slopes = _batched(slopes, dim, size)
    return slopes.expand(size, batch, slopes.shape[-1]).reshape(size * batch, slopes.shape[-1])


def _unbatched(name: str, dim: int | None) -> None:
    if dim is not None:
        raise NotImplementedError(f"attnkit.attention under vmap takes one {name} for all samples")


def _folded(inputs: IntervalInputs, dims: IntervalInputs, size: int) -> IntervalInputs:
    """The record with the vmapped dim folded into the batch (see the helpers above)."""
    query = _fold(inputs.query, dims.query, size)
    batch = query.shape[0] // size
    return inputs.replace(
        query=query, key=_fold(inputs.key, dims.key, size), value=_fold(inputs.value, dims.value, size),
        lo=_fold_rows(inputs.lo, dims.lo, size, batch), hi=_fold_rows(inputs.hi, dims.hi, size, batch),
        bias=None if inputs.bias is None else _fold_rows(inputs.bias, dims.bias, size, batch),
        alibi_slopes=_fold_slopes(inputs.alibi_slopes, dims.alibi_slopes, size, batch))


def _sample(inputs: IntervalInputs, dims: IntervalInputs, index: int) -> IntervalInputs:
    """Sample ``index`` of a vmapped record: each vmapped tensor at that index, the others as they are."""
    return inputs.replace(**{name: getattr(inputs, name).select(getattr(dims, name), index)
                             for name in TENSOR_FIELDS if getattr(dims, name) is not None})


def _stacked(results: list[tuple], dims: list[int | None]) -> tuple:
    """Per-sample results of the op stacked along a new vmapped dim 0 where ``dims`` says 0."""
    return tuple(torch.stack(parts) if dim == 0 else parts[0] for parts, dim in zip(zip(*results), dims))


# With dropout each sample runs on its own: the pattern is a function of (seed, batch, head, row,
# key), so folding samples into the batch would give each its own pattern under vmap's
# randomness="same" (where every sample must draw alike), and "different" gives each sample a seed.


@torch.library.register_vmap("attnkit::interval_attention")
def _(info, in_dims, *args):
    size = info.batch_size
    original, dims = IntervalInputs(*args), IntervalInputs(*in_dims)
    _unbatched("set of sinks", dims.sinks)
    if original.dropout > 0:
        results = [forward_op(_sample(original, dims, index)) for index in range(size)]
        dims_out = (0, 0, None, 0 if results[0][3].numel() else None)
        return _stacked(results, list(dims_out)), dims_out
    out, lse, ran, residual = forward_op(_folded(original, dims, size))
    batch = out.shape[0] // size

    def unfold(t: Tensor) -> Tensor:
        return t.reshape(size, batch, *t.shape[1:])

    if residual.numel():  # else empty, not batched
        return (unfold(out), unfold(lse), ran, unfold(residual)), (0, 0, None, 0)
    return (unfold(out), unfold(lse), ran, residual), (0, 0, None, None)


@torch.library.register_vmap("attnkit::interval_attention_backward")
def _(info, in_dims, *args):
    # Gradients are never differentiated through this op (second order recomputes densely,
    # _dense_backward), and under torch.func.grad(vmap(f)) its inputs still track the grad level:
    # the op's autograd layer would then wrap the call in an autograd.Function without
    # setup_context, which functorch refuses. So the batched call runs with grad mode off.
    with torch.no_grad():
        return _backward_batched(info, in_dims, *args)


def _backward_batched(info, in_dims, grad_out, grad_lse, out, lse, ran, *args):
    size = info.batch_size
    go_dim, gl_dim, o_dim, l_dim, _ = in_dims[:5]
    *fields, bias_grad, residual = args
    r_dim = in_dims[-1]
    if residual is not None and residual.numel() == 0:
        residual, r_dim = None, None
    dims = IntervalInputs(*in_dims[5:5 + len(fields)])
    original = IntervalInputs(*fields)
    _unbatched("set of sinks", dims.sinks)
    if original.dropout > 0:  # each sample on its own, as its forward ran
        given = [(grad_out, go_dim), (grad_lse, gl_dim), (out, o_dim), (lse, l_dim), (residual, r_dim)]
        results = []
        for index in range(size):
            go, gl, o, ls, low = (t if t is None or d is None else t.select(d, index) for t, d in given)
            results.append(backward_op(go, gl, o, ls, ran, _sample(original, dims, index), bias_grad, low))
        stacked_dims = [0, 0, 0, 0 if bias_grad else None, 0 if original.sinks is not None else None]
        return _stacked(results, stacked_dims), tuple(stacked_dims)
    inputs = _folded(original, dims, size)
    batch = inputs.query.shape[0] // size
    if original.bias is not None:  # per sample when its gradient is asked: every sample's own copy
        b = _batched(original.bias, dims.bias, size)
        b = b.expand(size, batch, *b.shape[2:]) if bias_grad or dims.bias is not None or b.shape[1] > 1 else b
        inputs = inputs.replace(bias=b.reshape(-1, *b.shape[2:]))
    dq, dk, dv, dbias, dsinks = backward_op(
        _fold(grad_out, go_dim, size), None if grad_lse is None else _fold(grad_lse, gl_dim, size),
        _fold(out, o_dim, size), _fold(lse, l_dim, size), ran, inputs, bias_grad,
        None if residual is None else _fold(residual, r_dim, size))
    unfold = [t.reshape(size, batch, *t.shape[1:]) for t in (dq, dk, dv)]
    out_dims = [0, 0, 0, None, None]
    if bias_grad:
        dbias = dbias.reshape(size, batch, *dbias.shape[1:])
        dbias = dbias.sum(1, keepdim=True) if original.bias.shape[0 if dims.bias is None else 1] == 1 else dbias
        out_dims[3] = 0
    if original.sinks is not None:  # each sample's own: the op summed over the folded batch
        exact = _exact(out, residual)  # same dims as out: a residual is vmapped with it
        per_sample = [_batched(t, d, size) for t, d in ((grad_out, go_dim), (exact, o_dim), (lse, l_dim))]
        d_lse = None if grad_lse is None else _batched(grad_lse, gl_dim, size)
        dsinks = torch.stack([_sink_gradient(per_sample[0][v], None if d_lse is None else d_lse[v], per_sample[1][v],
                                             per_sample[2][v], original.sinks) for v in range(size)])
        out_dims[4] = 0
    return (*unfold, dbias, dsinks), tuple(out_dims)
