"""The backward kernels, FlashAttention-2's split: dK/dV by key block, dQ by query block.

Both recompute the weights from the stored lse, ``P = exp(s - lse)``, and use ``delta_i =
rowsum(dO_i * O_i) - dlse_i`` (a preprocess kernel), so that ``dS = P * (dP - delta)`` carries the
lse's own gradient too. The dQ kernel (:mod:`.backward_q`) walks key blocks exactly like the
forward. The dK/dV kernel (:mod:`.backward_kv`) owns one key block of one key/value head and walks
the query blocks of every query head of its GQA group (without repeating K/V, nothing summed
afterwards) between the first and the last that reach its keys (:func:`.inputs.reached_blocks`);
it skips query blocks whose rows cannot reach its keys by a per-query-block summary
(:func:`.inputs.block_summary`) and masks only the blocks that some row attends in part (or, with
``walk="runs"``, takes them in three runs with no branch, as the forward). This module holds the
preprocess and the launches.

Masked pairs stay out of ``dS`` (``tl.where``; rows, or keys, that attend nothing in a block load
as zeros), but not out of the products as the forward keeps them (:mod:`.non_finite`): a NaN or
inf in a query, key or output-gradient row that part of a block attends can reach the others'
gradients through ``dS^T Q``, ``dS K`` or ``P^T dO``. So the caller checks the inputs before the
backward (one read of the device) and takes the pairwise path where they hold one. Doing it in
the kernels, as the forward does, was built and passed the definition's tests, but doubled
ptxas's spills in the dK/dV kernel (compiled then without the launch's specialisation) and cost
60% more compile time: left out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .backward_kv import dkdv_kernel
from .backward_q import dq_kernel
from .inputs import Prepared, block_summary, derived_from, reached_blocks, remembered

__all__ = ["launch"]


@triton.jit
def _delta_kernel(Out, dOut, dLse, Lse, Delta, RowLse, stride_on, stride_oh, stride_om, stride_od,
                  stride_gn, stride_gh, stride_gm, stride_gd, heads, q_len, v_dim,
                  BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_DLSE: tl.constexpr):
    """``delta = rowsum(dO * O) - dlse`` and the lse the other kernels read, with +inf for rows of no
    key (lse -inf) so that their weights come out 0 wherever they are computed (float32 ``[N, H,
    Lq]`` each): per row here, where the dK/dV kernel turned it per element of every query block it
    visited (48 instructions of its 599 a block, default tiles)."""
    pid_nh = tl.program_id(1)
    n = (pid_nh // heads).to(tl.int64)
    h = (pid_nh % heads).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dv = tl.arange(0, BLOCK_DV)
    inside = (rows[:, None] < q_len) & (dv[None, :] < v_dim)
    o = tl.load(Out + n * stride_on + h * stride_oh + rows.to(tl.int64)[:, None] * stride_om + dv[None, :] * stride_od,
                mask=inside, other=0.0).to(tl.float32)
    do = tl.load(dOut + n * stride_gn + h * stride_gh + rows.to(tl.int64)[:, None] * stride_gm
                 + dv[None, :] * stride_gd, mask=inside, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    offsets = pid_nh.to(tl.int64) * q_len + rows
    if HAS_DLSE:
        delta -= tl.load(dLse + offsets, mask=rows < q_len, other=0.0)
    tl.store(Delta + offsets, delta, mask=rows < q_len)
    lse = tl.load(Lse + offsets, mask=rows < q_len, other=0.0)
    tl.store(RowLse + offsets, tl.where(lse == float("-inf"), float("inf"), lse), mask=rows < q_len)




#: How the dK/dV kernel walks the query blocks (:mod:`.backward_kv`): each checked against its
#: summary (the default, measured), or in three runs with no branch (unmeasured on a GPU yet:
#: ``benchmarks/triton_blocks.py`` times both).
WALKS = ("checked", "runs")


def launch(prep: Prepared, grad_out: Tensor, grad_lse: Tensor | None, out: Tensor, lse: Tensor,
           blocks: tuple[int, int, int, int], num_warps: int, num_stages: int,
           walk: str = "checked") -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` shaped (contiguous) and typed like query, key, value. ``blocks`` is
    ``(BLOCK_M, BLOCK_N)`` of the dK/dV kernel then of the dQ kernel; ``walk`` one of
    :data:`WALKS`."""
    if walk not in WALKS:
        raise ValueError(f"walk must be one of {WALKS}, got {walk!r}")
    query, key, value = prep.query, prep.key, prep.value
    n, heads, q_len, head_dim = query.shape
    kv_heads, k_len, v_dim = key.shape[1], key.shape[2], value.shape[3]
    if n * heads * q_len == 0 or k_len == 0:  # nothing attended: every gradient is zero
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    # the kernels write every element
    dq = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    dk = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    dv = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    lse = lse.to(torch.float32).contiguous()
    delta = torch.empty((n, heads, q_len), dtype=torch.float32, device=query.device)
    row_lse = torch.empty_like(delta)
    dlse = lse if grad_lse is None else grad_lse.to(torch.float32).expand(n, heads, q_len).contiguous()
    rows_block = max(16, 4096 // prep.block_dv)  # two [rows, Dv] fp32 tiles in registers
    _delta_kernel[(triton.cdiv(q_len, rows_block), n * heads)](
        out, grad_out, dlse, lse, delta, row_lse, *out.stride(), *grad_out.stride(), heads, q_len, v_dim,
        BLOCK_M=rows_block, BLOCK_DV=prep.block_dv, HAS_DLSE=grad_lse is not None)

    kv_m, kv_n, q_m, q_n = blocks
    def summaries() -> tuple[Tensor, Tensor]:
        summary = block_summary(prep.lo, prep.hi, k_len, kv_m)
        return summary, reached_blocks(summary, k_len, kv_n)

    # prep.lo, prep.hi are themselves kept per pair of bounds (inputs.derived_from), so a model's
    # calls find these too
    summary, reached = remembered(derived_from(prep.lo, prep.hi), ("reached", k_len, kv_m, kv_n), summaries)
    common = dict(BLOCK_D=prep.block_d, BLOCK_DV=prep.block_dv, RANGES=prep.ranges, SOFTCAP=prep.has_softcap,
                  HAS_ALIBI=prep.has_alibi, DROPOUT=prep.has_dropout, IEEE=prep.ieee,
                  num_warps=num_warps, num_stages=num_stages)
    strides = (*query.stride(), *key.stride(), *value.stride(), *grad_out.stride())
    dkdv_kernel[(triton.cdiv(k_len, kv_n), n * kv_heads)](
        query, key, value, grad_out, row_lse, delta, dk, dv, prep.lo, prep.hi, summary, reached, prep.slopes, prep.seed,
        *strides, prep.stride_ls, prep.stride_lr,
        summary.stride(0) if summary.shape[0] > 1 else 0, summary.stride(1),
        reached.stride(0) if reached.shape[0] > 1 else 0, reached.stride(1), prep.stride_sn, prep.stride_sh,
        kv_heads, prep.heads_per_kv, q_len, k_len, head_dim, v_dim,
        prep.scale, prep.softcap, prep.drop_scale, BLOCK_M=kv_m, BLOCK_N=kv_n, RUNS=walk == "runs", **common)
    dq_kernel[(triton.cdiv(q_len, q_m), n * heads)](
        query, key, value, grad_out, row_lse, delta, dq, prep.lo, prep.hi, prep.slopes, prep.seed,
        *strides, prep.stride_ls, prep.stride_lr, prep.stride_sn, prep.stride_sh,
        heads, prep.heads_per_kv, q_len, k_len, head_dim, v_dim,
        prep.scale, prep.softcap, prep.drop_scale, BLOCK_M=q_m, BLOCK_N=q_n, **common)
    return dq, dk, dv
