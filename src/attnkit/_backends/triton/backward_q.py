"""The dQ kernel of the backward (:mod:`.backward`): one query block of one query head.

It visits key blocks exactly as the forward does (:func:`.common.key_span`: partial blocks masked,
in one loop, blocks every row attends whole unmasked, the rest never loaded) and recomputes each
block's weights from the lse. Keys outside the hull of a masked block's rows' ranges
(:func:`.common.key_hull`) load as zeros, so a NaN in a padded key cannot reach dQ through ``dS @ K``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import common as c

__all__ = ["dq_kernel"]


@triton.jit
def _visit_keys(dq, q, do, lse, delta, rows, start, lo, hi, first, last, drop_a, drop_c, Seed, k_base, v_base,
                kt_offsets, vt_offsets, d_inside, e_inside, stride_km, stride_vm, q_len, k_len,
                scale, softcap, slope, drop_scale,
                BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr):
    """One key block into ``dq`` of the rows (tiles are rows x keys); ``kt_offsets, vt_offsets``
    (:func:`.common.tile_offsets`) place its K^T and V^T tiles from its first key."""
    keys = start + tl.arange(0, BLOCK_N)
    block = tl.cast(start, tl.int64)  # a plain int under the interpreter
    if MASKED:
        attend = c.in_range(lo[:, None], hi[:, None], keys[None, :])
        used = c.in_range(first, last, keys)  # keys some row may reach (common.key_hull)
        kt = tl.load(k_base + block * stride_km + kt_offsets, mask=used[None, :] & d_inside[:, None], other=0.0)
        vt = tl.load(v_base + block * stride_vm + vt_offsets, mask=used[None, :] & e_inside[:, None], other=0.0)
    else:  # every row attends every key of the block (all inside k_len)
        kt = tl.load(k_base + block * stride_km + kt_offsets, mask=d_inside[:, None], other=0.0)
        vt = tl.load(v_base + block * stride_vm + vt_offsets, mask=e_inside[:, None], other=0.0)
    s, t = c.scores(c.dot(q, kt, IEEE), rows[:, None], keys[None, :], scale, softcap, slope,
                    k_len - q_len, SOFTCAP, HAS_ALIBI)
    p = c.exp_shifted(s, lse[:, None])
    dp = c.dot(do, vt, IEEE)
    if DROPOUT:
        kept = c.keep(Seed, drop_a[:, None], drop_c[:, None], keys[None, :])
        dp = c.dropped(dp, kept, drop_scale)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    if MASKED:
        ds = tl.where(attend, ds, 0.0)
    return dq + c.dot(ds.to(kt.dtype), tl.trans(kt), IEEE)


@triton.jit
def dq_kernel(Q, K, V, dOut, RowLse, Delta, dQ, Lo, Hi, Slopes, Seed,
              stride_qn, stride_qh, stride_qm, stride_qd, stride_kn, stride_kh, stride_km, stride_kd,
              stride_vn, stride_vh, stride_vm, stride_vd, stride_gn, stride_gh, stride_gm, stride_gd,
              stride_ls, stride_lr, stride_sn, stride_sh,
              heads, heads_per_kv, q_len, k_len, head_dim, v_dim,
              scale, softcap, drop_scale,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr, RANGES: tl.constexpr, SOFTCAP: tl.constexpr,
              HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr):
    """Grid ``(cdiv(Lq, BLOCK_M), N * H)``: dQ of one query block of one head."""
    pid_nh, n, h, n64, rows, valid, k_base, v_base, slope, drop_a, drop_c = c.query_block(
        K, V, Slopes, Seed, stride_kn, stride_kh, stride_vn, stride_vh, stride_sn, stride_sh,
        heads, heads_per_kv, q_len, BLOCK_M, HAS_ALIBI, DROPOUT)
    d = tl.arange(0, BLOCK_D)
    e = tl.arange(0, BLOCK_DV)
    row_offsets = rows.to(tl.int64)[:, None]
    q = tl.load(Q + n64 * stride_qn + h.to(tl.int64) * stride_qh + row_offsets * stride_qm + d[None, :] * stride_qd,
                mask=valid[:, None] & (d[None, :] < head_dim), other=0.0)
    do = tl.load(dOut + n64 * stride_gn + h.to(tl.int64) * stride_gh + row_offsets * stride_gm
                 + e[None, :] * stride_gd, mask=valid[:, None] & (e[None, :] < v_dim), other=0.0)
    lse, delta = c.row_stats(RowLse + pid_nh.to(tl.int64) * q_len, Delta + pid_nh.to(tl.int64) * q_len, rows, q_len)

    kt_offsets = c.tile_offsets(stride_km, stride_kd, BLOCK_N, BLOCK_D, True)
    vt_offsets = c.tile_offsets(stride_vm, stride_vd, BLOCK_N, BLOCK_DV, True)
    d_inside, e_inside = d < head_dim, e < v_dim
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for r in tl.static_range(RANGES):
        lo, hi = c.load_bounds(Lo + n * stride_ls + r * stride_lr, Hi + n * stride_ls + r * stride_lr,
                               rows, q_len, k_len)
        first, last = c.key_hull(lo, hi, k_len)
        start, full_lo, full_hi, end = c.key_span(first, last, lo, hi, valid, k_len, BLOCK_N)
        # partly attended blocks before and after the whole ones in one masked loop, as the forward's
        skip = full_hi - full_lo
        for edge in range(start, end - skip, BLOCK_N):
            block = edge + skip * (edge >= full_lo).to(tl.int32)
            dq = _visit_keys(dq, q, do, lse, delta, rows, block, lo, hi, first, last, drop_a, drop_c, Seed,
                             k_base, v_base, kt_offsets, vt_offsets, d_inside, e_inside, stride_km, stride_vm,
                             q_len, k_len, scale, softcap, slope, drop_scale, BLOCK_N, True, SOFTCAP, HAS_ALIBI,
                             DROPOUT, IEEE)
        for block in range(full_lo, full_hi, BLOCK_N):
            dq = _visit_keys(dq, q, do, lse, delta, rows, block, lo, hi, first, last, drop_a, drop_c, Seed,
                             k_base, v_base, kt_offsets, vt_offsets, d_inside, e_inside, stride_km, stride_vm,
                             q_len, k_len, scale, softcap, slope, drop_scale, BLOCK_N, False, SOFTCAP, HAS_ALIBI,
                             DROPOUT, IEEE)
    # dQ is a fresh contiguous tensor [N, H, Lq, D]
    tl.store(dQ + (pid_nh.to(tl.int64) * q_len + row_offsets) * head_dim + d[None, :],
             (dq * scale).to(dQ.dtype.element_ty), mask=valid[:, None] & (d[None, :] < head_dim))
