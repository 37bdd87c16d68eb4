"""The numerical rules every plain-ops path shares: the half-precision upcast, the safe softmax,
and products in which a masked-out (query, key) pair contributes nothing.

**Non-finite inputs.** Attention is defined over the pairs a row may attend: a pair the mask
removes contributes nothing, forward or backward, whatever its query, key or value hold (padding
may contain anything, even NaN); NaN and inf in attended pairs propagate as IEEE arithmetic does
(an attended NaN or +inf score makes the row NaN; -inf scores weigh 0, and a weight of 0 times an
infinite value is NaN, even in a row whose scores are all -inf). Matrix products compute
``0 * NaN = NaN`` for masked pairs, so when an input holds a non-finite value the plain-ops paths
switch to pairwise products (:func:`pairwise_scores`, :func:`pairwise_values`) that never multiply
a masked pair: O(Lq x Lk x D) memory, taken only then (:func:`needs_pairwise`: also when scores
could overflow, which makes rows NaN whose masked-out weights would then spread it) and only up to
:data:`PAIRWISE_LIMIT`. The fused paths check their output instead (one pass, cheaper than the
inputs): a finite output means no non-finite value reached any product, unless a row that has keys
came out as zeros, as PyTorch's CPU kernel gives a row whose scores are all NaN (SDPA's output:
:func:`zero_sum_or_non_finite_row`; FlexAttention's lse: :func:`keyed_rows_not_finite`). Under
``torch.compile`` the checks would break the graph and are skipped: masked-out NaN may then
spread into rows, and such rows read as zeros.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import _torch_private

__all__ = ["work_dtype", "softmax_rows", "softmax_with_lse", "fold_sinks", "soft_cap", "alibi_bias", "can_read", "all_finite", "zero_sum_or_non_finite_row", "rows_with_keys", "keyed_rows_not_finite", "output_or_keyed_lse_not_finite", "needs_pairwise", "pairwise_fits", "pairwise_scores", "pairwise_values"]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype softmax and accumulations run in: float32 for half precision, else ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def softmax_with_lse(scores: Tensor, sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Row softmax and log-sum-exp in :func:`work_dtype`. A row whose scores are all ``-inf`` (no
    key to attend) gives zero weights and lse ``-inf``, with finite gradients: the row maximum is
    detached (softmax is shift-invariant) and replaced by 0 where it is not finite, and the sum is
    divided out only where it is positive. A NaN or +inf score makes the row's weights and lse NaN
    (as ``torch.softmax``: +inf / +inf). ``sink`` (broadcastable to ``[..., Lq, 1]``) is one more
    logit in every row's normaliser with no value (attention sinks): it takes probability mass,
    the weights of the keys then sum to less than 1, and the lse counts it."""
    work = work_dtype(scores.dtype)
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    if sink is not None:
        sink = sink.to(work)
        row_max = torch.maximum(row_max.to(work), sink.detach().expand_as(row_max))
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp((scores - row_max).to(work))
    total = exp.sum(dim=-1, keepdim=True)
    if sink is not None:
        total = total + torch.exp(sink - row_max)
    # each exp is <= 1 after the shift, so the sum is infinite only through a +inf score
    broken = ~torch.isfinite(total)
    has_key = total > 0
    nan = torch.full_like(total, float("nan"))
    divisor = torch.where(broken, nan, torch.where(has_key, total, torch.ones_like(total)))
    lse = torch.where(broken, nan, torch.where(has_key, torch.log(divisor) + row_max.to(work),
                                               torch.full_like(total, float("-inf"))))
    return exp / divisor, lse.squeeze(-1)


