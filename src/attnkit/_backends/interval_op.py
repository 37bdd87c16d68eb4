"""The tiled backend's computation as PyTorch custom ops: ``attnkit::interval_attention`` and its
backward, so that ``torch.compile``, ``torch.func`` and autograd hooks see one op, not Python.

    torch.ops.attnkit.interval_attention(query, key, value, lo, hi, bias, alibi_slopes, sinks,
        scale, softcap, dropout, seed, causal_only, sparse_only) -> (output [N, H, Lq, Dv], lse [N, H, Lq])

Row ``i`` of sequence ``n`` attends keys ``lo[s, r, i] <= j < hi[s, r, i]`` for each of its R
ranges (``lo, hi [S, R, Lq]``, int64, disjoint, ``s = n`` or 0 when S = 1), plus an optional additive ``bias`` broadcastable to ``[N, H, Lq, Lk]``
(as ``[Nm, Hm, Lq, Lk]``); ``query [N, H, Lq, D]``, ``key [N, Hkv, Lk, D]``, ``value [N, Hkv, Lk,
Dv]`` with ``H % Hkv == 0`` (GQA). Scores are ``scale * q.k``, soft-capped (``softcap * tanh(s /
softcap)``), plus ALiBi (``-slope * |p - j|``, ``alibi_slopes [H]`` or ``[N, H]``), plus the bias;
``sinks [H]`` joins every row's normaliser. Dropout ``dropout`` from the int64 scalar ``seed``
(or ``[seed, h0, i0, j0]`` for a piece of a larger call, :func:`.dropout.at_positions`). The lse is
float32 for half-precision inputs, ``-inf`` for rows with no key (and no sink).

Layers of this module:
- the ops' implementation picks its kernel at run time from the data (:func:`.policy.kernel_for`):
  attnkit's native kernel (float32 CPU, no bias, kernel built), PyTorch's kernels block by block
  (:mod:`.blockwise`), or, unless ``sparse_only`` (an explicit ``backend="tiled"``), PyTorch's fused
  kernel over the dense mask where that is faster (``causal_only``: the mask is plain causal, which
  that kernel applies itself). All agree to rounding and draw the same dropout pattern, so a
  forward on one and a backward on another is still exact. Sinks are folded in around the kernels
  (:func:`_with_sinks`): they only rescale rows;
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
from .numerics import all_finite, can_read, needs_pairwise, work_dtype

__all__ = ["interval_attention", "IntervalAttention", "gradients"]


def _seed_value(seed: Tensor | None) -> tuple[int, tuple[int, int, int]]:
    """The kernel's seed and the piece's (head, row, key) offsets (see :func:`.dropout.at_positions`)."""
    if seed is None:
        return 0, (0, 0, 0)
    if _dropout.has_offsets(seed):
        value, heads, rows, keys = (int(x) for x in seed.tolist())
        return value, (heads, rows, keys)
    return int(seed), (0, 0, 0)


def _with_sinks(out: Tensor, lse: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """Fold each head's sink logit into rows computed over the keys alone: the normaliser gains
    ``exp(sink)``, so ``lse = logaddexp(lse, sink)`` and the output shrinks by ``exp(old - new lse)``
    (a row with no key keeps zeros, its lse becomes the sink)."""
    if sinks is None:
        return out, lse
    sink = sinks.view(1, -1, 1).to(lse.dtype)
    total = torch.logaddexp(lse, sink)
    return out * torch.exp(lse - total)[..., None].to(out.dtype), total


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


def _native_forward(query, key, value, lo, hi, scale, dropout, seed, softcap, alibi) -> tuple[Tensor, Tensor]:
    """The native kernel over each of the rows' ranges (one call each), merged."""
    seed_value, offsets = _seed_value(seed)
    return _merge([native.interval_forward(query, key, value, lo[:, r], hi[:, r], scale, dropout=dropout,
                                           seed=seed_value, dropout_start=offsets, softcap=softcap,
                                           alibi_slopes=alibi)
                   for r in range(lo.shape[1])])


