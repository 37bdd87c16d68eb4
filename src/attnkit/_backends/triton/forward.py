"""The forward kernel: FlashAttention-2's online softmax over only the key blocks a query block's
intervals reach.

One program owns ``BLOCK_M`` query rows of one ``(n, h)``. It reads the rows' ``[lo, hi)`` once per
range and splits the keys they reach into three runs of blocks (:func:`.common.key_span`): partly
attended blocks before and after, which pay for an element-wise mask (one loop for both), and the
blocks every row attends whole, which run with no mask at all; keys outside the span are never
loaded. Two ranges a row run one after the other, each masked to itself, so a block both reach is
counted once per pair.

Masked-out pairs never enter the sums, so the output needs no check afterwards (no host sync):
their scores become ``-inf`` through ``tl.where`` (a NaN score stays out), and values of keys
outside the hull of the block's rows' ranges (:func:`.common.key_hull`) load as zeros. A key that
some rows of a partly attended block attend and others do not, or one in a gap between their
ranges, still meets all of them in ``P @ V``, where a NaN or inf value would reach the others
through ``0 * inf`` (FlashAttention's kernels let it). So after its loop a program looks at the
values of its partly attended blocks again, and where one holds a NaN or inf it computes its
output a second time without that leak (:mod:`.non_finite`): rare, and off the hot loop.

The key and value tiles come by per-thread addresses (asynchronous copies the loop pipelines), or,
with ``loads="tma"``, those of the whole blocks through Hopper's tensor memory accelerator: one bulk
copy a tile from a descriptor made on the host (:func:`tma_descriptors`), no address arithmetic in
the loop. By ptxas (sm_90a, bf16, D = 128, 64 x 64 tiles) that takes the whole blocks' loop from 399
to 376 instructions and the kernel from 232 to 226 registers; it is not timed on a GPU yet, so the
pointers stay the default. The partly attended blocks keep the pointer loads: their values must
load as zeros outside the rows' hull, which a ``tl.where`` on a TMA tile did at 913 instructions a
block against 623.

Compiled into the kernel, that pass costs registers even where it never runs: ptxas (sm_90a, bf16,
D = 128, the default 64 x 64 tiles, 4 warps, specialised as the launch is) spills nothing without
it and 4 bytes of stores and loads with it (``benchmarks/triton_spills.py``). So
:func:`launch` runs it ``"gated"``: the kernel without the pass, then the same kernel with it, as
a second launch whose programs return at once
unless the values hold a NaN or inf (one ``aminmax`` over them on the device, no host sync) and
their own partly attended blocks do. Both give the same bits; on an H100 (L = 32768, H = 16,
bf16) the gated forward took 1.14 ms for a window of 1024 and 1.80 for 8 documents, the inline
one 1.23 and 2.34, the kernel with no pass at all 0.96 and 1.72 (``benchmarks/triton_blocks.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import common as c
from . import non_finite
from .inputs import Prepared, TensorDescriptor, tile_descriptor

__all__ = ["launch"]


@triton.jit
def _visit(acc, m_i, l_i, q, k_base, v_base, kt_offsets, v_offsets, d_inside, dv_inside, start, rows, lo, hi,
           first, last, drop_a, drop_c, seed_ptr, stride_km, stride_vm, k_len, k_desc, v_desc, n, kv_head,
           scale, exp_scale, softcap, slope, k_minus_q,
           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, MASKED: tl.constexpr,
           RAW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
           IEEE: tl.constexpr, TMA: tl.constexpr):
    """One key block into the running ``(acc, max, sum)`` of the rows. ``kt_offsets, v_offsets``
    (:func:`.common.tile_offsets`) place the block's K^T and V tiles from its first key, and
    ``d_inside, dv_inside`` say which features lie inside ``head_dim`` and ``v_dim``. ``TMA``: the
    tiles come through the descriptors ``k_desc, v_desc`` instead (:func:`tma_descriptors`), which
    fill keys past ``k_len`` and features past the widths with zeros, as the masks of the loads do.

    ``RAW`` (no score modifier, ``scale > 0``): the max runs over the raw products ``qk`` and the
    weights are ``exp2((qk - max) * exp_scale)``, ``exp_scale = scale * log2(e)``: one multiply an
    element fewer than scores in natural units, and the row's maximum still weighs exactly 1 (a
    subtraction, then a multiply: nothing the compiler can fuse). ``max(fl(qk * scale)) =
    fl(max(qk) * scale)`` for ``scale > 0``, so the caller's lse is the natural one; where that
    product overflows, the caller gives the row what the natural scores would (NaN, or no weight)."""
    keys = start + tl.arange(0, BLOCK_N)
    block = tl.cast(start, tl.int64)  # a plain int under the interpreter
    kt_ptrs = k_base + block * stride_km + kt_offsets
    v_ptrs = v_base + block * stride_vm + v_offsets
    if MASKED:  # by pointers whatever TMA says: the values outside the hull must load as zeros
        attend = c.in_range(lo[:, None], hi[:, None], keys[None, :])
        used = c.in_range(first, last, keys)  # keys some row may reach (common.key_hull)
        kt = tl.load(kt_ptrs, mask=d_inside[:, None] & (keys[None, :] < k_len), other=0.0)
        v = tl.load(v_ptrs, mask=used[:, None] & dv_inside[None, :], other=0.0)
    elif TMA:
        kt = tl.trans(tl.reshape(k_desc.load([n, kv_head, start, 0]), [BLOCK_N, BLOCK_D]))
        v = tl.reshape(v_desc.load([n, kv_head, start, 0]), [BLOCK_N, BLOCK_DV])
    else:
        kt = tl.load(kt_ptrs, mask=d_inside[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=dv_inside[None, :], other=0.0)
    if RAW:
        s = c.dot(q, kt, IEEE)
    else:
        s, _ = c.scores(c.dot(q, kt, IEEE), rows[:, None], keys[None, :], scale, softcap, slope, k_minus_q,
                        SOFTCAP, HAS_ALIBI)
    if MASKED:
        s = tl.where(attend, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row with nothing attended yet keeps max -inf: shift by 0 instead (exp(-inf - -inf) is NaN)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    if RAW:
        alpha = tl.exp2((m_i - shift) * exp_scale)
        p = tl.exp2((s - shift[:, None]) * exp_scale)
    else:
        alpha = c.exp_shifted(m_i, shift)
        p = c.exp_shifted(s, shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)  # the lse is before dropout
    if DROPOUT:
        p = c.dropped(p, c.keep(seed_ptr, drop_a[:, None], drop_c[:, None], keys[None, :]), 1.0)
    acc = acc * alpha[:, None] + c.dot(p.to(v.dtype), v, IEEE)
    return acc, m_new, l_i


@triton.jit
def _forward_kernel(Q, K, V, Out, Lse, Lo, Hi, Slopes, Seed, Gate, KDesc, VDesc,
                    stride_qn, stride_qh, stride_qm, stride_qd,
                    stride_kn, stride_kh, stride_km, stride_kd,
                    stride_vn, stride_vh, stride_vm, stride_vd,
                    stride_on, stride_oh, stride_om, stride_od,
                    stride_ls, stride_lr, stride_sn, stride_sh,
                    heads, heads_per_kv, q_len, k_len, head_dim, v_dim,
                    scale, softcap, drop_scale,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_DV: tl.constexpr, RANGES: tl.constexpr, SOFTCAP: tl.constexpr,
                    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, IEEE: tl.constexpr,
                    SECOND_PASS: tl.constexpr, GATED: tl.constexpr, RAW: tl.constexpr, TMA: tl.constexpr):
    """Grid ``(cdiv(Lq, BLOCK_M), N * H)``: output and lse of one query block of one head. ``GATED``
    (with ``SECOND_PASS``): the redo launch, whose program writes nothing unless ``Gate`` says the
    values hold a NaN or inf and its own partly attended blocks do. ``RAW``: the rows' max in raw
    products (:func:`_visit`). ``TMA``: key and value tiles through the descriptors ``KDesc, VDesc``
    (``None`` otherwise)."""
    if GATED:
        if tl.load(Gate) == 0:
            return
    pid_nh, n, h, n64, rows, valid, k_base, v_base, slope, drop_a, drop_c = c.query_block(
        K, V, Slopes, Seed, stride_kn, stride_kh, stride_vn, stride_vh, stride_sn, stride_sh,
        heads, heads_per_kv, q_len, BLOCK_M, HAS_ALIBI, DROPOUT)
    if GATED:
        if not non_finite.in_partial_blocks(v_base, rows, valid, Lo + n * stride_ls, Hi + n * stride_ls, stride_lr,
                                            stride_vm, stride_vd, q_len, k_len, v_dim, BLOCK_N, BLOCK_DV, RANGES):
            return
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_base = Q + n64 * stride_qn + h.to(tl.int64) * stride_qh
    q = tl.load(q_base + rows.to(tl.int64)[:, None] * stride_qm + d[None, :] * stride_qd,
                mask=valid[:, None] & (d[None, :] < head_dim), other=0.0)
    k_minus_q = k_len - q_len

    kt_offsets = c.tile_offsets(stride_km, stride_kd, BLOCK_N, BLOCK_D, True)
    v_offsets = c.tile_offsets(stride_vm, stride_vd, BLOCK_N, BLOCK_DV, False)
    d_inside, dv_inside = d < head_dim, dv < v_dim
    exp_scale = scale * c.LOG2E
    kv_head = h // heads_per_kv
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for r in tl.static_range(RANGES):
        lo, hi = c.load_bounds(Lo + n * stride_ls + r * stride_lr, Hi + n * stride_ls + r * stride_lr,
                               rows, q_len, k_len)
        first, last = c.key_hull(lo, hi, k_len)
        start, full_lo, full_hi, end = c.key_span(first, last, lo, hi, valid, k_len, BLOCK_N)
        # The partly attended blocks before and after the whole ones in one masked loop (its index jumps
        # over them), then the whole ones. With a loop for each of the three runs and the tiles moved by
        # offsets, ptxas serialised every wgmma of the kernel (each waiting for the one before; its
        # warning C7515) in every tile configuration; tests/test_triton_compiles.py checks it does not.
        skip = full_hi - full_lo
        for edge in range(start, end - skip, BLOCK_N):
            block = edge + skip * (edge >= full_lo).to(tl.int32)
            acc, m_i, l_i = _visit(acc, m_i, l_i, q, k_base, v_base, kt_offsets, v_offsets, d_inside, dv_inside,
                                   block, rows, lo, hi, first, last, drop_a, drop_c, Seed, stride_km, stride_vm,
                                   k_len, KDesc, VDesc, n, kv_head,
                                   scale, exp_scale, softcap, slope, k_minus_q, BLOCK_N, BLOCK_D, BLOCK_DV, True,
                                   RAW, SOFTCAP, HAS_ALIBI, DROPOUT, IEEE, TMA)
        for block in range(full_lo, full_hi, BLOCK_N):
            acc, m_i, l_i = _visit(acc, m_i, l_i, q, k_base, v_base, kt_offsets, v_offsets, d_inside, dv_inside,
                                   block, rows, lo, hi, first, last, drop_a, drop_c, Seed, stride_km, stride_vm,
                                   k_len, KDesc, VDesc, n, kv_head,
                                   scale, exp_scale, softcap, slope, k_minus_q, BLOCK_N, BLOCK_D, BLOCK_DV, False,
                                   RAW, SOFTCAP, HAS_ALIBI, DROPOUT, IEEE, TMA)

    if RAW:  # the max in natural units, fl(max(qk) * scale), as the backward's scores round theirs
        m_raw = m_i
        m_i = c.rounded_product(m_raw, scale)
        # Where that overflows, so did the scores in natural units, and the definition's row is NaN (the
        # max +inf, and +inf - +inf) or weighs every key 0 (all -inf: zeros, but 0 x a NaN or inf value).
        l_i = tl.where(m_i == float("inf"), float("nan"), l_i)
        no_weight = (m_i == float("-inf")) & (m_raw > float("-inf"))
        l_i = tl.where(no_weight, 0.0, l_i)
        acc = tl.where(no_weight[:, None], acc * 0.0, acc)
    if SECOND_PASS and non_finite.in_partial_blocks(v_base, rows, valid, Lo + n * stride_ls, Hi + n * stride_ls,
                                                    stride_lr, stride_vm, stride_vd, q_len, k_len, v_dim,
                                                    BLOCK_N, BLOCK_DV, RANGES):
        acc = non_finite.values_again(m_i, q, k_base, v_base, rows, valid, Lo + n * stride_ls,
                                      Hi + n * stride_ls, stride_lr, drop_a, drop_c, Seed,
                                      stride_km, stride_kd, stride_vm, stride_vd, q_len, k_len, head_dim, v_dim,
                                      scale, softcap, slope, k_minus_q, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
                                      RANGES, SOFTCAP, HAS_ALIBI, DROPOUT)

    # no key (sum 0): zeros and lse -inf; a NaN sum stays NaN
    empty = l_i == 0.0
    total = tl.where(empty, 1.0, l_i)
    out = acc / total[:, None]
    if DROPOUT:
        out = out * drop_scale
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(total) * c.LN2)
    out_base = Out + n64 * stride_on + h.to(tl.int64) * stride_oh
    tl.store(out_base + rows.to(tl.int64)[:, None] * stride_om + dv[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=valid[:, None] & (dv[None, :] < v_dim))
    tl.store(Lse + pid_nh.to(tl.int64) * q_len + rows, lse, mask=valid)


#: How the forward loads its key and value tiles: by per-thread addresses (``"pointers"``, the
#: default, measured), or through Hopper's tensor memory accelerator (``"tma"``: one bulk copy a tile
#: from a host-made descriptor, :func:`tma_descriptors`; unmeasured on a GPU yet, timed by
#: ``benchmarks/triton_blocks.py``).
LOADS = ("pointers", "tma")


def tma_descriptors(prep: Prepared, block_n: int) -> tuple[TensorDescriptor, TensorDescriptor] | None:
    """Descriptors of ``key`` and ``value`` for tiles of ``block_n`` keys and the padded widths
    (:func:`.inputs.tile_descriptor`), or ``None`` where either layout rules the copy engine out."""
    k_desc = tile_descriptor(prep.key, block_n, prep.block_d)
    v_desc = tile_descriptor(prep.value, block_n, prep.block_dv)
    return None if k_desc is None or v_desc is None else (k_desc, v_desc)


def launch(prep: Prepared, block_m: int, block_n: int, num_warps: int, num_stages: int, *,
           second_pass: str = "gated", loads: str = "pointers") -> tuple[Tensor, Tensor]:
    """Run the forward on prepared inputs: ``(out [N, H, Lq, Dv] in the input dtype, lse [N, H, Lq]
    float32)``. ``second_pass``: :mod:`.non_finite`'s pass as ``"gated"``, the default (a second
    launch whose programs return at once unless ``value`` holds a NaN or inf), ``"inline"``
    (compiled into the kernel: the same bits, but more registers, which spill at the default tiles;
    on an H100 the inline forward took 1.08-1.30x the gated one's time, docs/performance.md), or
    ``"off"`` (a masked-out NaN or inf value then leaks through: only for
    ``benchmarks/triton_blocks.py`` to time what the pass costs). ``loads``: one of :data:`LOADS`;
    ``"tma"`` falls back to pointers where :func:`tma_descriptors` finds the layout unfit (same bits
    either way)."""
    if second_pass not in ("inline", "gated", "off"):
        raise ValueError(f"second_pass must be 'inline', 'gated' or 'off', got {second_pass!r}")
    if loads not in LOADS:
        raise ValueError(f"loads must be one of {LOADS}, got {loads!r}")
    query, key, value = prep.query, prep.key, prep.value
    n, heads, q_len, head_dim = query.shape
    k_len, v_dim = key.shape[2], value.shape[3]
    out = torch.empty((n, heads, q_len, v_dim), dtype=query.dtype, device=query.device)
    lse = torch.empty((n, heads, q_len), dtype=torch.float32, device=query.device)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    grid = (triton.cdiv(q_len, block_m), n * heads)
    raw = not (prep.has_softcap or prep.has_alibi) and prep.scale > 0.0
    descriptors = tma_descriptors(prep, block_n) if loads == "tma" else None
    k_desc, v_desc = descriptors or (None, None)

    def run(gate: Tensor, pass_compiled: bool, gated: bool) -> None:
        _forward_kernel[grid](
            query, key, value, out, lse, prep.lo, prep.hi, prep.slopes, prep.seed, gate, k_desc, v_desc,
            *query.stride(), *key.stride(), *value.stride(), *out.stride(),
            prep.stride_ls, prep.stride_lr, prep.stride_sn, prep.stride_sh,
            heads, prep.heads_per_kv, q_len, k_len, head_dim, v_dim,
            prep.scale, prep.softcap, prep.drop_scale,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=prep.block_d, BLOCK_DV=prep.block_dv, RANGES=prep.ranges,
            SOFTCAP=prep.has_softcap, HAS_ALIBI=prep.has_alibi, DROPOUT=prep.has_dropout, IEEE=prep.ieee,
            SECOND_PASS=pass_compiled, GATED=gated, RAW=raw, TMA=descriptors is not None, num_warps=num_warps,
            num_stages=num_stages)

    run(lse, second_pass == "inline", False)  # lse: a pointer the ungated kernel never reads
    if second_pass == "gated" and value.numel() > 0:
        run(_holds_non_finite(value), True, True)
    return out, lse


def _holds_non_finite(value: Tensor) -> Tensor:
    """An int32 scalar on the device: 1 where ``value`` holds a NaN or inf (its min or max is not
    finite; both propagate NaN), else 0. No host sync."""
    smallest, largest = torch.aminmax(value)
    return (~(torch.isfinite(smallest) & torch.isfinite(largest))).to(torch.int32)
