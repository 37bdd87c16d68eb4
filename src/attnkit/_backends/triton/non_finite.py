"""The forward's second pass for a NaN or inf value in a partly attended block.

A partly attended block multiplies ``P @ V`` whole: a key that only some of its rows attend meets
the others with a weight of 0, and ``0 * inf`` or ``0 * NaN`` would carry the value into rows that
do not attend it. The definition (:mod:`attnkit._backends.numerics`) never makes those products.
Checking the output on the host would cost a device synchronisation on every call, so the forward
program checks instead: after its loop, :func:`in_partial_blocks` reads the values of its partly
attended blocks again (a few tiles), and only when one of them holds a NaN or inf does
:func:`values_again` recompute the rows' weighted sum pair by pair, with the rows' final max known
(no rescaling): one key at a time, its products only in the rows that attend it, each as IEEE
arithmetic gives it (+-inf, or NaN for a NaN value or a weight of 0).

The backward has no such pass: built the same way, it doubled the spills of the dK/dV kernel
(:mod:`.backward`; ptxas on a compile without the launch's specialisation), so its caller checks
the inputs instead.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import common as c

__all__ = ["in_partial_blocks", "values_again"]


@triton.jit
def _holds_non_finite(v_base, start, first, last, stride_vm, stride_vd, v_dim,
                      BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Whether a key of the block at ``start`` that the forward's loop loaded (inside the rows'
    :func:`.common.key_hull` ``[first, last)``) has a NaN or inf value."""
    keys = start + tl.arange(0, BLOCK_N)
    dv = tl.arange(0, BLOCK_DV)
    used = c.in_range(first, last, keys)
    v = tl.load(v_base + keys.to(tl.int64)[:, None] * stride_vm + dv[None, :] * stride_vd,
                mask=used[:, None] & (dv[None, :] < v_dim), other=0.0).to(tl.float32)
    return tl.max(tl.max(tl.where(tl.abs(v) < float("inf"), 0, 1), 1), 0)


@triton.jit
def in_partial_blocks(v_base, rows, valid, lo_ptr, hi_ptr, stride_lr, stride_vm, stride_vd, q_len, k_len, v_dim,
                      BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, RANGES: tl.constexpr):
    """Whether the rows' partly attended blocks (of every range) hold an attended NaN or inf value."""
    found = 0
    for r in tl.static_range(RANGES):
        lo, hi = c.load_bounds(lo_ptr + r * stride_lr, hi_ptr + r * stride_lr, rows, q_len, k_len)
        first, last = c.key_hull(lo, hi, k_len)
        start, full_lo, full_hi, end = c.key_span(first, last, lo, hi, valid, k_len, BLOCK_N)
        for block in range(start, full_lo, BLOCK_N):
            found = tl.maximum(found, _holds_non_finite(v_base, block, first, last, stride_vm, stride_vd, v_dim,
                                                        BLOCK_N, BLOCK_DV))
        for block in range(full_hi, end, BLOCK_N):
            found = tl.maximum(found, _holds_non_finite(v_base, block, first, last, stride_vm, stride_vd, v_dim,
                                                        BLOCK_N, BLOCK_DV))
    return found > 0


@triton.jit
def values_again(m_i, q, k_base, v_base, rows, valid, lo_ptr, hi_ptr, stride_lr, drop_a, drop_c, seed_ptr,
                 stride_km, stride_kd, stride_vm, stride_vd, q_len, k_len, head_dim, v_dim,
                 scale, softcap, slope, k_minus_q,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 RANGES: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr):
    """The rows' ``sum_j exp(s_ij - max_i) v_j`` (before the division by their sum) pair by pair,
    as the definition reads: one key at a time, its score from ``q`` by an fp32 sum of products
    and its value multiplied only into the rows that attend it. No tensor-core tile: the pass is
    rare, and so its code stays small (it is compiled with every forward). ``m_i`` is the rows'
    final max from the forward's loop."""
    shift = tl.where(m_i == float("-inf"), 0.0, m_i)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q32 = q.to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for r in tl.static_range(RANGES):
        lo, hi = c.load_bounds(lo_ptr + r * stride_lr, hi_ptr + r * stride_lr, rows, q_len, k_len)
        first, last = c.key_hull(lo, hi, k_len)
        start, full_lo, full_hi, end = c.key_span(first, last, lo, hi, valid, k_len, BLOCK_N)
        for j in range(start, end):
            key = j + tl.zeros([1], dtype=tl.int64)
            k = tl.load(k_base + key * stride_km + d * stride_kd, mask=(d < head_dim) & (key < k_len),
                        other=0.0).to(tl.float32)
            v = tl.load(v_base + key * stride_vm + dv * stride_vd, mask=(dv < v_dim) & (key < k_len),
                        other=0.0).to(tl.float32)
            attend = c.in_range(lo, hi, key)
            s, t = c.scores(tl.sum(q32 * k[None, :], 1), rows, key, scale, softcap, slope, k_minus_q,
                            SOFTCAP, HAS_ALIBI)
            p = c.exp_shifted(tl.where(attend, s, float("-inf")), shift)
            if DROPOUT:
                p = c.dropped(p, c.keep(seed_ptr, drop_a, drop_c, key), 1.0)
            acc += tl.where(attend[:, None], p[:, None] * v[None, :], 0.0)
    return acc