def _native_backward(grad_out, grad_lse, query, key, value, out, lse, lo, hi, scale, dropout, seed, softcap, alibi):
    """Its gradients: each range's, from the merged output and lse (split-key), summed."""
    seed_value, offsets = _seed_value(seed)
    grads = [native.interval_backward(grad_out, query, key, value, out, lse, lo[:, r], hi[:, r], scale, grad_lse,
                                      dropout=dropout, seed=seed_value, dropout_start=offsets, softcap=softcap,
                                      alibi_slopes=alibi)
             for r in range(lo.shape[1])]
    return tuple(sum(parts[1:], parts[0]) for parts in zip(*grads))


@torch.library.custom_op("attnkit::interval_attention", mutates_args=())
def interval_attention(query: Tensor, key: Tensor, value: Tensor, lo: Tensor, hi: Tensor, bias: Tensor | None,
                       alibi_slopes: Tensor | None, sinks: Tensor | None, scale: float, softcap: float | None,
                       dropout: float, seed: Tensor | None, causal_only: bool,
                       sparse_only: bool) -> tuple[Tensor, Tensor]:
    kernel = policy.kernel_for(query, key, value, lo, hi, bias, dropout, causal_only, sparse_only, softcap,
                               alibi_slopes, seed)
    if kernel == "native":
        out, lse = _native_forward(query, key, value, lo, hi, scale, dropout, seed, softcap, alibi_slopes)
    else:
        out, lse = blockwise.forward(query, key, value, lo, hi, bias, scale, dropout, seed, softcap=softcap,
                                     alibi=alibi_slopes, dense=kernel == "dense", causal_only=causal_only)
    return _with_sinks(out, lse, sinks)


@interval_attention.register_fake
def _(query, key, value, lo, hi, bias, alibi_slopes, sinks, scale, softcap, dropout, seed, causal_only, sparse_only):
    out = query.new_empty(*query.shape[:-1], value.shape[-1])
    return out, query.new_empty(query.shape[:-1], dtype=work_dtype(query.dtype))


@torch.library.custom_op("attnkit::interval_attention_backward", mutates_args=())
def interval_attention_backward(grad_out: Tensor, grad_lse: Tensor | None, query: Tensor, key: Tensor, value: Tensor,
                                out: Tensor, lse: Tensor, lo: Tensor, hi: Tensor, bias: Tensor | None,
                                alibi_slopes: Tensor | None, sinks: Tensor | None, scale: float,
                                softcap: float | None, dropout: float, seed: Tensor | None, causal_only: bool,
                                sparse_only: bool, bias_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dbias, dsinks)``; ``dbias`` shaped like ``bias`` when ``bias_grad``, ``dsinks``
    like ``sinks``, else empty. ``out`` and ``lse`` are the forward's (sinks included: the keys'
    weights are ``exp(s - lse)`` all the same). The kernel is chosen as the forward's was."""
    kernel = policy.kernel_for(query, key, value, lo, hi, bias, dropout, causal_only, sparse_only, softcap,
                               alibi_slopes, seed)
    if kernel == "native":
        dq, dk, dv = _native_backward(grad_out, grad_lse, query, key, value, out, lse, lo, hi, scale, dropout, seed,
                                      softcap, alibi_slopes)
        dbias = None
    else:
        dq, dk, dv, dbias = blockwise.backward(grad_out, grad_lse, query, key, value, out, lse, lo, hi, bias, scale,
                                               dropout, seed, bias_grad, softcap=softcap, alibi=alibi_slopes,
                                               dense=kernel == "dense", causal_only=causal_only)
    dsinks = query.new_empty(0) if sinks is None else _sink_gradient(grad_out, grad_lse, out, lse, sinks)
    return dq, dk, dv, query.new_empty(0) if dbias is None else dbias, dsinks


