"""Checking a call and putting it into the form the kernels read, on the host side.

The kernels take raw pointers, strides and a few flags; everything that has to agree between the
forward and the backward (the int32 bounds, the seed words, the dropout threshold, the padded head
widths) is decided once here, in :func:`prepare`, so that both halves read the same numbers. Only
torch ops run: nothing waits on the device (the seed stays a tensor and is read by the kernels).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
from torch import Tensor

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton before 3.3 makes no descriptors on the host: pointers serve
    TensorDescriptor = None

from ... import _torch_private
from .. import dropout as _dropout
from ..transfer import to_device

__all__ = ["Prepared", "prepare", "block_summary", "reached_blocks", "derived_from", "remembered",
           "tile_descriptor"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: The kernels place a key block's tiles by int32 offsets from its first row (common.tile_offsets):
#: key and value rows or features this far apart (far beyond any layout models use) are copied
#: contiguous first, so that blocks of up to 1024 rows and features stay within 2^31 elements.
ROW_STRIDE_LIMIT = 2**31 // 1024


@dataclass(frozen=True)
class Prepared:
    """A checked call: inputs as given (any strides), bounds ``lo, hi`` int32 ``[S, R, Lq]``
    clipped to ``[0, Lk]``, ``seed`` int64 ``[seed, h0, i0, j0, threshold]`` and the kernels' flags."""

    query: Tensor
    key: Tensor
    value: Tensor
    lo: Tensor
    hi: Tensor
    stride_ls: int  # 0 when one set of bounds serves every sequence
    stride_lr: int
    slopes: Tensor
    stride_sn: int
    stride_sh: int
    seed: Tensor
    heads_per_kv: int
    scale: float
    softcap: float
    drop_scale: float
    block_d: int
    block_dv: int
    ranges: int
    has_softcap: bool
    has_alibi: bool
    has_dropout: bool
    ieee: bool


#: What follows from one pair of bound tensors alone (their int32 copies, the backward's block
#: summaries), per pair: ``(id(lo), id(hi)) -> (weak lo, weak hi, their versions, {what: value})``.
_DERIVED: OrderedDict[tuple[int, int], tuple] = OrderedDict()
_DERIVED_LIMIT = 32


def derived_from(lo: Tensor, hi: Tensor) -> dict | None:
    """A dict for what is computed from ``lo, hi`` alone, kept while these very tensors (not copies,
    not modified in place) come back: the tiled backend keeps one pair per mask object, so a model's
    layers and a training loop's steps pass the same pair, and each call would otherwise launch the
    same dozen small kernels again (a Triton call's host time on an H100 was 0.54 ms, 0.07 of it the
    kernel's own launch). None while tracing or under ``torch.func`` (the tensors carry no values),
    and for inference tensors (``torch.inference_mode``), which keep no version to tell an in-place
    change by."""
    if (torch.compiler.is_compiling() or _torch_private.functorch_active()
            or _torch_private.without_values(lo) or _torch_private.without_values(hi)
            or lo.is_inference() or hi.is_inference()):
        return None
    key = (id(lo), id(hi))
    entry = _DERIVED.get(key)
    if entry is not None:
        lo_ref, hi_ref, versions, values = entry
        if lo_ref() is lo and hi_ref() is hi and versions == (lo._version, hi._version):
            _DERIVED.move_to_end(key)
            return values
    values: dict = {}
    _DERIVED[key] = (weakref.ref(lo), weakref.ref(hi), (lo._version, hi._version), values)
    while len(_DERIVED) > _DERIVED_LIMIT:
        _DERIVED.popitem(last=False)
    return values


def remembered(values: dict | None, what: tuple, build):
    """``values[what]``, built by ``build()`` the first time (every time when ``values`` is None)."""
    if values is None:
        return build()
    if what not in values:
        values[what] = build()
    return values[what]


@functools.lru_cache(maxsize=16)
def _constant(kind: str, device: torch.device) -> Tensor:
    """Tensors the kernels read and nothing writes, the same for every call on ``device``: the
    seed words without dropout, the ALiBi slopes without ALiBi."""
    if kind == "no seed":
        return torch.zeros(5, dtype=torch.int64, device=device)  # threshold 0: dropout 0 keeps every weight
    return torch.zeros(1, dtype=torch.float32, device=device)