def fold_sinks(out: Tensor, lse: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """Each head's sink logit folded into rows computed over the keys alone (``out [N, H, Lq, Dv]``,
    ``lse [N, H, Lq]``, ``sinks [H]``): the normaliser gains ``exp(sink)``, so ``lse`` becomes
    ``logaddexp(lse, sink)`` and the output shrinks by ``exp(old - new lse)``. The same numbers as
    :func:`softmax_with_lse` with the sink in the softmax, special values included: a ``-inf`` sink
    is no sink; a ``+inf`` or NaN sink makes the head's every row NaN (output and lse), as an
    attended ``+inf`` or NaN score does; a row with no key keeps zeros and its lse becomes the sink."""
    if sinks is None:
        return out, lse
    sink = sinks.view(1, -1, 1).to(lse.dtype)
    total = torch.logaddexp(lse, sink)
    broken = torch.isnan(sink) | torch.isposinf(sink)
    # exp(lse - total) is 1 where both are -inf (no key and no sink mass): the row stays zeros
    shrink = torch.where(torch.isneginf(total), torch.ones_like(total), torch.exp(lse - total))
    shrink = torch.where(broken, torch.full_like(shrink, float("nan")), shrink)
    total = torch.where(broken, torch.full_like(total, float("nan")), total)
    return out * shrink[..., None].to(out.dtype), total


def soft_cap(scores: Tensor, cap: float | None) -> Tensor:
    """``cap * tanh(scores / cap)`` (Gemma 2's attention-logit soft-capping), or ``scores`` for None."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def alibi_bias(slopes: Tensor, rows: Tensor, keys: Tensor) -> Tensor:
    """ALiBi as FlashAttention defines it: ``-slope * |p - j|`` for a query at key position ``p``
    (``i + Lk - Lq``, bottom-right) and key ``j``. ``slopes`` broadcasts against the head dims of
    ``rows [..., n, 1]`` and ``keys [..., 1, m]`` (all already in the caller's layout)."""
    return -slopes * (rows - keys).abs().to(slopes.dtype)


def softmax_rows(scores: Tensor, sink: Tensor | None = None) -> Tensor:
    """:func:`softmax_with_lse`'s weights, in the scores' dtype."""
    if scores.shape[-1] == 0:
        return scores
    return softmax_with_lse(scores, sink)[0].to(scores.dtype)


def can_read(*tensors: Tensor) -> bool:
    """Whether values may steer control flow now: not while ``torch.compile`` traces (a branch would
    break the graph), not inside ``torch.func`` transforms or on fake or meta tensors (no values)."""
    return not torch.compiler.is_compiling() and not any(_torch_private.without_values(t) for t in tensors)


def _largest(*tensors: Tensor, one_read: bool | None = None) -> list[float]:
    """``max |t|`` of each tensor as a Python float (0 when empty), NaN when ``t`` holds a NaN and
    inf when it holds an inf (``aminmax`` propagates both; it runs ~50x faster here than
    ``isfinite(t).all()`` or an inf-norm on CPU). On the CPU two scalars read as floats cost less
    than combining them as tensors (a decoding call's finiteness check went from 22 to ~5 us); on
    an accelerator every read is a device synchronisation, so all the extremes travel in one
    (``one_read``, by default where any tensor is off the CPU)."""
    present = [t for t in tensors if t.numel()]
    if one_read if one_read is not None else any(t.device.type != "cpu" for t in present):
        pairs = torch.stack([torch.stack(torch.aminmax(t)).float() for t in present]).tolist()
    else:
        pairs = [[x.item() for x in torch.aminmax(t)] for t in present]
    extremes = iter(pairs)
    largest = []
    for t in tensors:
        low, high = next(extremes) if t.numel() else (0.0, 0.0)
        largest.append(max(abs(low), abs(high)) if not (math.isnan(low) or math.isnan(high)) else math.nan)
    return largest


def all_finite(*tensors: Tensor) -> bool:
    """Whether every value of ``tensors`` is finite (True when :func:`can_read` says no)."""
    if not can_read(*tensors):
        return True
    return all(math.isfinite(x) for x in _largest(*tensors))


def zero_sum_or_non_finite_row(t: Tensor) -> bool:
    """Whether some row of ``t`` (its last dim) sums to exactly 0, as a row of zeros does (or, by
    chance, another), or to NaN or inf, as a row holding one does; False when :func:`can_read` says
    no. One pass with nothing written but the row sums: SDPA's ``[1, 8, 512, 64]`` CPU call took
    1.04x its time with it, 1.19x with a row's largest magnitude (``abs`` writes the whole output)."""
    if not can_read(t) or t.numel() == 0:
        return False
    low, high = torch.aminmax(t.detach().sum(dim=-1).abs_())  # NaN propagates to both
    return low.item() == 0 or not math.isfinite(high.item())


def rows_with_keys(lo: Tensor, hi: Tensor) -> Tensor:
    """``[S, 1, Lq]`` bool: which rows' ranges ``[lo, hi)`` (``[S, R, Lq]``) hold a key (broadcasts
    against ``[N, H, Lq]``)."""
    return (lo < hi).any(1)[:, None, :]


def keyed_rows_not_finite(lse: Tensor, lo: Tensor, hi: Tensor) -> bool:
    """Whether a row whose ranges ``[lo, hi)`` (``[S, R, Lq]``) hold a key has an lse that is not
    finite (``lse [N, H, Lq]``, N = S or S = 1): -inf where every score it attends was -inf (or a
    dense mask removed its keys), NaN or +inf from an attended NaN or +inf score. False when
    :func:`can_read` says no."""
    if not can_read(lse, lo, hi):
        return False
    return bool((~torch.isfinite(lse) & rows_with_keys(lo, hi).to(lse.device)).any())


def output_or_keyed_lse_not_finite(out: Tensor, lse: Tensor, lo: Tensor, hi: Tensor) -> bool:
    """``not all_finite(out) or keyed_rows_not_finite(lse, lo, hi)`` as one :func:`all_finite` (on an
    accelerator one read of the device, where each read waits for the queue to drain: FlexAttention's
    output took two a call; on an H100 the engine's copies to and from the device averaged 0.15 ms):
    the lse of rows without a key is set to 0 first."""
    return not all_finite(out, torch.where(rows_with_keys(lo, hi).to(lse.device), lse, 0.0))


#: float32's largest value, with a margin: scores below it in magnitude cannot overflow.
SCORE_LIMIT = 1e38
#: The largest pairwise product (``batch x heads x Lq x Lk x D`` elements, 128 MiB in float32)
#: computed; beyond it the kernels' result stands (a masked-out NaN may then spread, never hide).
PAIRWISE_LIMIT = 1 << 25


def pairwise_fits(query: Tensor, key: Tensor) -> bool:
    """Whether the pairwise products of this call stay within :data:`PAIRWISE_LIMIT`."""
    return query.numel() * key.shape[-2] <= PAIRWISE_LIMIT


def needs_pairwise(query: Tensor, key: Tensor, value: Tensor, scale: float, grad_out: Tensor | None = None) -> bool:
    """Whether a masked call must run pairwise products: an input holds NaN or inf, or a score could
    overflow (``|q.k| * scale <= D * max|q| * max|k| * |scale|``; NaN and inf propagate into the
    bound). Either could put a non-finite number into a masked-out pair, which matrix products and
    additive masks would let into the row. A backward passes its ``grad_out`` too, which must then
    be finite as well (one read of the device for all four). False when :func:`can_read` says no,
    and beyond :data:`PAIRWISE_LIMIT` (:func:`pairwise_fits`): the kernels' result then stands, as
    the paths that redo a call when this is True would build the pairwise products (or its weights)
    and could exhaust the memory instead (a NaN in one key of a ``[1, 8, 2048, 64]`` call: 8 GiB)."""
    if not can_read(query, key, value) or not pairwise_fits(query, key):
        return False
    q, k, v, *g = _largest(query, key, value, *([] if grad_out is None else [grad_out]))
    return not (math.isfinite(v) and all(math.isfinite(x) for x in g)
                and q * k * query.shape[-1] * abs(scale) < SCORE_LIMIT)


def pairwise_scores(query: Tensor, key: Tensor, allowed: Tensor) -> Tensor:
    """``query @ key^T`` (``[..., Lq, Lk]``) where a pair that is not ``allowed`` is 0 and never
    multiplied, even through autograd (both factors are replaced before the product)."""
    pair = allowed[..., None]
    q = torch.where(pair, query[..., :, None, :], 0.0)
    k = torch.where(pair, key[..., None, :, :], 0.0)
    return (q * k).sum(-1)


def pairwise_values(weights: Tensor, value: Tensor, allowed: Tensor) -> Tensor:
    """``weights @ value`` (``[..., Lq, Dv]``) summing only ``allowed`` pairs, even through autograd."""
    pair = allowed[..., None]
    w = torch.where(pair, weights[..., None], 0.0)
    v = torch.where(pair, value[..., None, :, :], 0.0)
    return (w * v).sum(-2)