@interval_attention_backward.register_fake
def _(grad_out, grad_lse, query, key, value, out, lse, lo, hi, bias, alibi_slopes, sinks, scale, softcap, dropout,
      seed, causal_only, sparse_only, bias_grad):
    dbias = bias.new_empty(bias.shape) if bias_grad else query.new_empty(0)
    dsinks = query.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), dbias, dsinks


# -- autograd ----------------------------------------------------------------------------------------

# Positions of the op's inputs that can take a gradient.
_QUERY, _KEY, _VALUE, _BIAS, _SINKS = 0, 1, 2, 5, 7
_INPUTS = 14


def _setup_context(ctx, inputs, output) -> None:
    (query, key, value, lo, hi, bias, alibi_slopes, sinks, scale, softcap, dropout, seed, causal_only,
     sparse_only) = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, lo, hi, bias, alibi_slopes, sinks, seed, out, lse)
    ctx.scale, ctx.softcap, ctx.dropout = scale, softcap, dropout
    ctx.causal_only, ctx.sparse_only = causal_only, sparse_only
    ctx.set_materialize_grads(False)  # an unused lse gets no gradient: the fused kernels' backward applies


def _backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
    query, key, value, lo, hi, bias, alibi, sinks, seed, out, lse = ctx.saved_tensors
    bias_grad = bias is not None and ctx.needs_input_grad[_BIAS]
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    grads = None
    create_graph = torch.is_grad_enabled()  # create_graph=True: this backward must be differentiable too
    if create_graph or (can_read(query, grad_out) and _kernel(ctx, query, key, value, lo, hi, bias, alibi, seed) != "native"
                        and (needs_pairwise(query, key, value, ctx.scale) or not all_finite(grad_out))):
        grads = _dense_backward(ctx, grad_out, grad_lse, query, key, value, lo, hi, bias, alibi, sinks, seed,
                                create_graph)
    if grads is None:
        grads = torch.ops.attnkit.interval_attention_backward(
            grad_out, grad_lse, query, key, value, out, lse, lo, hi, bias, alibi, sinks, ctx.scale, ctx.softcap,
            ctx.dropout, seed, ctx.causal_only, ctx.sparse_only, bias_grad)
    dq, dk, dv, dbias, dsinks = grads
    result = [None] * _INPUTS
    result[_QUERY], result[_KEY], result[_VALUE] = dq, dk, dv
    result[_BIAS] = dbias if bias_grad else None
    result[_SINKS] = dsinks if sinks is not None and ctx.needs_input_grad[_SINKS] else None
    return tuple(result)


@dataclass(frozen=True)
class _Saved:
    """What :func:`_backward` reads of an autograd context, for :func:`gradients`."""

    saved_tensors: tuple
    needs_input_grad: tuple[bool, ...]
    scale: float
    softcap: float | None
    dropout: float
    causal_only: bool
    sparse_only: bool