def _width(size: int) -> int:
    """A head width padded for ``tl.dot``: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(size))


def _seed_words(seed: Tensor | None, dropout: float, device: torch.device) -> Tensor:
    """``[seed, h0, i0, j0, threshold]`` (int64, on ``device``) without reading the seed on the host."""
    if seed is None and _dropout.threshold(dropout) == 0 and not torch.compiler.is_compiling():
        return _constant("no seed", torch.device(device))
    threshold = to_device(torch.tensor([_dropout.threshold(dropout)], dtype=torch.int64), device)
    if seed is None:
        return torch.cat([torch.zeros(4, dtype=torch.int64, device=device), threshold])
    seed = to_device(seed.to(torch.int64), device)
    if seed.dim() == 0:
        seed = torch.cat([seed[None], torch.zeros(3, dtype=torch.int64, device=device)])
    elif seed.shape != (4,):
        raise ValueError(f"seed must be an int64 scalar or [seed, h0, i0, j0], got shape {tuple(seed.shape)}")
    return torch.cat([seed, threshold])


def prepare(query: Tensor, key: Tensor, value: Tensor, lo: Tensor, hi: Tensor, *, scale: float,
            softcap: float | None, alibi_slopes: Tensor | None, dropout: float, seed: Tensor | None) -> Prepared:
    """Check the call (shapes, dtypes, devices) and build what the kernels read."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("query, key and value must be [N, H, L, D] (key and value [N, Hkv, Lk, D / Dv])")
    n, heads, q_len, head_dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    if key.shape[0] != n or key.shape[3] != head_dim or value.shape[:3] != key.shape[:3]:
        raise ValueError(f"shapes do not fit: query {tuple(query.shape)}, key {tuple(key.shape)}, "
                         f"value {tuple(value.shape)}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    if query.dtype not in _DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"query, key and value must share one of {_DTYPES}, got "
                        f"{query.dtype}, {key.dtype}, {value.dtype}")
    if not 0.0 <= dropout <= 1.0:
        raise ValueError(f"dropout must lie in [0, 1], got {dropout}")
    if dropout > 0.0 and seed is None:
        raise ValueError("dropout needs a seed (attnkit._backends.dropout.draw_seed)")
    if softcap is not None and not softcap > 0.0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    device = query.device
    if lo.dim() != 3 or lo.shape != hi.shape or lo.shape[0] not in (1, n) or lo.shape[1] not in (1, 2) \
            or lo.shape[2] != q_len:
        raise ValueError(f"lo, hi must be [S, R, Lq] with S in (1, {n}), R in (1, 2), Lq = {q_len}; "
                         f"got {tuple(lo.shape)} and {tuple(hi.shape)}")
    # int32 in the kernels: clipping to [0, Lk] keeps every bound in range, and empty ranges empty
    lo32, hi32 = remembered(derived_from(lo, hi), ("int32", k_len, device), lambda: tuple(
        to_device(t, device).clamp(0, k_len).to(torch.int32).contiguous() for t in (lo, hi)))
    if alibi_slopes is None:
        slopes = torch.zeros(1, dtype=torch.float32, device=device) if torch.compiler.is_compiling() \
            else _constant("no slopes", torch.device(device))
        stride_sn, stride_sh = 0, 0
    else:
        slopes = to_device(alibi_slopes.to(torch.float32), device)
        if slopes.shape == (heads,):
            stride_sn, stride_sh = 0, slopes.stride(0)
        elif slopes.shape == (n, heads):
            stride_sn, stride_sh = slopes.stride()
        else:
            raise ValueError(f"alibi_slopes must be [H] or [N, H] = [{n}, {heads}], got {tuple(slopes.shape)}")
    has_dropout = dropout > 0.0
    key, value = (t.contiguous() if max(t.stride(2), t.stride(3)) >= ROW_STRIDE_LIMIT else t for t in (key, value))
    return Prepared(
        query=query, key=key, value=value, lo=lo32, hi=hi32,
        stride_ls=lo32.stride(0) if lo32.shape[0] > 1 else 0, stride_lr=lo32.stride(1),
        slopes=slopes, stride_sn=stride_sn, stride_sh=stride_sh,
        seed=_seed_words(seed if has_dropout else None, dropout, device),
        heads_per_kv=heads // kv_heads, scale=float(scale), softcap=float(softcap or 1.0),
        # p = 1 drops everything: zeros rather than 0 * inf
        drop_scale=1.0 / (1.0 - dropout) if dropout < 1.0 else 0.0,
        block_d=_width(head_dim), block_dv=_width(value.shape[3]), ranges=lo32.shape[1],
        has_softcap=softcap is not None, has_alibi=alibi_slopes is not None, has_dropout=has_dropout,
        ieee=query.dtype == torch.float32)


