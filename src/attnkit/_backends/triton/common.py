"""The jitted pieces every kernel of this package shares: scores, masks and the dropout hash.

The forward and both backward kernels must agree to the bit on which pairs a row attends, what
each score is and which weights dropout keeps, or the gradients would belong to another function.
So each of those is written once, here, as element-wise functions of broadcastable tensors: the
forward and the dQ kernel call them on ``[BLOCK_M, BLOCK_N]`` tiles (rows down), the dK/dV kernel
on ``[BLOCK_N, BLOCK_M]`` tiles (keys down); the caller shapes ``rows`` and ``keys`` to match.

Scores and the lse stay in natural units, as the definition computes them (the forward's rows' max,
where no score modifier is set, in raw products: ``forward._visit``); the softmax runs on
``exp2``, the cheap instruction, of ``(s - max) * log2(e)``: multiplying after the subtraction costs
the same one multiply as converting the scores first, and a finite score above float32's largest
value over log2(e) (~2.4e38) then stays finite instead of overflowing into a NaN row.

A score is one rounded product, ``fl(qk * scale)``, as the definition's: :func:`rounded_product`.
Left to itself, the compiler fuses that product into the subtraction that follows (one FFMA:
``qk * scale - max`` rounded once), so the row's own maximum came out as the product's rounding
error instead of 0: a weight of ``exp(r)`` with ``r`` up to half a unit in the last place of the
score (ptxas's FFMA, seen in the forward's and dQ's SASS). That is as large as the score's own
rounding, but the definition's row maximum weighs exactly 1: here it weighed up to ``e`` from a
score of ~1.7e7 and ``inf`` (a NaN row from finite inputs) from ~2.1e9.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["LOG2E", "LN2", "INTERPRETED", "rounded_product", "fmix32", "mix", "row_hash", "keep", "dropped",
           "scores", "alibi_slope", "in_range", "dot", "load_bounds", "key_hull", "key_span", "tile_offsets",
           "exp_shifted", "row_stats"]

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
#: Whether the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, which triton reads when
#: it decorates them, at import): it runs them on numpy, which fuses nothing and calls no libdevice.
INTERPRETED: tl.constexpr = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def rounded_product(a, b):
    """``a * b`` rounded to float32 on its own (PTX ``mul.rn``), which the compiler never fuses into
    an add that follows, as it does a plain ``*`` (see the module's docstring)."""
    if INTERPRETED:
        return a * b
    else:
        return libdevice.mul_rn(a, b)


# -- dropout: attnkit's counter-based hash (attnkit._backends.dropout), in uint32 arithmetic ---------

@triton.jit
def fmix32(x):
    """MurmurHash3's finaliser on uint32 (products wrap modulo 2**32, shifts are logical)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def mix(x, v):
    """``fmix32(x ^ fmix32(v + 0x9E3779B9))``, both uint32."""
    return fmix32(x ^ fmix32(v + 0x9E3779B9))


@triton.jit
def row_hash(seed_ptr, n, h, rows):
    """Per-row dropout words ``(a, c)`` (uint32, shaped like ``rows``) for batch ``n``, query head
    ``h`` and query ``rows``; ``seed_ptr`` holds int64 ``[seed, h0, i0, j0, threshold]`` (the
    offsets place a piece of a larger call inside it)."""
    seed = tl.load(seed_ptr)
    head = (tl.load(seed_ptr + 1) + h).to(tl.uint32)
    row = (tl.load(seed_ptr + 2) + rows.to(tl.int64)).to(tl.uint32)
    batch = n.to(tl.uint32)
    a = mix(mix(mix(seed.to(tl.uint32), batch), head), row)     # truncation keeps the low 32 bits
    c = mix(mix(mix((seed >> 32).to(tl.uint32), batch), head), row)
    return a, c


@triton.jit
def keep(seed_ptr, a, c, keys):
    """Whether each weight is kept: ``a, c`` from :func:`row_hash` broadcast against ``keys``."""
    key = (tl.load(seed_ptr + 3) + keys.to(tl.int64)).to(tl.uint32)
    bits = fmix32(fmix32(key ^ a) ^ c)
    return bits >= tl.load(seed_ptr + 4).to(tl.uint32)


@triton.jit
def dropped(x, kept, factor):
    """``x`` times ``factor`` where ``kept``, times 0 elsewhere: multiplied, as the definition's
    ``weights * keep / (1 - p)`` is, so that a NaN weight stays NaN when dropped (``tl.where``
    would hide it)."""
    return x * tl.where(kept, factor, 0.0)


# -- scores -----------------------------------------------------------------------------------

@triton.jit
def _tanh(x):
    """tanh (tl has no portable one): its Taylor series to x^11 below |x| = 0.25, where 1 - exp(-2|x|)
    cancels (a cap far above the scores would lose them: eps / |x| of relative error), else from exp
    of a non-positive number (no overflow). NaN stays NaN. The native kernel's tanh_via_exp."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(x < 0, -t, t)
    x2 = x * x
    p = (-1382.0 / 155925.0) * x2 + 62.0 / 2835.0
    p = p * x2 - 17.0 / 315.0
    p = p * x2 + 2.0 / 15.0
    p = p * x2 - 1.0 / 3.0
    return tl.where(tl.abs(x) < 0.25, x + x * x2 * p, t)


@triton.jit
def query_block(K, V, Slopes, Seed, stride_kn, stride_kh, stride_vn, stride_vh, stride_sn, stride_sh,
                heads, heads_per_kv, q_len, BLOCK_M: tl.constexpr, HAS_ALIBI: tl.constexpr,
                DROPOUT: tl.constexpr):
    """What a program of grid ``(cdiv(Lq, BLOCK_M), N * H)`` owns (the forward's and dQ's): its
    ``(n, h)`` (``pid_nh = n * H + h``), query ``rows`` and which are ``valid``, its key/value head's
    bases (GQA: head ``h // heads_per_kv``), its ALiBi slope and its rows' dropout words."""
    pid_nh = tl.program_id(1)
    n = pid_nh // heads
    h = pid_nh % heads
    n64 = n.to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = rows < q_len
    k_base = K + n64 * stride_kn + (h // heads_per_kv).to(tl.int64) * stride_kh
    v_base = V + n64 * stride_vn + (h // heads_per_kv).to(tl.int64) * stride_vh
    slope = alibi_slope(Slopes, n, h, stride_sn, stride_sh, HAS_ALIBI)
    drop_a = rows.to(tl.uint32)
    drop_c = drop_a
    if DROPOUT:
        drop_a, drop_c = row_hash(Seed, n, h, rows)
    return pid_nh, n, h, n64, rows, valid, k_base, v_base, slope, drop_a, drop_c


@triton.jit
def alibi_slope(slopes_ptr, n, h, stride_sn, stride_sh, HAS_ALIBI: tl.constexpr):
    """The ALiBi slope of head ``(n, h)`` (0.0 without ALiBi)."""
    if HAS_ALIBI:
        return tl.load(slopes_ptr + n * stride_sn + h * stride_sh).to(tl.float32)
    else:
        return 0.0


@triton.jit
def scores(qk, rows, keys, scale, softcap, slope, k_minus_q,
           SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """``(s, t)``: the scores of the fp32 products ``qk`` (natural units), and ``tanh(scale * qk /
    softcap)`` for the soft-capping derivative (``qk`` itself without soft-capping; unused then).
    ``rows, keys`` (int32, broadcast against ``qk``) place ALiBi: the query sits at key position
    ``row + k_minus_q``."""
    if SOFTCAP:
        t = _tanh(qk * (scale / softcap))
        s = rounded_product(t, softcap)
    else:
        t = qk
        s = rounded_product(qk, scale)
    if HAS_ALIBI:
        s = s - slope * tl.abs(rows + k_minus_q - keys).to(tl.float32)
    return s, t


@triton.jit
def exp_shifted(s, shift):
    """``exp(s - shift)`` through ``exp2``."""
    return tl.exp2((s - shift) * LOG2E)


@triton.jit
def row_stats(RowLse, Delta, rows, q_len):
    """The rows' lse as the delta kernel wrote it (``+inf`` for rows of no key), ``+inf`` past
    ``q_len`` too, so that their weights come out 0 wherever they are computed, and their delta."""
    lse = tl.load(RowLse + rows, mask=rows < q_len, other=float("inf"))
    return lse, tl.load(Delta + rows, mask=rows < q_len, other=0.0)


# -- masks ------------------------------------------------------------------------------------

@triton.jit
def load_bounds(lo_ptr, hi_ptr, rows, q_len, k_len):
    """One range's ``lo, hi`` (int32) for ``rows``; rows past ``q_len`` read as empty."""
    inside = rows < q_len
    lo = tl.load(lo_ptr + rows, mask=inside, other=k_len)
    hi = tl.load(hi_ptr + rows, mask=inside, other=0)
    return lo, hi


@triton.jit
def in_range(lo, hi, keys):
    """Whether each key lies in its row's ``[lo, hi)`` (the caller broadcasts rows against keys)."""
    return (keys >= lo) & (keys < hi)


@triton.jit
def key_hull(lo, hi, k_len):
    """``(first, last)``: the keys a block of rows may reach for one range lie in ``[first, last)``,
    the smallest ``lo`` and largest ``hi`` of its non-empty rows (``k_len, 0`` when all are empty).
    The kernels load the values of a partly attended block's keys inside it: per block a compare
    against two scalars, where the exact union of the rows' ranges took a reduction across the
    block's rows (the forward's partial blocks: 784 SASS instructions a block per warp against 623,
    bf16, D = 128, 64 x 64 tiles). The keys it adds, in a gap between rows' ranges, meet no row: a
    NaN or inf value there is the forward's second pass's to keep out (:mod:`.non_finite`)."""
    nonempty = lo < hi
    return tl.min(tl.where(nonempty, lo, k_len), 0), tl.max(tl.where(nonempty, hi, 0), 0)


@triton.jit
def key_span(first, last, lo, hi, valid, k_len, BLOCK_N: tl.constexpr):
    """The key blocks a block of rows visits for one range, as block-aligned bounds ``start <=
    full_lo <= full_hi <= end``: ``[full_lo, full_hi)`` holds the blocks every ``valid`` row attends
    whole (no mask needed), ``[start, full_lo)`` and ``[full_hi, end)`` the partly attended ones,
    and nothing outside ``[start, end)`` is attended by any row. ``first, last``: the rows'
    :func:`key_hull`, which the callers keep for their masks too."""
    start = (first // BLOCK_N) * BLOCK_N
    end = tl.cdiv(last, BLOCK_N) * BLOCK_N
    # full blocks lie inside every row's range: after the largest lo, before the smallest hi
    full_lo = tl.maximum(tl.cdiv(tl.max(tl.where(valid, lo, 0), 0), BLOCK_N) * BLOCK_N, start)
    full_hi = tl.minimum((tl.min(tl.where(valid, hi, k_len), 0) // BLOCK_N) * BLOCK_N, end)
    none = full_hi <= full_lo
    return start, tl.where(none, end, full_lo), tl.where(none, end, full_hi), end


@triton.jit
def tile_offsets(stride_m, stride_d, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The int32 offsets of a block of ``BLOCK_N`` key rows' tile from its first row (``[BLOCK_D,
    BLOCK_N]``, features down, if ``TRANSPOSED``, else ``[BLOCK_N, BLOCK_D]``; a block spans far less
    than 2^31 elements). Computed once per program, so that a loop moves its tiles by one scalar
    offset a block: recomputing 64-bit addresses per element cost ptxas about 100 integer
    instructions a block in the forward (bf16, D = 128, 64 x 64 tiles)."""
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    if TRANSPOSED:
        return d[:, None] * stride_d + n[None, :] * stride_m
    else:
        return n[:, None] * stride_m + d[None, :] * stride_d


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """``a @ b`` accumulated in fp32; with ``IEEE`` (float32 inputs) in full fp32 rather than TF32."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)