def gradients(grad_out: Tensor, grad_lse: Tensor | None, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
              lse: Tensor, lo: Tensor, hi: Tensor, bias: Tensor | None, alibi_slopes: Tensor | None,
              sinks: Tensor | None, scale: float, softcap: float | None, dropout: float, seed: Tensor | None,
              causal_only: bool, sparse_only: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of the op's call from its ``out`` and ``lse``, as its autograd computes them
    (the kernels' backward, or the dense recomputation where an input is not finite), for callers
    that ran the op outside autograd and kept only its output and lse (``attnkit.distributed``'s
    Ulysses, group by group)."""
    wants = [False] * _INPUTS
    wants[_QUERY] = wants[_KEY] = wants[_VALUE] = True
    ctx = _Saved((query, key, value, lo, hi, bias, alibi_slopes, sinks, seed, out, lse), tuple(wants), scale, softcap,
                 dropout, causal_only, sparse_only)
    return _backward(ctx, grad_out, grad_lse)[:3]


def _kernel(ctx, query, key, value, lo, hi, bias, alibi, seed) -> str:
    """The kernel the op's backward will run (the native one keeps masked-out pairs out itself)."""
    return policy.kernel_for(query, key, value, lo, hi, bias, ctx.dropout, ctx.causal_only, ctx.sparse_only,
                             ctx.softcap, alibi, seed)


def _dense_backward(ctx, grad_out, grad_lse, query, key, value, lo, hi, bias, alibi, sinks, seed, create_graph):
    """The gradients by autograd through the call recomputed densely in plain ops (pairwise products
    where an input is not finite, so masked-out pairs stay out): for second-order uses
    (``create_graph``, the gradients then form a graph) and for inputs holding NaN or inf (the
    kernels' products would let a masked-out NaN in). None where there is no graph to
    differentiate (inside ``torch.func`` transforms, which differentiate on their own levels)."""
    wants = ctx.needs_input_grad
    candidates = [(_QUERY, query), (_KEY, key), (_VALUE, value)]
    candidates += [(index, t) for index, t in ((_BIAS, bias), (_SINKS, sinks)) if t is not None]
    if not create_graph:
        candidates = [(index, t.detach().requires_grad_(wants[index])) for index, t in candidates]
    chosen = [(index, t) for index, t in candidates if wants[index] and t.requires_grad]
    if not chosen:
        return None
    inputs = dict(candidates)
    exact = needs_pairwise(query, key, value, ctx.scale)
    with torch.enable_grad():
        out, lse, _ = blockwise.dense_attention(inputs[_QUERY], inputs[_KEY], inputs[_VALUE], lo, hi,
                                                inputs.get(_BIAS), ctx.scale, ctx.dropout, seed, exact=exact,
                                                softcap=ctx.softcap, alibi=alibi, sinks=inputs.get(_SINKS))
    if not out.requires_grad:
        return None
    outputs, grads = [out], [grad_out]
    if grad_lse is not None:
        outputs.append(lse.masked_fill(torch.isneginf(lse), 0.0))  # rows with no key: a constant
        grads.append(grad_lse)
    found = torch.autograd.grad(outputs, [t for _, t in chosen], grads, create_graph=create_graph, allow_unused=True)
    result: dict[int, Tensor | None] = {index: g for (index, _), g in zip(chosen, found)}
    return tuple(_zeros_if_none(result.get(index), like) for index, like in
                 ((_QUERY, query), (_KEY, key), (_VALUE, value), (_BIAS, bias), (_SINKS, sinks)))


def _zeros_if_none(grad: Tensor | None, like: Tensor | None) -> Tensor | None:
    return None if like is None else grad if grad is not None else torch.zeros_like(like)


interval_attention.register_autograd(_backward, setup_context=_setup_context)
_torch_private.eager_first_call(interval_attention)
_torch_private.eager_first_call(interval_attention_backward)


class IntervalAttention(torch.autograd.Function):
    """The op with the same autograd, as a ``torch.autograd.Function`` with ``setup_context``: the
    form ``torch.func`` transforms accept (``grad``, ``vmap``, ``jacrev``; ops registered with
    ``torch.library.register_autograd`` are refused by them in torch 2.13), and which
    ``torch.compile`` traces into forward and backward graphs. The tiled backend calls this."""

    generate_vmap_rule = True  # vmaps forward and backward, i.e. the two ops' vmap rules below

    @staticmethod
    def forward(query, key, value, lo, hi, bias, alibi_slopes, sinks, scale, softcap, dropout, seed, causal_only,
                sparse_only):
        return torch.ops.attnkit.interval_attention(query, key, value, lo, hi, bias, alibi_slopes, sinks, scale,
                                                    softcap, dropout, seed, causal_only, sparse_only)

    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)


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


@torch.library.register_vmap("attnkit::interval_attention")
def _(info, in_dims, query, key, value, lo, hi, bias, alibi_slopes, sinks, scale, softcap, dropout, seed,
      causal_only, sparse_only):
    size = info.batch_size
    q_dim, k_dim, v_dim, lo_dim, hi_dim, bias_dim, alibi_dim, sinks_dim, _, _, _, seed_dim, _, _ = in_dims
    _unbatched("dropout seed", seed_dim)
    _unbatched("set of sinks", sinks_dim)
    q, k, v = _fold(query, q_dim, size), _fold(key, k_dim, size), _fold(value, v_dim, size)
    batch = q.shape[0] // size
    lo, hi = _fold_rows(lo, lo_dim, size, batch), _fold_rows(hi, hi_dim, size, batch)
    bias = None if bias is None else _fold_rows(bias, bias_dim, size, batch)
    out, lse = torch.ops.attnkit.interval_attention(q, k, v, lo, hi, bias, _fold_slopes(alibi_slopes, alibi_dim, size,
                                                    batch), sinks, scale, softcap, dropout, seed, causal_only,
                                                    sparse_only)
    return (out.reshape(size, batch, *out.shape[1:]), lse.reshape(size, batch, *lse.shape[1:])), (0, 0)


@torch.library.register_vmap("attnkit::interval_attention_backward")
def _(info, in_dims, grad_out, grad_lse, query, key, value, out, lse, lo, hi, bias, alibi_slopes, sinks, scale,
      softcap, dropout, seed, causal_only, sparse_only, bias_grad):
    size = info.batch_size
    (go_dim, gl_dim, q_dim, k_dim, v_dim, o_dim, l_dim, lo_dim, hi_dim, bias_dim, alibi_dim, sinks_dim, _, _, _,
     seed_dim, *_) = in_dims
    _unbatched("dropout seed", seed_dim)
    _unbatched("set of sinks", sinks_dim)
    q = _fold(query, q_dim, size)
    batch = q.shape[0] // size
    folded_bias = None
    if bias is not None:  # per sample when its gradient is asked: every sample's own copy
        b = _batched(bias, bias_dim, size)
        b = b.expand(size, batch, *b.shape[2:]) if bias_grad or bias_dim is not None or b.shape[1] > 1 else b
        folded_bias = b.reshape(-1, *b.shape[2:])
    dq, dk, dv, dbias, dsinks = torch.ops.attnkit.interval_attention_backward(
        _fold(grad_out, go_dim, size), None if grad_lse is None else _fold(grad_lse, gl_dim, size), q,
        _fold(key, k_dim, size), _fold(value, v_dim, size), _fold(out, o_dim, size), _fold(lse, l_dim, size),
        _fold_rows(lo, lo_dim, size, batch), _fold_rows(hi, hi_dim, size, batch), folded_bias,
        _fold_slopes(alibi_slopes, alibi_dim, size, batch), sinks, scale, softcap, dropout, seed, causal_only,
        sparse_only, bias_grad)
    unfold = [t.reshape(size, batch, *t.shape[1:]) for t in (dq, dk, dv)]
    dims = [0, 0, 0, None, None]
    if bias_grad:
        dbias = dbias.reshape(size, batch, *dbias.shape[1:])
        dbias = dbias.sum(1, keepdim=True) if bias.shape[0 if bias_dim is None else 1] == 1 else dbias
        dims[3] = 0
    if sinks is not None:  # each sample's own: the op summed over the folded batch
        per_sample = [_batched(t, d, size) for t, d in ((grad_out, go_dim), (out, o_dim), (lse, l_dim))]
        d_lse = None if grad_lse is None else _batched(grad_lse, gl_dim, size)
        dsinks = torch.stack([_sink_gradient(per_sample[0][v], None if d_lse is None else d_lse[v], per_sample[1][v],
                                             per_sample[2][v], sinks) for v in range(size)])
        dims[4] = 0
    return (*unfold, dbias, dsinks), tuple(dims)