def block_summary(lo: Tensor, hi: Tensor, k_len: int, block_m: int) -> Tensor:
    """Per block of ``block_m`` query rows and range, int32 ``[S, R, cdiv(Lq, block_m), 4]``: the
    smallest ``lo`` and largest ``hi`` of its non-empty rows (``Lk, 0`` when all are empty: which
    keys it may reach) and the largest ``lo`` and smallest ``hi`` of all its rows, rows past ``Lq``
    attending nothing (which keys every row attends). The dK/dV kernel reads it to skip query
    blocks without a pair in its key block, and to visit unmasked those whose rows all attend it."""
    rows = lo.shape[-1]
    pad = (0, -rows % block_m)
    blocks = (*lo.shape[:2], math.ceil(rows / block_m), block_m)
    nonempty = lo < hi
    first = F.pad(torch.where(nonempty, lo, k_len), pad, value=k_len).view(blocks).amin(-1)
    last = F.pad(torch.where(nonempty, hi, 0), pad, value=0).view(blocks).amax(-1)
    # rows past Lq (a ragged last block) attend nothing: that block is never whole, so the dK/dV
    # kernel's unmasked visits need no check of the rows against Lq (30 instructions of 567 a block)
    cover_lo = F.pad(lo, pad, value=k_len).view(blocks).amax(-1)
    cover_hi = F.pad(hi, pad, value=0).view(blocks).amin(-1)
    return torch.stack([first, last, cover_lo, cover_hi], dim=-1).to(torch.int32).contiguous()


def reached_blocks(summary: Tensor, k_len: int, block_n: int) -> Tensor:
    """Per key block of ``block_n`` keys and range, int32 ``[S, R, cdiv(Lk, block_n), 4]``: the first
    query block whose rows may reach it (by :func:`block_summary`), the first and one past the last
    of the run of query blocks from the first one whose rows all attend the whole key block (empty,
    at the end, where none does), and one past the last query block that may reach it (``0, 0, 0,
    0`` when none does). The dK/dV kernel walks only the query blocks between the first and the last
    (a window's key block is reached by a few of thousands, and reading every block's summary cost
    each program a scalar load per query block and head); with ``walk="runs"`` it takes the run of
    whole blocks unmasked and the rest masked, as the forward takes its key blocks: one run where
    ``lo`` and ``hi`` grow with the row, as every mask of :mod:`attnkit.masks` has them. Whole blocks
    elsewhere are masked too, needlessly but correctly. ``O((Lq / block_m) x (Lk / block_n))``
    booleans, built with no synchronisation."""
    first, last, cover_lo, cover_hi = summary.unbind(-1)  # [S, R, Qb]
    starts = torch.arange(0, max(k_len, 1), block_n, device=summary.device, dtype=torch.int32)
    reach = (first[..., None, :] < (starts + block_n)[:, None]) & (last[..., None, :] > starts[:, None])
    any_block = reach.any(-1)
    blocks = reach.shape[-1]
    begin = torch.where(any_block, reach.to(torch.int8).argmax(-1), 0)
    end = torch.where(any_block, blocks - reach.flip(-1).to(torch.int8).argmax(-1), 0)
    # whole: every row of the query block attends every key of the key block (as the kernel's
    # check: the key block's end uncut, so a ragged last key block is never whole)
    whole = (cover_lo[..., None, :] <= starts[:, None]) & ((starts + block_n)[:, None] <= cover_hi[..., None, :])
    index = torch.arange(blocks, device=summary.device)
    whole_begin = torch.where(whole.any(-1), whole.to(torch.int8).argmax(-1), end)
    broken = ~whole & (index >= whole_begin[..., None])
    whole_end = torch.where(broken.any(-1), broken.to(torch.int8).argmax(-1), blocks)
    whole_begin = torch.minimum(torch.maximum(whole_begin, begin), end)
    whole_end = torch.minimum(torch.maximum(whole_end, whole_begin), end)
    return torch.stack([begin, whole_begin, whole_end, end], dim=-1).to(torch.int32).contiguous()


def tile_descriptor(tensor: Tensor, rows: int, width: int) -> TensorDescriptor | None:
    """A TMA descriptor of a ``[N, heads, L, C]`` tensor for tiles of ``rows`` rows and ``width``
    features (powers of two; the kernels load ``[1, 1, rows, width]`` at ``[n, head, first row, 0]``),
    or ``None`` where the layout rules Hopper's copy engine out: it wants the last dimension
    contiguous, the other strides and the address on 16 bytes. Rows past ``L`` and features past
    ``C`` load as zeros, as the pointer loads' masks give them. A dimension of size 1 is never
    stepped along, so its stride is given as a contiguous one (torch allows any there, 0 included; a
    descriptor does not)."""
    if TensorDescriptor is None or tensor.numel() == 0 or tensor.stride(3) != 1 or tensor.data_ptr() % 16:
        return None
    strides, inner = [1] * 4, 1
    for dim in (3, 2, 1, 0):
        strides[dim] = tensor.stride(dim) if tensor.shape[dim] > 1 else inner
        inner = strides[dim] * tensor.shape[dim]
    if any(stride <= 0 or stride * tensor.element_size() % 16 for stride in strides[:3]):
        return None
    return TensorDescriptor(tensor, list(tensor.shape), strides, [1, 1, rows, width])
