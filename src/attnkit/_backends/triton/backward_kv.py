"""The dK/dV kernel of the backward (:mod:`.backward`): one key block of one key/value head.

It walks the query blocks of every query head of its GQA group (without repeating K/V and with
nothing summed afterwards), from the first to the last that reach its key block
(:func:`.inputs.reached_blocks`; it used to read the summary of every query block, a scalar load
per block and head in every program), in one of two ways. Checked (the default): a query block is
visited only when the per-query-block summary (:func:`.inputs.block_summary`: the smallest lo and
largest hi of its rows) reaches the key block, and masked only when not every row attends the
whole key block (the largest lo and smallest hi). In runs (``RUNS``), as the forward walks its key
blocks: the run of query blocks that attend the whole key block unmasked, the blocks before and
after it masked (one loop, its index jumping over the run), with no branch in either loop (a branch in the loop body keeps Triton from
pipelining the loads of the next block; FlexAttention's backward walks lists of blocks so). A
masked visit of a block no row reaches adds zeros.
Rows that attend nothing in a masked block load as zeros: a NaN in a padded query cannot reach dK.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import common as c

__all__ = ["dkdv_kernel"]


@triton.jit
def _visit_rows(dk, dv, k, v, keys, first_key, last_key, start, q_base, do_base, RowLse, Delta, lo_ptr, hi_ptr,
                Seed, n, h, stride_qm, stride_qd, stride_gm, stride_gd, q_len, k_len, head_dim, v_dim,
                scale, softcap, slope, drop_scale,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, MASKED: tl.constexpr,
                SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr):
    """One query block into ``dk, dv`` of the key block (tiles are keys x rows)."""
    rows = start + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    e = tl.arange(0, BLOCK_DV)
    lse, delta = c.row_stats(RowLse, Delta, rows, q_len)
    if MASKED:
        lo, hi = c.load_bounds(lo_ptr, hi_ptr, rows, q_len, k_len)
        attend = c.in_range(lo[None, :], hi[None, :], keys[:, None])
        # rows that attend some key here (none past q_len): each row's one range against the block's,
        # where a reduction of ``attend`` across the keys cost 30 SASS instructions a block
        used = (lo < hi) & (lo < last_key) & (hi > first_key)
    row_offsets = rows.to(tl.int64)[:, None]
    if MASKED:
        q = tl.load(q_base + row_offsets * stride_qm + d[None, :] * stride_qd,
                    mask=used[:, None] & (d[None, :] < head_dim), other=0.0)
        do = tl.load(do_base + row_offsets * stride_gm + e[None, :] * stride_gd,
                     mask=used[:, None] & (e[None, :] < v_dim), other=0.0)
    else:  # a whole block: every row attends every key here, so none lies past q_len (block_summary)
        q = tl.load(q_base + row_offsets * stride_qm + d[None, :] * stride_qd, mask=d[None, :] < head_dim, other=0.0)
        do = tl.load(do_base + row_offsets * stride_gm + e[None, :] * stride_gd, mask=e[None, :] < v_dim,
                     other=0.0)
    s, t = c.scores(c.dot(k, tl.trans(q), IEEE), rows[None, :], keys[:, None], scale, softcap, slope,
                    k_len - q_len, SOFTCAP, HAS_ALIBI)
    p = c.exp_shifted(s, lse[None, :])
    if MASKED:
        p = tl.where(attend, p, 0.0)
    dp = c.dot(v, tl.trans(do), IEEE)
    if DROPOUT:
        drop_a, drop_c = c.row_hash(Seed, n, h, rows)
        kept = c.keep(Seed, drop_a[None, :], drop_c[None, :], keys[:, None])
        dv += c.dot(c.dropped(p, kept, drop_scale).to(do.dtype), do, IEEE)
        dp = c.dropped(dp, kept, drop_scale)
    else:
        dv += c.dot(p.to(do.dtype), do, IEEE)
    ds = p * (dp - delta[None, :])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    if MASKED:
        ds = tl.where(attend, ds, 0.0)
    dk += c.dot(ds.to(q.dtype), q, IEEE)
    return dk, dv


@triton.jit
def dkdv_kernel(Q, K, V, dOut, RowLse, Delta, dK, dV, Lo, Hi, Summary, Reached, Slopes, Seed,
                stride_qn, stride_qh, stride_qm, stride_qd, stride_kn, stride_kh, stride_km, stride_kd,
                stride_vn, stride_vh, stride_vm, stride_vd, stride_gn, stride_gh, stride_gm, stride_gd,
                stride_ls, stride_lr, stride_us, stride_ur, stride_rs, stride_rr, stride_sn, stride_sh,
                kv_heads, heads_per_kv, q_len, k_len, head_dim, v_dim,
                scale, softcap, drop_scale,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr, RANGES: tl.constexpr, SOFTCAP: tl.constexpr,
                HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr, RUNS: tl.constexpr):
    """Grid ``(cdiv(Lk, BLOCK_N), N * Hkv)``: dK and dV of one key block, summed over the query heads
    sharing it. ``RUNS``: walk the query blocks as three runs (:func:`.inputs.reached_blocks`), else
    check each against its summary."""
    pid = tl.program_id(1)
    n = pid // kv_heads
    n64 = n.to(tl.int64)
    hkv64 = (pid % kv_heads).to(tl.int64)
    first_key = tl.program_id(0) * BLOCK_N
    keys = first_key + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    e = tl.arange(0, BLOCK_DV)
    key_rows = keys.to(tl.int64)[:, None]
    k_offsets = n64 * stride_kn + hkv64 * stride_kh + key_rows * stride_km + d[None, :] * stride_kd
    v_offsets = n64 * stride_vn + hkv64 * stride_vh + key_rows * stride_vm + e[None, :] * stride_vd
    k_mask = (keys[:, None] < k_len) & (d[None, :] < head_dim)
    v_mask = (keys[:, None] < k_len) & (e[None, :] < v_dim)
    k = tl.load(K + k_offsets, mask=k_mask, other=0.0)
    v = tl.load(V + v_offsets, mask=v_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    last_key = first_key + BLOCK_N
    for g in range(heads_per_kv):
        h = (pid % kv_heads) * heads_per_kv + g
        nh = n64 * (kv_heads * heads_per_kv) + h
        q_base = Q + n64 * stride_qn + h.to(tl.int64) * stride_qh
        do_base = dOut + n64 * stride_gn + h.to(tl.int64) * stride_gh
        slope = c.alibi_slope(Slopes, n, h, stride_sn, stride_sh, HAS_ALIBI)
        for r in tl.static_range(RANGES):
            lo_ptr = Lo + n * stride_ls + r * stride_lr
            hi_ptr = Hi + n * stride_ls + r * stride_lr
            # only the query blocks between the first and the last that reach this key block
            span = Reached + n * stride_rs + r * stride_rr + tl.program_id(0) * 4
            lse_nh, delta_nh = RowLse + nh * q_len, Delta + nh * q_len
            if RUNS:  # the blocks before the whole run and after it masked, the run unmasked: no branch
                begin, whole_begin = tl.load(span), tl.load(span + 1)
                whole_end, end = tl.load(span + 2), tl.load(span + 3)
                skip = whole_end - whole_begin
                # one masked loop over the blocks before the run and after it (one inlined visit
                # fewer than a loop for each: ptxas spilled more with three)
                for i in range(begin, end - skip):
                    block = i + skip * (i >= whole_begin).to(tl.int32)
                    dk, dv = _visit_rows(dk, dv, k, v, keys, first_key, last_key, block * BLOCK_M, q_base, do_base,
                                         lse_nh, delta_nh, lo_ptr, hi_ptr, Seed, n, h, stride_qm, stride_qd,
                                         stride_gm, stride_gd, q_len, k_len, head_dim, v_dim, scale, softcap, slope,
                                         drop_scale, BLOCK_M, BLOCK_D, BLOCK_DV, True, SOFTCAP, HAS_ALIBI, DROPOUT,
                                         IEEE)
                for block in range(whole_begin, whole_end):
                    dk, dv = _visit_rows(dk, dv, k, v, keys, first_key, last_key, block * BLOCK_M, q_base, do_base,
                                         lse_nh, delta_nh, lo_ptr, hi_ptr, Seed, n, h, stride_qm, stride_qd,
                                         stride_gm, stride_gd, q_len, k_len, head_dim, v_dim, scale, softcap, slope,
                                         drop_scale, BLOCK_M, BLOCK_D, BLOCK_DV, False, SOFTCAP, HAS_ALIBI, DROPOUT,
                                         IEEE)
            else:  # each block checked against its summary: skipped, unmasked or masked
                for block in range(tl.load(span), tl.load(span + 3)):
                    summary = Summary + n * stride_us + r * stride_ur + block * 4
                    reach = (tl.load(summary) < last_key) & (tl.load(summary + 1) > first_key)
                    if reach:
                        full = (tl.load(summary + 2) <= first_key) & (last_key <= tl.load(summary + 3))
                        if full:
                            dk, dv = _visit_rows(dk, dv, k, v, keys, first_key, last_key, block * BLOCK_M, q_base,
                                                 do_base, lse_nh, delta_nh, lo_ptr, hi_ptr, Seed, n, h, stride_qm,
                                                 stride_qd, stride_gm, stride_gd, q_len, k_len, head_dim, v_dim,
                                                 scale, softcap, slope, drop_scale, BLOCK_M, BLOCK_D, BLOCK_DV, False,
                                                 SOFTCAP, HAS_ALIBI, DROPOUT, IEEE)
                        else:
                            dk, dv = _visit_rows(dk, dv, k, v, keys, first_key, last_key, block * BLOCK_M, q_base,
                                                 do_base, lse_nh, delta_nh, lo_ptr, hi_ptr, Seed, n, h, stride_qm,
                                                 stride_qd, stride_gm, stride_gd, q_len, k_len, head_dim, v_dim,
                                                 scale, softcap, slope, drop_scale, BLOCK_M, BLOCK_D, BLOCK_DV, True,
                                                 SOFTCAP, HAS_ALIBI, DROPOUT, IEEE)
    # dK and dV are fresh contiguous tensors [N, Hkv, Lk, D / Dv]
    rows_out = (n64 * kv_heads + hkv64) * k_len + key_rows
    tl.store(dK + rows_out * head_dim + d[None, :], (dk * scale).to(dK.dtype.element_ty), mask=k_mask)
    tl.store(dV + rows_out * v_dim + e[None, :], dv.to(dV.dtype.element_ty), mask=v_mask)
