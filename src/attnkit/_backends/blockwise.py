"""Interval attention block by block on PyTorch's kernels: where attnkit's native kernel does not run.

For each block of queries, the rows' key intervals tell which keys the block may attend
(:mod:`.tiled_plan`): a range attended by every row runs through the fused kernel with no mask at
all, the partly attended edges get a small dense mask, everything else is never touched.
Consecutive blocks whose ranges have the same length, mask pattern and evenly spaced starts (the
interior of a sliding window) become **one** kernel call over strided views. Partial results of a
row are merged with their log-sum-exp::

    lse = log(sum_p exp(lse_p))          output = sum_p exp(lse_p - lse) * output_p

Each piece runs :mod:`.kernels`: PyTorch's fused CPU kernel, or plain ops (dropout, another
device, a gradient for the lse or the bias). The backward recomputes each piece from the merged
output and lse (FlashAttention's split-key backward), so memory stays O(L).

Layout (see :mod:`.interval_op`): ``query [N, H, Lq, D]``, ``key/value [N, Hkv, Lk, D/Dv]``,
``lo, hi [S, R, Lq]`` (S = 1 or N; R = 1 or 2 disjoint ranges a row, each planned apart and
merged like any other pieces), an optional additive ``bias`` broadcastable to ``[N, H, Lq, Lk]``
as ``[Nm, Hm, Lq, Lk]``, dropout from ``seed`` (:mod:`.dropout`: the same pattern as every path).
A forward whose output comes out non-finite because an input holds NaN or inf, or a score
overflows, is redone by :func:`dense_attention` (pairwise products: a
masked pair never enters one, :mod:`.numerics`); the op's autograd does the same for the backward
(:mod:`.interval_op`), where autograd can run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import Tensor

from .._call import bias_dtype, records_graph
from . import dropout as _dropout
from . import kernels, numerics
from .tiled_plan import BlockRun, Problem, dense_plan, plans, settings

__all__ = ["forward", "backward", "dense_attention", "pairwise_if_not_finite", "allowed_pairs"]


def _stack_query_heads(t: Tensor, heads_per_kv: int) -> Tensor:
    """``[N, H, n, ...]`` -> ``[N, Hkv, heads_per_kv * n, ...]``: query heads sharing a key/value
    head become extra rows of that head (row ``g * n + i`` is head ``g``'s query ``i``), so GQA
    never copies keys. A tensor with one head (shared by all heads) repeats its rows instead."""
    if heads_per_kv == 1:
        return t
    n, h, rows = t.shape[:3]
    if h == 1:
        return t.repeat(1, 1, heads_per_kv, *([1] * (t.dim() - 3)))
    return t.reshape(n, h // heads_per_kv, heads_per_kv * rows, *t.shape[3:])


def _unstack_query_heads(t: Tensor, heads_per_kv: int) -> Tensor:
    """Inverse of :func:`_stack_query_heads`."""
    if heads_per_kv == 1:
        return t
    n, hkv, rows = t.shape[:3]
    return t.reshape(n, hkv * heads_per_kv, rows // heads_per_kv, *t.shape[3:])


def _blocks_of(t: Tensor, b: int, start: int, step: int, count: int, length: int) -> Tensor:
    """A view ``[count, H, length, ...]`` of sequence ``b`` of ``t [B, H, L, ...]``: entry ``i``
    holds positions ``start + i * step + [0, length)`` (overlapping or repeated when step < length)."""
    size = (count, t.shape[1], length, *t.shape[3:])
    strides = (step * t.stride(2), t.stride(1), t.stride(2), *t.stride()[3:])
    return t.as_strided(size, strides, t.storage_offset() + b * t.stride(0) + start * t.stride(2))


class _Call:
    """One call's tensors and what every piece needs from them."""

    def __init__(self, query: Tensor, key: Tensor, value: Tensor, lo: Tensor, hi: Tensor, bias: Tensor | None,
                 scale: float, dropout: float, seed: Tensor | None, softcap: float | None = None,
                 alibi: Tensor | None = None) -> None:
        self.query, self.key, self.value = query, key, value
        self.lo, self.hi, self.mask = lo, hi, bias
        self.scale, self.dropout, self.seed, self.softcap, self.alibi = scale, dropout, seed, softcap, alibi
        self.heads_per_kv = query.shape[1] // key.shape[1]
        self.flash = softcap is None and kernels.flash_applies(query, value, dropout)
        # ALiBi differs from block to block like a dense mask: no batched blocks, no coarse levels
        self.problem = Problem(lo.cpu(), hi.cpu(), query.shape[2], key.shape[2], query.shape[0],
                               bias is not None or alibi is not None)

    def queries(self, g: BlockRun, b: int, t: Tensor | None = None) -> Tensor:
        """Rows of ``g`` from ``t`` (default: the query) for sequence ``b``, grouped by kv head."""
        t = self.query if t is None else t
        return _stack_query_heads(_blocks_of(t, b, g.q0, g.rows, g.count, g.rows), self.heads_per_kv)

    def keys(self, g: BlockRun, b: int, t: Tensor) -> Tensor:
        return _blocks_of(t, b, g.key_start, g.key_step, g.count, g.length)

    def bias(self, g: BlockRun, b: int) -> tuple[Tensor | None, Tensor | None]:
        """The additive mask of ``g``'s first block (shared by all its blocks), grouped like the
        queries, or None when every pair is allowed; and which grouped rows have at least one key
        (None when all do)."""
        q0, q1, k0, k1 = g.q0, g.q0 + g.rows, g.key_start, g.key_start + g.length
        allowed = None
        if not g.full:
            s = b if self.lo.shape[0] > 1 else 0
            slots = slice(None) if g.slot is None else slice(g.slot, g.slot + 1)  # None: every range
            keys = torch.arange(k0, k1, device=self.query.device)
            lo, hi = self.lo[s, slots, q0:q1, None], self.hi[s, slots, q0:q1, None]
            allowed = ((keys >= lo) & (keys < hi)).any(0)[None, None]
        bias = None
        if self.mask is not None:
            dense = self.mask[b if self.mask.shape[0] > 1 else 0, None, :, q0:q1, k0:k1]
            bias = dense if allowed is None else dense.masked_fill(~allowed, float("-inf"))
        if self.alibi is not None:
            slopes = self.alibi if self.alibi.dim() == 1 else self.alibi[b]
            rows = torch.arange(q0, q1, device=self.query.device)[:, None] + (self.key.shape[2] - self.query.shape[2])
            alibi = numerics.alibi_bias(slopes.view(1, -1, 1, 1), rows, torch.arange(k0, k1, device=self.query.device))
            bias = alibi if bias is None else bias + alibi
            if allowed is not None:
                bias = bias.masked_fill(~allowed, float("-inf"))
        if bias is None and allowed is None:
            return None, None
        if bias is None:  # float32 for half precision, where the fused kernel takes it so
            bias = torch.zeros(allowed.shape, dtype=bias_dtype(self.query.dtype), device=self.query.device)
            bias = bias.masked_fill_(~allowed, float("-inf"))
        has_key = (bias != float("-inf")).any(-1, keepdim=True)
        return _stack_query_heads(bias, self.heads_per_kv), _stack_query_heads(has_key, self.heads_per_kv)[..., 0]

    def keep(self, g: BlockRun, b: int) -> Tensor | None:
        """The dropout pattern of one piece, ``[count, Hkv, heads_per_kv * rows, length]``, drawn at the
        piece's positions in the call (the same pattern as the native kernel's), or None."""
        if self.dropout == 0:
            return None
        index = dict(dtype=torch.int64, device=self.query.device)
        rows = torch.arange(self.heads_per_kv * g.rows, **index)
        block = torch.arange(g.count, **index)[:, None, None, None]
        heads = torch.arange(self.key.shape[1], **index)[None, :, None, None] * self.heads_per_kv + (rows // g.rows)[:, None]
        positions = g.q0 + block * g.rows + (rows % g.rows)[:, None]
        keys = g.key_start + block * g.key_step + torch.arange(g.length, **index)
        return _dropout.kept(self.seed, torch.tensor(b, **index), heads, positions, keys, self.dropout)


def _merge_into(out: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor) -> None:
    """Merge a partial result over more keys into ``out, lse`` in place (see the module docstring);
    rows with no key on either side stay zeros with lse ``-inf``."""
    merged = torch.logaddexp(lse, part_lse)
    finite = torch.where(torch.isfinite(merged), merged, torch.zeros_like(merged))
    out.mul_(torch.exp(lse - finite)[..., None]).add_(part * torch.exp(part_lse - finite)[..., None])
    lse.copy_(merged)


def _pieces(call: _Call, runs: list[BlockRun], plain: bool, backward: bool = False) -> Iterator[tuple[BlockRun, int]]:
    """Each kernel call as (block run, sequence). Runs are cut so that one call holds at most
    ``call_scores`` scores with the ``plain``-ops kernel (which materialises them) or ``call_rows``
    rows (times heads) of its partial results with the fused one: query rows in the forward; query
    rows and key rows in the backward, whose key gradients are as long as the (overlapping) key
    views. A batch of blocks is cut into fewer blocks, one block into fewer rows."""
    heads = call.query.shape[1]
    config = settings()
    for g in runs:
        if plain:
            per_row = heads * g.length
        elif backward and g.count > 1:
            per_row = heads * (1 + -(-g.length // g.rows))  # its query row and its share of keys
        else:
            per_row = heads
        most_rows = max(1, (config.call_scores if plain else config.call_rows) // max(per_row, 1))
        if g.causal:  # the kernel's own causal mask is relative to the call's first row: never cut
            parts = [g]
        elif g.count == 1:
            parts = [replace(g, q0=g.q0 + first, rows=min(most_rows, g.rows - first))
                     for first in range(0, g.rows, most_rows)]
        else:
            most = max(1, most_rows // g.rows)
            parts = [replace(g, q0=g.q0 + first * g.rows, count=min(most, g.count - first),
                             key_start=g.key_start + first * g.key_step)
                     for first in range(0, g.count, most)]
        for part in parts:
            yield from ((part, b) for b in range(g.batch.start, g.batch.stop))


def _plan(call: _Call, dense: bool, causal_only: bool) -> list[BlockRun]:
    if dense:
        return dense_plan(call.problem, causal_only and call.flash, call.heads_per_kv)
    return plans.plan(call.problem)


def forward(query: Tensor, key: Tensor, value: Tensor, lo: Tensor, hi: Tensor, bias: Tensor | None, scale: float,
            dropout: float, seed: Tensor | None, *, softcap: float | None = None, alibi: Tensor | None = None,
            dense: bool = False, causal_only: bool = False) -> tuple[Tensor, Tensor]:
    """``(output [N, H, Lq, Dv], lse [N, H, Lq])``; lse float32 for half-precision inputs. ``dense``:
    one call per sequence over every key with the mask as a tensor (what PyTorch's fused kernel
    runs on a dense mask; its causal path when ``causal_only``), instead of the block plan."""
    # Where an input holds NaN or inf (or a score could overflow) and the products fit, the
    # definition's pairwise products instead: PyTorch's kernel cannot be checked from its output
    # there (a block row whose scores are all -inf or NaN comes out as zeros with lse 0, which the
    # merge counts as a row of mass 1: finite and wrong; a +inf score with a bias as lse +inf)
    if numerics.needs_pairwise(query, key, value, scale):
        with torch.no_grad():
            return dense_attention(query, key, value, lo, hi, bias, scale, dropout, seed, exact=True,
                                   softcap=softcap, alibi=alibi)[:2]
    call = _Call(query, key, value, lo, hi, bias, scale, dropout, seed, softcap, alibi)
    heads_per_kv = call.heads_per_kv
    work = numerics.work_dtype(query.dtype)
    out = torch.empty(*query.shape[:-1], value.shape[-1], dtype=work, device=query.device)
    lse = torch.empty(query.shape[:-1], dtype=work, device=query.device)
    covered = torch.zeros(query.shape[0], query.shape[2], dtype=torch.bool)  # rows holding a result
    for g, b in _pieces(call, _plan(call, dense, causal_only), plain=not call.flash):
        bias_piece, has_key = call.bias(g, b)
        rows, k, v = call.queries(g, b), call.keys(g, b, key), call.keys(g, b, value)
        if call.flash:
            part, part_lse = kernels.flash_forward(rows, k, v, bias_piece, scale, g.causal)
            if has_key is not None:
                part_lse = part_lse.masked_fill(~has_key, float("-inf"))
        else:
            part, part_lse, _ = kernels.math_forward(rows, k, v, bias_piece, scale, dropout, call.keep(g, b), softcap)
        out_view = _blocks_of(out, b, g.q0, g.rows, g.count, g.rows)
        lse_view = _blocks_of(lse, b, g.q0, g.rows, g.count, g.rows)
        part, part_lse = _unstack_query_heads(part, heads_per_kv), _unstack_query_heads(part_lse, heads_per_kv)
        seen = covered[b, g.q0:g.q1]
        if not seen.any():  # the first keys of these rows: nothing to merge with
            out_view.copy_(part)
            lse_view.copy_(part_lse)
        else:
            if not seen.all():  # some rows start here: give them "no key yet" before merging
                fresh = ~seen.to(out.device)
                out[b, :, g.q0:g.q1][:, fresh] = 0.0
                lse[b, :, g.q0:g.q1][:, fresh] = float("-inf")
            _merge_into(out_view, lse_view, part.to(work), part_lse.to(work))
        covered[b, g.q0:g.q1] = True
    if not covered.all():  # rows with no key at all: zeros, lse -inf
        out.masked_fill_(~covered[:, None, :, None].to(out.device), 0.0)
        lse.masked_fill_(~covered[:, None, :].to(lse.device), float("-inf"))
    return out.to(query.dtype), lse


def backward(grad_out: Tensor, grad_lse: Tensor | None, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
             lse: Tensor, lo: Tensor, hi: Tensor, bias: Tensor | None, scale: float, dropout: float,
             seed: Tensor | None, bias_grad: bool, *, softcap: float | None = None, alibi: Tensor | None = None,
             dense: bool = False, causal_only: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(dq, dk, dv, dbias)`` of :func:`forward` from the gradients of its output and lse (``dbias``,
    shaped like ``bias``, only when ``bias_grad``); ``dense`` and ``causal_only`` as the forward's."""
    call = _Call(query, key, value, lo, hi, bias, scale, dropout, seed, softcap, alibi)
    use_flash = call.flash and grad_lse is None and not bias_grad
    work = numerics.work_dtype(query.dtype)
    grads = [torch.zeros(t.shape, dtype=work, device=t.device) for t in (query, key, value)]
    grad_bias = torch.zeros(bias.shape, dtype=work, device=bias.device) if bias_grad else None
    plan = _plan(call, dense, causal_only and use_flash)
    for g, b in _pieces(call, plan, plain=not use_flash, backward=True):
        bias_piece, _ = call.bias(g, b)
        rows, k, v = call.queries(g, b), call.keys(g, b, key), call.keys(g, b, value)
        d_out = call.queries(g, b, grad_out)
        o = call.queries(g, b, out)
        row_lse = call.queries(g, b, lse[..., None])[..., 0]
        if use_flash:
            dq, dk, dv = kernels.flash_backward(d_out.contiguous(), rows, k, v, o, row_lse, bias_piece, scale, g.causal)
        else:
            d_lse = None if grad_lse is None else call.queries(g, b, grad_lse[..., None])[..., 0]
            dq, dk, dv, d_scores = kernels.math_backward(d_out, rows, k, v, o, row_lse, bias_piece, scale,
                                                         call.keep(g, b), dropout, d_lse, softcap)
            if grad_bias is not None:
                _add_to_bias(grad_bias, b, g, _unstack_query_heads(d_scores, call.heads_per_kv))
        _blocks_of(grads[0], b, g.q0, g.rows, g.count, g.rows).add_(_unstack_query_heads(dq, call.heads_per_kv))
        _add_to_keys(grads[1], b, g, dk)
        _add_to_keys(grads[2], b, g, dv)
    dq, dk, dv = (grad.to(t.dtype) for grad, t in zip(grads, (query, key, value)))
    return dq, dk, dv, None if grad_bias is None else grad_bias.to(bias.dtype)


def _add_to_keys(target: Tensor, b: int, g: BlockRun, grad: Tensor) -> None:
    """Add the gradient of a block run's key views ``[count, Hkv, length, D]`` to ``target[b]``;
    the views may overlap (a sliding window), so overlapping positions accumulate."""
    if g.count == 1 or g.key_step == 0:
        target[b, :, g.key_start:g.key_start + g.length] += grad.sum(0)
        return
    starts = g.key_start + g.key_step * torch.arange(g.count, device=grad.device)
    index = (starts[:, None] + torch.arange(g.length, device=grad.device)).flatten()
    source = grad.transpose(0, 1).reshape(grad.shape[1], -1, grad.shape[-1])
    target[b].index_add_(1, index, source.to(target.dtype))  # half-precision pieces into a float32 sum


def _add_to_bias(target: Tensor, b: int, g: BlockRun, grad: Tensor) -> None:
    """Add one piece's score gradient ``[1, H, rows, length]`` (a dense mask never batches blocks)
    into the bias gradient ``[Nm, Hm, Lq, Lk]``, summing what the bias broadcast over."""
    if target.shape[1] == 1:
        grad = grad.sum(1, keepdim=True)
    row = b if target.shape[0] > 1 else 0
    target[row, :, g.q0:g.q0 + g.rows, g.key_start:g.key_start + g.length] += grad[0].to(target.dtype)


# -- the dense path: non-finite inputs, second-order gradients --------------------------------------


def allowed_pairs(lo: Tensor, hi: Tensor, k_len: int) -> Tensor:
    """The boolean mask ``[S, 1, Lq, Lk]`` of the rows' key ranges ``[S, R, Lq]`` (True = may attend)."""
    keys = torch.arange(k_len, device=lo.device)
    return ((keys >= lo[..., None]) & (keys < hi[..., None])).any(1)[:, None]


def pairwise_if_not_finite(out: Tensor, lse: Tensor, query: Tensor, key: Tensor, value: Tensor, lo: Tensor,
                           hi: Tensor, bias: Tensor | None, scale: float, dropout: float, seed: Tensor | None, *,
                           softcap: float | None = None, alibi: Tensor | None = None,
                           sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of a kernel that multiplies whole blocks (FlexAttention's), or the call redone
    by :func:`dense_attention`'s pairwise products where an input holds NaN or inf (or a score could
    overflow), the products fit, and the result may show it: ``out`` came out non-finite (a
    ``0 x inf`` inside a partly masked block lets a masked-out value into its row), a row with keys
    has an lse that is not finite (all its scores -inf or NaN, read as no key), or a gradient will
    flow. The backward is the reason for the last: it multiplies whole blocks too, so an infinite
    key that the mask removes reaches ``dQ`` as ``0 x inf`` while the output stays finite, and with
    ``sinks`` the lse of a row of all -inf scores is the sink's, finite. Differentiable where the
    caller's autograd is on. Reads values: not while tracing (:func:`numerics.can_read`). PyTorch's
    kernels block by block check their inputs instead (:func:`forward`)."""
    if not numerics.can_read(out, lse):
        return out, lse
    if not records_graph(query, key, value, sinks, alibi) and not numerics.output_or_keyed_lse_not_finite(out, lse, lo, hi):
        return out, lse
    if not numerics.needs_pairwise(query, key, value, scale):
        return out, lse
    return dense_attention(query, key, value, lo, hi, bias, scale, dropout, seed, exact=True, softcap=softcap,
                           alibi=alibi, sinks=sinks)[:2]


def dense_attention(query: Tensor, key: Tensor, value: Tensor, lo: Tensor, hi: Tensor, bias: Tensor | None,
                    scale: float, dropout: float, seed: Tensor | None, exact: bool, *, softcap: float | None = None,
                    alibi: Tensor | None = None, sinks: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(output, lse, weights)`` of the same call in plain differentiable ops over the whole
    ``Lq x Lk`` score matrix: for inputs holding NaN or inf (``exact``: pairwise products, a masked
    pair never multiplied), for second-order gradients (autograd through this) and for weights
    while ``torch.compile`` traces."""
    heads_per_kv = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(heads_per_kv, dim=1), value.repeat_interleave(heads_per_kv, dim=1)
    allowed = allowed_pairs(lo, hi, key.shape[2])
    if bias is not None:
        allowed = allowed & (bias != float("-inf"))
    work = numerics.work_dtype(query.dtype)
    q, k, v = query.to(work), key.to(work), value.to(work)
    scores = numerics.pairwise_scores(q, k, allowed) if exact else q @ k.transpose(-1, -2)
    scores = numerics.soft_cap(scores * scale, softcap)
    if alibi is not None:
        slopes = alibi.view(1, -1, 1, 1) if alibi.dim() == 1 else alibi[:, :, None, None]
        rows = torch.arange(q.shape[2], device=q.device)[:, None] + (k.shape[2] - q.shape[2])
        scores = scores + numerics.alibi_bias(slopes, rows, torch.arange(k.shape[2], device=q.device))
    if bias is not None:
        scores = scores + bias.to(work).masked_fill(~allowed, 0.0)
    sink = None if sinks is None else sinks.view(1, -1, 1, 1)
    weights, lse = numerics.softmax_with_lse(scores.masked_fill(~allowed, float("-inf")), sink)
    if dropout > 0:
        weights = _dropout.apply(weights, seed, dropout)
    out = numerics.pairwise_values(weights, v, allowed) if exact else weights @ v
    return out.to(query.dtype), lse, weights.to(query.dtype)
