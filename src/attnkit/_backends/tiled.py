"""The ``"tiled"`` backend: block-sparse attention that skips masked blocks, exactly.

For each block of queries, the mask's rows tell which keys the block may attend
(:mod:`.tiled_plan`): a range attended by every row runs through the fused kernel with no
mask at all, the partly attended edges get a small dense mask, everything else is never
touched. Consecutive blocks whose ranges have the same length, the same mask pattern and
evenly spaced starts (the interior of a sliding window) become **one** kernel call over
strided views, so a 16k-token window costs a handful of calls. Partial results of a row are
merged with their log-sum-exp::

    lse = log(sum_p exp(lse_p))          output = sum_p exp(lse_p - lse) * output_p

Where attnkit's native CPU kernel is built and applies (float32 CPU, no dense tensor mask:
:mod:`.native`), forward and backward skip all of this: one call computes each block over its
rows' key span with the mask (and dropout) applied inside the softmax, same results to rounding.

Training keeps O(L) memory: the forward saves only query, key, value, output and lse; the
backward recomputes each call (FlashAttention's split-key backward, :mod:`.kernels`), or runs the
native kernel's backward over the same row intervals where its forward ran.

Conventions: ``lse[..., i]`` is the natural-log sum of ``exp(scale * q.k + bias)`` over the keys
row ``i`` may attend, before dropout (float32 for half-precision inputs), and ``-inf`` for a row
with no key, whose output is zeros. Dropout (with ``generator``) is drawn per kernel call from
seeds taken from the generator once per call, so the same generator state gives the same result.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import Tensor

from .._call import AttentionCall
from . import kernels, native
from . import tiled_plan
from .tiled_plan import Group, batch_size, block_ranges, plan, row_bounds, structure_of, tuning

__all__ = ["tiled_attention", "profits", "plan", "visited_fraction", "tuning"]

#: Limits of one kernel call, so that its temporaries stay small next to the inputs: the
#: plain-ops kernel (dropout, other devices) materialises its scores; the fused kernel returns a
#: partial output of ``rows x heads x Dv`` (32k rows x heads: 8 MiB at Dv = 64 in fp32).
CALL_SCORES = 1 << 23
CALL_ROWS = 1 << 15

def visited_fraction(call: AttentionCall) -> float:
    """Share of the ``Lq x Lk`` (query, key) pairs, over the batch, that the tiled plan computes."""
    area = sum(g.count * g.rows * g.length * (g.batch.stop - g.batch.start) for g in _plan_of(call))
    return area / max(1, call.q_len * call.k_len * batch_size(call))


# -- layout --------------------------------------------------------------------------------------


def _as_4d(t: Tensor) -> Tensor:
    """``[L, D]`` -> ``[1, 1, L, D]``, ``[N, L, D]`` -> ``[N, 1, L, D]``; 4-D unchanged (a view)."""
    if t.dim() == 2:
        return t[None, None]
    if t.dim() == 3:
        return t[:, None]
    return t


def _mask_as_4d(mask: Tensor, call: AttentionCall) -> Tensor:
    """A mask broadcastable to the call's ``[..., Lq, Lk]`` as a view ``[Bm, Hm, Lq, Lk]``
    (``Bm``, ``Hm`` are 1 where it broadcasts), so that blocks of rows and keys can be sliced."""
    mask = mask.reshape((1,) * (call.query.dim() - mask.dim()) + tuple(mask.shape))
    mask = _as_4d(mask) if call.query.dim() < 4 else mask
    return mask.expand(*mask.shape[:2], call.q_len, call.k_len)


def _group_heads(t: Tensor, group: int) -> Tensor:
    """``[N, H, n, ...]`` -> ``[N, H / group, group * n, ...]``: query heads sharing a key/value
    head become extra rows of that head (row ``g * n + i`` is head ``g``'s query ``i``), so GQA
    never copies keys. A tensor with one head (shared by all heads) repeats its rows instead."""
    if group == 1:
        return t
    n, h, rows = t.shape[:3]
    if h == 1:
        return t.repeat(1, 1, group, *([1] * (t.dim() - 3)))
    return t.reshape(n, h // group, group * rows, *t.shape[3:])


def _ungroup_heads(t: Tensor, group: int) -> Tensor:
    """Inverse of :func:`_group_heads`."""
    if group == 1:
        return t
    n, hkv, rows = t.shape[:3]
    return t.reshape(n, hkv * group, rows // group, *t.shape[3:])


def _blocks_of(t: Tensor, b: int, start: int, step: int, count: int, length: int) -> Tensor:
    """A view ``[count, H, length, ...]`` of sequence ``b`` of ``t [B, H, L, ...]``: entry ``i``
    holds positions ``start + i * step + [0, length)`` (overlapping or repeated when step < length)."""
    size = (count, t.shape[1], length, *t.shape[3:])
    strides = (step * t.stride(2), t.stride(1), t.stride(2), *t.stride()[3:])
    return t.as_strided(size, strides, t.storage_offset() + b * t.stride(0) + start * t.stride(2))


class _Problem:
    """A call in the backend's layout: 4-D tensors, row bounds, the dense tensor mask if any."""

    def __init__(self, call: AttentionCall, query: Tensor, key: Tensor, value: Tensor) -> None:
        self.query, self.key, self.value = query, key, value
        self.scale, self.dropout = call.scale, call.dropout
        self.group = query.shape[1] // key.shape[1]
        self.lo, self.hi = (t.to(query.device) for t in row_bounds(call))
        self.mask = None if call.mask is None else _mask_as_4d(call.mask, call)
        self.flash = kernels.flash_applies(query, value, call.dropout)
        self.native = native.applies(query, key, value, call.mask is not None)
        self.seed = 0  # the native kernel's dropout seed, drawn by tiled_attention

    def queries(self, g: Group, b: int, t: Tensor | None = None) -> Tensor:
        """Rows of ``g`` from ``t`` (default: the query) for sequence ``b``, grouped by kv head."""
        t = self.query if t is None else t
        return _group_heads(_blocks_of(t, b, g.q0, g.rows, g.count, g.rows), self.group)

    def keys(self, g: Group, b: int, t: Tensor) -> Tensor:
        return _blocks_of(t, b, g.key_start, g.key_step, g.count, g.length)

    def bias(self, g: Group, b: int) -> tuple[Tensor | None, Tensor | None]:
        """The additive mask of ``g``'s first block (shared by all its blocks), query dtype,
        grouped like the queries, or None when every pair is allowed; and which grouped rows
        have at least one key (None when all do)."""
        q0, q1, k0, k1 = g.q0, g.q0 + g.rows, g.key_start, g.key_start + g.length
        allowed = None
        if not g.full:
            s = b if self.lo.shape[0] > 1 else 0
            keys = torch.arange(k0, k1, device=self.query.device)
            allowed = ((keys >= self.lo[s, q0:q1, None]) & (keys < self.hi[s, q0:q1, None]))[None, None]
        bias = None
        if self.mask is not None:
            dense = self.mask[b if self.mask.shape[0] > 1 else 0, None, :, q0:q1, k0:k1]
            if dense.dtype == torch.bool:
                allowed = dense if allowed is None else dense & allowed
            else:
                bias = dense if allowed is None else dense.masked_fill(~allowed, float("-inf"))
        if bias is None and allowed is None:
            return None, None
        if bias is None:
            bias = torch.zeros(allowed.shape, dtype=self.query.dtype, device=self.query.device)
            bias = bias.masked_fill_(~allowed, float("-inf"))
        has_key = (bias != float("-inf")).any(-1, keepdim=True)
        return _group_heads(bias, self.group), _group_heads(has_key, self.group)[..., 0]


def _merge_into(out: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor) -> None:
    """Merge a partial result over more keys into ``out, lse`` in place (see the module docstring);
    rows with no key on either side stay zeros with lse ``-inf``."""
    merged = torch.logaddexp(lse, part_lse)
    finite = torch.where(torch.isfinite(merged), merged, torch.zeros_like(merged))
    out.mul_(torch.exp(lse - finite)[..., None]).add_(part * torch.exp(part_lse - finite)[..., None])
    lse.copy_(merged)


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# -- the autograd function (no weights: O(L) memory) ---------------------------------------------


def _calls(problem: _Problem, groups: list[Group], plain: bool,
           backward: bool = False) -> Iterator[tuple[Group, int]]:
    """Each kernel call as (group, sequence). Groups are cut so that one call holds at most
    ``CALL_SCORES`` scores with the ``plain``-ops kernel (which materialises them) or
    ``CALL_ROWS`` rows (times heads) of its partial results with the fused one: query rows in
    the forward; query rows and key rows in the backward, whose key gradients are as long as
    the (overlapping) key views. A batch of blocks is cut into fewer blocks, one block into fewer
    rows. With the plain-ops kernel the cut, and so the dropout seeds, are the same both ways."""
    heads = problem.query.shape[1]
    for g in groups:
        if plain:
            per_row = heads * g.length
        elif backward and g.count > 1:
            per_row = heads * (1 + -(-g.length // g.rows))  # its query row and its share of keys
        else:
            per_row = heads
        most_rows = max(1, (CALL_SCORES if plain else CALL_ROWS) // max(per_row, 1))
        if g.count == 1:
            parts = [replace(g, q0=g.q0 + first, rows=min(most_rows, g.rows - first), seed=g.seed + i)
                     for i, first in enumerate(range(0, g.rows, most_rows))]
        else:
            most = max(1, most_rows // g.rows)
            parts = [replace(g, q0=g.q0 + first * g.rows, count=min(most, g.count - first),
                             key_start=g.key_start + first * g.key_step, seed=g.seed + i)
                     for i, first in enumerate(range(0, g.count, most))]
        for part in parts:
            yield from ((part, b) for b in range(g.batch.start, g.batch.stop))


def _run_forward(problem: _Problem, groups: list[Group]) -> tuple[Tensor, Tensor]:
    query, key, value, group = problem.query, problem.key, problem.value, problem.group
    if problem.native:  # attnkit's own kernel takes the rows' key intervals directly: no plan needed
        return native.interval_forward(query, key, value, problem.lo, problem.hi, problem.scale,
                                       dropout=problem.dropout, seed=problem.seed)
    work = _accumulator_dtype(query.dtype)
    out = torch.empty(*query.shape[:-1], value.shape[-1], dtype=work, device=query.device)
    lse = torch.empty(query.shape[:-1], dtype=work, device=query.device)
    covered = torch.zeros(query.shape[0], query.shape[2], dtype=torch.bool)  # rows holding a result
    for g, b in _calls(problem, groups, plain=not problem.flash):
        bias, has_key = problem.bias(g, b)
        rows, k, v = problem.queries(g, b), problem.keys(g, b, key), problem.keys(g, b, value)
        if problem.flash:
            part, part_lse = kernels.flash_forward(rows, k, v, bias, problem.scale)
            if has_key is not None:
                part_lse = part_lse.masked_fill(~has_key, float("-inf"))
        else:
            part, part_lse, _ = kernels.math_forward(rows, k, v, bias, problem.scale, problem.dropout,
                                                     _seed(g, b))
        out_view = _blocks_of(out, b, g.q0, g.rows, g.count, g.rows)
        lse_view = _blocks_of(lse, b, g.q0, g.rows, g.count, g.rows)
        part, part_lse = _ungroup_heads(part, group), _ungroup_heads(part_lse, group)
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


def _seed(g: Group, b: int) -> int:
    """The dropout seed of one kernel call: the group's, offset by the sequence."""
    return g.seed * 1_000_003 + b


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, problem, groups):  # type: ignore[override]
        """``groups`` is the plan, or None when the native kernel runs both ways (it needs none)."""
        out, lse = _run_forward(problem, groups)
        ctx.problem, ctx.groups = problem, groups
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.set_materialize_grads(False)  # an unused lse gets no gradient: the fused backward applies
        return out, lse  # both differentiable: later issues merge partial results through lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):  # type: ignore[override]
        query, key, value, out, lse = ctx.saved_tensors
        problem, groups = ctx.problem, ctx.groups
        problem.query, problem.key, problem.value = query, key, value  # the saved, checked versions
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if problem.native:
            dq, dk, dv = native.interval_backward(grad_out, query, key, value, out, lse, problem.lo, problem.hi,
                                                  problem.scale, grad_lse, dropout=problem.dropout, seed=problem.seed)
            return dq, dk, dv, None, None
        use_flash = problem.flash and grad_lse is None
        work = _accumulator_dtype(query.dtype)
        grads = [torch.zeros(t.shape, dtype=work, device=t.device) for t in (query, key, value)]
        for g, b in _calls(problem, groups, plain=not use_flash, backward=True):
            bias, _ = problem.bias(g, b)
            rows, k, v = problem.queries(g, b), problem.keys(g, b, key), problem.keys(g, b, value)
            d_out = problem.queries(g, b, grad_out)
            o = problem.queries(g, b, out)
            row_lse = problem.queries(g, b, lse[..., None])[..., 0]
            if use_flash:
                dq, dk, dv = kernels.flash_backward(d_out.contiguous(), rows, k, v, o, row_lse, bias, problem.scale)
            else:
                d_lse = None if grad_lse is None else problem.queries(g, b, grad_lse[..., None])[..., 0]
                dq, dk, dv = kernels.math_backward(d_out, rows, k, v, o, row_lse, bias, problem.scale,
                                                   problem.dropout, _seed(g, b), d_lse)
            _blocks_of(grads[0], b, g.q0, g.rows, g.count, g.rows).add_(_ungroup_heads(dq, problem.group))
            _add_to_keys(grads[1], b, g, dk)
            _add_to_keys(grads[2], b, g, dv)
        dq, dk, dv = (grad.to(t.dtype) for grad, t in zip(grads, (query, key, value)))
        return dq, dk, dv, None, None


def _add_to_keys(target: Tensor, b: int, g: Group, grad: Tensor) -> None:
    """Add the gradient of a group's key views ``[count, Hkv, length, D]`` to ``target[b]``;
    the views may overlap (a sliding window), so overlapping positions accumulate."""
    if g.count == 1 or g.key_step == 0:
        target[b, :, g.key_start:g.key_start + g.length] += grad.sum(0)
        return
    starts = g.key_start + g.key_step * torch.arange(g.count, device=grad.device)
    index = (starts[:, None] + torch.arange(g.length, device=grad.device)).flatten()
    target[b].index_add_(1, index, grad.transpose(0, 1).reshape(grad.shape[1], -1, grad.shape[-1]))


def _base_seed(call: AttentionCall) -> int:
    """One draw from the call's generator (or the global RNG): every dropout pattern of the
    call derives from it, so the same generator state gives the same result."""
    device = call.generator.device if call.generator is not None else torch.device("cpu")
    return int(torch.randint(0, 2**40, (), generator=call.generator, device=device))


def _with_seeds(groups: list[Group], call: AttentionCall) -> list[Group]:
    """Give every group its own dropout seeds (``_seed`` then separates parts and sequences)."""
    if call.dropout == 0:
        return groups
    base = _base_seed(call)
    # Group i owns seeds base + i * 2**20 + [0, 2**20): one per part after _calls cuts it.
    return [replace(g, seed=base + i * 2**20) for i, g in enumerate(groups)]


# -- weights, block by block ---------------------------------------------------------------------


def _with_weights(call: AttentionCall, problem: _Problem) -> tuple[Tensor, Tensor, Tensor]:
    """Output, weights ``[B, H, Lq, Lk]`` and lse: each query block over the span of its key
    ranges, in differentiable plain ops (the weights are ``Lq x Lk`` anyway, so plain autograd
    is the right memory trade here)."""
    query, group = problem.query, problem.group
    value_dim, k_len = problem.value.shape[-1], call.k_len
    work = _accumulator_dtype(query.dtype)
    seed = _base_seed(call) if call.dropout > 0 else 0
    outs, weights, lses = [], [], []
    for b in range(query.shape[0]):
        s = b if problem.lo.shape[0] > 1 else 0
        out_rows, weight_rows, lse_rows = [], [], []
        size = tiled_plan.BLOCK_SIZE
        for index, ranges in enumerate(block_ranges(problem.lo[s].cpu(), problem.hi[s].cpu(), size)):
            q0 = index * size
            rows = min(size, call.q_len - q0)
            if not ranges:
                out_rows.append(query.new_zeros(1, query.shape[1], rows, value_dim))
                weight_rows.append(query.new_zeros(1, query.shape[1], rows, k_len))
                lse_rows.append(torch.full((1, query.shape[1], rows), float("-inf"), dtype=work, device=query.device))
                continue
            span = Group(slice(b, b + 1), q0, rows, 1, ranges[0].start, 0, ranges[-1].stop - ranges[0].start, False)
            bias, _ = problem.bias(span, b)
            output, lse, weight = kernels.math_forward(
                problem.queries(span, b), problem.keys(span, b, problem.key), problem.keys(span, b, problem.value),
                bias, problem.scale, problem.dropout, seed + b * call.q_len + q0)
            out_rows.append(_ungroup_heads(output, group))
            lse_rows.append(_ungroup_heads(lse, group).to(work))
            weight = _ungroup_heads(weight, group)
            weight_rows.append(torch.nn.functional.pad(weight, (span.key_start, k_len - span.key_start - span.length)))
        outs.append(torch.cat(out_rows, dim=2))
        weights.append(torch.cat(weight_rows, dim=2))
        lses.append(torch.cat(lse_rows, dim=2))
    return torch.cat(outs), torch.cat(weights), torch.cat(lses)


# -- the backend ---------------------------------------------------------------------------------


def tiled_attention(call: AttentionCall) -> tuple[Tensor, Tensor | None, Tensor]:
    """Run ``call`` block by block; returns ``(output, weights or None, lse)`` in the call's layout."""
    query, key, value = (_as_4d(t) for t in (call.query, call.key, call.value))
    problem = _Problem(call, query, key, value)
    if call.return_weights:
        out, weights, lse = _with_weights(call, problem)
        weights = weights.reshape(call.scores_shape)
    else:
        groups = None  # the native kernel needs no plan; dropout needs one seed per call
        if problem.native and call.dropout > 0:
            problem.seed = _base_seed(call)
        elif not problem.native:
            groups = _with_seeds(_plan_of(call), call)
        out, lse = _TiledAttention.apply(query, key, value, problem, groups)
        weights = None
    shape = call.query.shape[:-1]
    return out.reshape(*shape, call.value.shape[-1]), weights, lse.reshape(shape)


#: When ``"auto"`` runs a structured mask tiled (benchmarks/masks.py --threshold, B=1, H=8,
#: D=64, fp32, 2 CPU threads). With PyTorch's kernel block by block: below 512 x 512 pairs the
#: fused dense kernel always won; at 512 x 512 tiled won where it computed <= 30% of the pairs
#: (window, documents: 0.56-0.75x the time) and lost at 50% (1.2x); from 1024 x 1024 it won at
#: 50% too (0.47-0.82x).
AUTO_MIN_PAIRS = 512 * 512
AUTO_MAX_VISITED = ((1024 * 1024, 0.3), (float("inf"), 0.6))  # (pairs below, visited share at most)
#: With attnkit's native kernel (``--threshold --dense-side``, 64 to 16384): from 128 x 128 pairs
#: tiled took 0.10-0.93x the fused dense kernel's time on every mask where the kernel multiplies
#: <= 91% of the pairs (windows, documents, causal + padding, prefix-LM, a symmetric half-length
#: window, padding alone, a causal chunk of the last rows) and tied at 94% (1.00x); at 64 x 64
#: the differences were microseconds either way (0.80-1.36x over two runs). The share is the
#: kernel's own (each block over its rows' key span, :func:`native.computed_fraction`), which
#: needs no plan.
#: A plain causal mask it ran in 0.61-0.97x SDPA's own causal path up to 4096 x 4096, 0.96-1.00x
#: at 8192 and 16384: SDPA keeps that one from 8192 x 8192.
NATIVE_MIN_PAIRS = 128 * 128
NATIVE_MAX_COMPUTED = 0.9
NATIVE_CAUSAL_MAX_PAIRS = 8192 * 8192


def profits(call: AttentionCall) -> bool:
    """Whether ``"auto"`` should run ``call`` tiled rather than through the fused kernel (with a
    structured mask densified)."""
    if call.structure is None and call.dropout == 0:
        return False  # nothing to skip, and SDPA has a fused kernel
    native_runs = native.applies(call.query, call.key, call.value, call.mask is not None)
    if native_runs and call.dropout > 0 and not call.return_weights:
        # SDPA has no fused CPU kernel with dropout (its math path materialises every weight): the
        # native kernel took 0.64-0.77x its time at 32 x 32 pairs, 0.35-0.44x at 64 x 64 and
        # 0.02-0.13x at 4096 x 4096, on the sweep's masks and with no mask at all
        # (``--threshold --dropout 0.1``). Weights are L x L anyway: those calls stay fused.
        return True
    if call.structure is None:
        return False
    pairs = call.q_len * call.k_len
    plain_causal = structure_of(call).is_causal and call.mask is None and call.q_len == call.k_len
    if native_runs:
        if pairs < NATIVE_MIN_PAIRS:
            return False
        if plain_causal:
            return pairs < NATIVE_CAUSAL_MAX_PAIRS
        lo, hi = row_bounds(call)
        return native.computed_fraction(lo, hi, call.k_len) <= NATIVE_MAX_COMPUTED
    if pairs < AUTO_MIN_PAIRS:
        return False
    if plain_causal:
        return False  # SDPA's own causal path skips the same blocks and was 15-55% faster
    limit = next(share for below, share in AUTO_MAX_VISITED if pairs < below)
    return visited_fraction(call) <= limit


def _plan_of(call: AttentionCall) -> list[Group]:
    """The call's plan: computed once even when "auto" asked :func:`profits` first, and reused
    across calls with the same mask and shapes (:func:`tiled_plan.cached_plan`)."""
    return tiled_plan.cached_plan(call)
