"""attnkit's own GPU kernel for interval masks, in Triton (FlashAttention-2 style).

The masks of :mod:`attnkit.masks` give every query row one or two key intervals ``[lo, hi)``;
PyTorch's fused kernels only know dense masks or plain causal, so on a GPU they either compute
every block or need an ``Lq x Lk`` mask. These kernels read the intervals directly: each block of
queries visits only the key blocks its rows reach, and masks only those it attends in part
(:mod:`.forward`, :mod:`.backward`); a NaN or inf value that a partly attended block would carry
into rows that do not attend it is handled inside the forward (:mod:`.non_finite`), so its output
needs no check. The shared pieces (scores, masks, the dropout hash that draws
attnkit's one pattern bit for bit) live in :mod:`.common`, the host-side checks in :mod:`.inputs`.

Layout as :mod:`attnkit._backends.interval_op`: ``query [N, H, Lq, D]``, ``key/value [N, Hkv, Lk,
D/Dv]`` (any strides, ``H % Hkv == 0``), ``lo, hi [S, R, Lq]`` (S = 1 or N, R = 1 or 2 disjoint
ranges a row). Scores are ``scale * q.k`` (fp32 accumulation; IEEE fp32 products for float32
inputs, not TF32), soft-capped, minus ALiBi ``slope * |i + Lk - Lq - j|``, then masked; ``lse`` is
float32 natural log before dropout, ``-inf`` for a row of no key, whose output and gradients are 0.

Importing this package imports Triton; attnkit itself never does (Triton is optional). The
kernels also run under Triton's interpreter (``TRITON_INTERPRET=1`` set before this import) on
CPU tensors, which is how the tests check them without a GPU.
"""

from __future__ import annotations

try:
    import triton  # noqa: F401  (absolute import: the package, not this module)
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("attnkit._backends.triton needs the optional `triton` package (pip install triton); "
                      "the rest of attnkit works without it") from error

import torch
from torch import Tensor

from . import backward as _backward
from . import forward as _forward
from .inputs import prepare

__all__ = ["forward", "backward", "forward_blocks", "backward_blocks"]


def forward_blocks(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """Default ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of the forward for H100-class GPUs.
    Half precision at head dims 65-128: the fastest of eight configurations measured on an H100
    (``benchmarks/triton_blocks.py``, bf16, L = 32768, H = 16, D = 128: 0.91 ms for a 1024 window,
    1.67 ms for 8 causal documents, against 1.20 / 2.12 ms for the 128 x 32 x 8 warps chosen
    before; docs/performance.md). Other sizes were chosen so that ptxas (sm_90a) compiles the plain
    kernels, specialised as a launch is, without spilling registers (``benchmarks/triton_spills.py``),
    not by timing. Float32 runs its products in IEEE fp32 on
    the FMA units (no tensor cores), whose unrolled tiles need far smaller blocks."""
    if dtype == torch.float32:
        return (32, 32, 4, 3) if head_dim <= 64 else (32, 16, 8, 2) if head_dim <= 128 else (16, 16, 8, 1)
    if head_dim <= 64:
        return 128, 64, 8, 3
    if head_dim <= 128:
        return 64, 64, 4, 3
    return 64, 32, 8, 2


def backward_blocks(head_dim: int, dtype: torch.dtype) -> tuple[tuple[int, int, int, int], int, int]:
    """Default ``((dK/dV BLOCK_M, BLOCK_N, dQ BLOCK_M, BLOCK_N), num_warps, num_stages)``: the
    kernel that owns a block keeps it large, the one it walks small (two fp32 accumulators). Half
    precision at head dims 65-128: the fastest of six measured on an H100 (same run as
    :func:`forward_blocks`: 6.0 / 8.2 ms against 18.3 / 29.1 ms before); the rest unmeasured, chosen
    as :func:`forward_blocks`' other sizes are. Above 128, two stages: with one, the dQ kernel spilled
    (24 bytes of stores) and no loop was pipelined."""
    if dtype == torch.float32:
        return ((16, 32, 32, 16), 4, 1) if head_dim <= 64 else ((16, 16, 16, 16), 8, 1)
    if head_dim <= 64:
        return (32, 128, 128, 32), 8, 3
    if head_dim <= 128:
        return (64, 128, 128, 64), 8, 2
    return (16, 32, 32, 16), 8, 2


def _check_block(size: int) -> int:
    if size < 16 or size & (size - 1):
        raise ValueError(f"block sizes must be powers of two, at least 16 (tl.dot), got {size}")
    return size


def forward(query: Tensor, key: Tensor, value: Tensor, lo: Tensor, hi: Tensor, *, scale: float,
            softcap: float | None = None, alibi_slopes: Tensor | None = None, dropout: float = 0.0,
            seed: Tensor | None = None, block_m: int | None = None,
            block_n: int | None = None) -> tuple[Tensor, Tensor]:
    """Interval attention: ``(out [N, H, Lq, Dv] in the input dtype, lse [N, H, Lq] float32)``, both
    contiguous.

    ``lo, hi`` int ``[S, R, Lq]``: row ``i`` of sequence ``n`` attends keys ``lo[s, r, i] <= j <
    hi[s, r, i]`` (``s = n`` when S = N, else 0). ``alibi_slopes`` float ``[H]`` or ``[N, H]``.
    ``dropout`` drops weights with :mod:`attnkit._backends.dropout`'s pattern for ``seed`` (an int64
    scalar tensor, or ``[seed, h0, i0, j0]``). ``block_m, block_n`` override the tile sizes."""
    prep = prepare(query, key, value, lo, hi, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
                   dropout=dropout, seed=seed)
    default_m, default_n, warps, stages = forward_blocks(max(query.shape[3], value.shape[3]), query.dtype)
    return _forward.launch(prep, _check_block(block_m or default_m), _check_block(block_n or default_n),
                           warps, stages)


def backward(grad_out: Tensor, grad_lse: Tensor | None, query: Tensor, key: Tensor, value: Tensor,
             out: Tensor, lse: Tensor, lo: Tensor, hi: Tensor, *, scale: float, softcap: float | None = None,
             alibi_slopes: Tensor | None = None, dropout: float = 0.0, seed: Tensor | None = None,
             blocks: tuple[int, int, int, int] | None = None, walk: str = "checked") -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`forward` (same arguments; contiguous, in the inputs'
    dtype), given ``grad_out [N, H, Lq, Dv]``, optionally ``grad_lse [N, H, Lq]``, and the forward's
    ``out`` and ``lse``. ``blocks`` overrides ``(dK/dV BLOCK_M, BLOCK_N, dQ BLOCK_M, BLOCK_N)``;
    ``walk`` how the dK/dV kernel walks the query blocks (:data:`.backward.WALKS`)."""
    prep = prepare(query, key, value, lo, hi, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
                   dropout=dropout, seed=seed)
    if grad_out.shape != out.shape or out.shape != (*query.shape[:3], value.shape[3]):
        raise ValueError(f"grad_out {tuple(grad_out.shape)} and out {tuple(out.shape)} must be "
                         f"[N, H, Lq, Dv] = {(*query.shape[:3], value.shape[3])}")
    default, warps, stages = backward_blocks(max(query.shape[3], value.shape[3]), query.dtype)
    sizes = tuple(_check_block(size) for size in (blocks or default))
    # the products pair dO with V and P: one dtype (a float32 gradient of half inputs is rounded)
    return _backward.launch(prep, grad_out.to(query.dtype), grad_lse, out, lse, sizes, warps, stages, walk)
