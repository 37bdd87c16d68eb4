"""An independent attention oracle for the tests: plain PyTorch, written without attnkit.

It follows the textbook definition directly: every (query, key) pair is allowed or not,
allowed scores go through a softmax, rows with nothing allowed are zeros. Computed in
float64 by default, or in any dtype for the low-precision error budget (see tolerances).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def oracle_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[Tensor, Tensor]:
    """Return ``(output, weights)`` computed in ``dtype``."""
    q, k, v = query.to(dtype), key.to(dtype), value.to(dtype)
    if q.dim() == 4 and k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k = torch.stack([k[:, h // group] for h in range(q.shape[1])], dim=1)
        v = torch.stack([v[:, h // group] for h in range(q.shape[1])], dim=1)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    lq, lk = q.shape[-2], k.shape[-2]

    allowed = torch.ones(scores.shape, dtype=torch.bool)
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed = allowed & mask
        else:
            scores = scores + mask.to(dtype)
            allowed = allowed & (mask != float("-inf"))
    if causal:
        rows = torch.arange(lq).unsqueeze(-1)
        cols = torch.arange(lk).unsqueeze(0)
        allowed = allowed & (cols <= rows + (lk - lq))

    scores = scores.masked_fill(~allowed, float("-inf"))
    has_key = allowed.any(dim=-1, keepdim=True)
    safe = scores.masked_fill(~has_key, 0.0)
    weights = torch.softmax(safe, dim=-1).masked_fill(~has_key, 0.0)
    return torch.matmul(weights, v), weights


def oracle_lse(query: Tensor, key: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """float64 ``log(sum exp(scale * q.k))`` over the allowed keys of each row, ``[..., Lq]``;
    ``-inf`` exactly where a row has no allowed key. ``query [B, H, Lq, D]``, ``key [B, Hkv,
    Lk, D]`` (GQA: query head ``h`` reads key head ``h // (H / Hkv)``), ``allowed`` a boolean
    mask broadcastable to ``[B, H, Lq, Lk]``."""
    q, k = query.double(), key.double()
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return torch.logsumexp((q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf")), dim=-1)


def output_and_gradients(fn, inputs: tuple[Tensor, ...], grad_out: Tensor, dtype: torch.dtype,
                         lse_weight: Tensor | None = None) -> list[Tensor]:
    """``[output, *gradients]`` of ``fn(*inputs)`` run on the inputs cast to ``dtype`` (fresh leaves:
    the caller's tensors are left alone), backpropagating ``grad_out`` (cast too): the one way the
    error-budget tests run each contender. ``fn`` may return ``(output, lse)``; with
    ``lse_weight``, ``lse_weight`` times the lse (its finite entries) joins the loss, so that the
    lse's gradient reaches the kernel too."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
    result = fn(*leaves)
    out = result[0] if isinstance(result, tuple) else result
    loss = (out.float() * grad_out.to(dtype).float()).sum()
    if lse_weight is not None:
        loss = loss + (torch.where(result[1].isfinite(), result[1], 0).float() * lse_weight).sum()
    loss.backward()
    return [out.detach()] + [t.grad for t in leaves]


def pairwise_oracle(query: Tensor, key: Tensor, value: Tensor, scale: float, allowed: Tensor,
                    sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` pair by pair, for inputs holding NaN or inf (computed in the inputs' dtype):
    a pair that ``allowed`` removes is replaced before any product, so it never enters one (not even
    as ``0 * NaN``) and autograd sees no path through it; an attended NaN or +inf score makes its row
    NaN (softmax's inf / inf), -inf scores weigh 0. ``key``/``value`` with fewer heads than
    ``query`` are shared by groups of heads (GQA); ``sinks [H]`` join each row's normaliser with no
    value."""
    repeat = query.shape[1] // key.shape[1] if query.dim() == 4 else 1
    key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    pair = allowed[..., None]
    scores = (torch.where(pair, query[..., :, None, :], 0.0) * torch.where(pair, key[..., None, :, :], 0.0)).sum(-1)
    scores = (scores * scale).masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], -1)
    peak = scores.detach().amax(-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    exp = torch.exp(scores - peak)
    total = exp.sum(-1, keepdim=True)
    broken = ~torch.isfinite(total)
    divisor = torch.where(broken, torch.full_like(total, float("nan")), torch.where(total > 0, total, 1.0))
    weights = (exp / divisor)[..., : allowed.shape[-1]]
    out = (torch.where(pair, weights[..., None], 0.0) * torch.where(pair, value[..., None, :, :], 0.0)).sum(-2)
    lse = torch.where(broken, float("nan"), torch.where(total > 0, torch.log(divisor) + peak, float("-inf")))
    return out, lse[..., 0]


def flash_backward_float32(query: Tensor, key: Tensor, value: Tensor, grad_out: Tensor, allowed: Tensor,
                           scale: float, *, softcap: float | None = None, alibi_slopes: Tensor | None = None,
                           sinks: Tensor | None = None, keep: Tensor | None = None,
                           dropout: float = 0.0, grad_lse: Tensor | None = None) -> list[Tensor]:
    """``[output, dq, dk, dv]`` as FlashAttention's algorithm computes them, in float32 by plain
    PyTorch ops: the backward's softmax term is ``dS = P * (dP - delta)`` with the row term
    ``delta = rowsum(dO * O)`` (Dao et al. 2022, the backward pass), where the textbook backward
    (autograd, the math path) takes ``rowsum(P * dP)``. The two are equal in exact arithmetic, but
    not in float32: on a row that attends one key, dS is exactly 0 by the textbook and the rounding
    of two differently ordered dot products by this one (PyTorch's own fused CPU kernel reads 7e-6 at dk there in
    float32 where its math path reads 0). Its error against float64 is the floor of every kernel
    built on that algorithm, so the tests that hold a kernel to a textbook bar allow it too.

    ``query [B, H, Lq, D]``, ``key [B, Hkv, Lk, D]``, ``value [B, Hkv, Lk, Dv]`` (GQA: query head
    ``h`` reads kv head ``h // (H / Hkv)``), ``grad_out [B, H, Lq, Dv]``, ``allowed`` broadcastable
    to ``[B, H, Lq, Lk]``; ``softcap`` (``cap * tanh(s / cap)``), ``alibi_slopes [H]`` (FlashAttention's
    ``-slope * |i + Lk - Lq - j|``), ``sinks [H]`` (a logit in each row's normaliser with no value),
    ``keep`` (bool ``[B, H, Lq, Lk]``, the dropout's kept weights, each scaled by ``1 / (1 - dropout)``),
    ``grad_lse [B, H, Lq]`` (a gradient on the lse too, which FlashAttention takes off the row term;
    rows with no key have a constant lse)."""
    group = query.shape[1] // key.shape[1]
    q, dout = query.float(), grad_out.float()
    k, v = key.float().repeat_interleave(group, 1), value.float().repeat_interleave(group, 1)
    lq, lk = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        capped = torch.tanh(scores / softcap)
        scores = softcap * capped
    if alibi_slopes is not None:
        distance = (torch.arange(lq)[:, None] + lk - lq - torch.arange(lk)[None, :]).abs()
        scores = scores - alibi_slopes.float().view(1, -1, 1, 1) * distance
    scores = scores.masked_fill(~allowed, float("-inf"))
    logits = scores if sinks is None else torch.cat(
        [scores, sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], -1)
    lse = torch.logsumexp(logits, -1, keepdim=True)
    finite = torch.isfinite(lse)
    weights = torch.where(finite, torch.exp(scores - torch.where(finite, lse, 0.0)), 0.0)
    factors = keep.float() / (1.0 - dropout) if keep is not None else torch.ones_like(weights)
    dropped = weights * factors
    out = dropped @ v
    delta = (dout * out).sum(-1, keepdim=True)
    if grad_lse is not None:
        delta = delta - torch.where(finite, grad_lse.float()[..., None], 0.0)
    grad_scores = weights * ((dout @ v.transpose(-1, -2)) * factors - delta)
    if softcap is not None:
        grad_scores = grad_scores * (1.0 - capped * capped)
    dq = grad_scores @ k * scale
    fold = lambda t: t.unflatten(1, (-1, group)).sum(2)  # noqa: E731  (a kv head's query heads)
    dk = fold(grad_scores.transpose(-1, -2) @ q * scale)
    dv = fold(dropped.transpose(-1, -2) @ dout)
    return [out, dq, dk, dv]
