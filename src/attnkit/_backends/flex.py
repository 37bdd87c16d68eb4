"""PyTorch's FlexAttention as an engine for attnkit's interval masks, on any device it runs on.

FlexAttention wants a ``BlockMask``: for each block of queries, the key blocks it must visit,
split into **full** ones (every pair attended: no ``mask_mod`` is applied inside) and **partial**
ones (``mask_mod`` decides each pair); the rest is skipped. ``create_block_mask`` finds them by
evaluating ``mask_mod`` on all ``Lq x Lk`` pairs and summing blocks: at 128k tokens that is 16
billion calls for every new mask, more work than some attention calls. attnkit's structured masks
already say, per query row, which keys it attends (one or two intervals ``lo <= j < hi``,
:mod:`attnkit.masks.structured`), so :func:`block_mask_from_bounds` reads the blocks straight off
the intervals: each row touches the key blocks ``[lo // b, ceil(hi / b))`` and covers whole the
blocks ``[ceil(lo / b), hi // b)``; counting, per (query block, key block), the rows that touch it
and the rows that cover it (a difference array: one scatter of +1/-1 per row and range, a cumsum
along the key blocks) classifies every block exactly: skipped if no row touches it, full if all
``b`` rows cover it, partial otherwise. O(Lq + (L / b)^2) small integer work in tensor ops, on
``lo``'s device, with no host sync; it matches ``create_block_mask`` block for block (a block cut
short by the end of the queries or keys is never full there either: its padding is "masked").

Partial blocks need a ``mask_mod``: :func:`interval_mask_mod` reads the row's bounds (any mask);
:func:`mask_mod_for` prefers the arithmetic rule for causal, sliding windows and packed documents
(and their intersections), which loads nothing per row but document ids. Everything a mod or
score_mod reads that may change from call to call (bounds, window reaches, the causal offset,
document ids, ALiBi slopes, the soft cap) is a captured **tensor**, never a Python number: a
compiled ``flex_attention`` guards on tensors' shapes, not their values, so a new window size or
new document boundaries reuse the compiled kernel (only the shapes form its cache key).

:func:`flex_interval_attention` runs it with attnkit's conventions: soft-capping then ALiBi as a
``score_mod`` (FlexAttention scales ``q.k`` before it), GQA through ``enable_gqa`` (the kv heads
are never repeated), sinks folded in through the lse (FlexAttention's lse is differentiable, so
the sinks are too), rows with no key set to zeros and lse ``-inf`` whatever the kernel gave.
On the CPU, FlexAttention runs eagerly (dense scores) and PyTorch refuses its backward; compiled,
it is the GPU engine.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .. import _torch_private
from ..masks import StructuredMask
from ..masks.structured import _Causal, _Document, _Intersection, _SlidingWindow
from .numerics import fold_sinks, rows_with_keys, work_dtype
from .transfer import device_scalar, to_device

try:  # torch >= 2.9: auxiliary outputs by request; ``return_lse`` is deprecated there
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover - older torch
    AuxRequest = None

__all__ = ["block_mask_from_bounds", "interval_mask_mod", "mask_mod_for", "flex_interval_attention", "FlexUnavailable"]

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


# -- the block mask --------------------------------------------------------------------------------


def _rows_per_block(start: Tensor, stop: Tensor, q_block: int, nq: int, nk: int) -> Tensor:
    """``[S, nq, nk]``: for each query block, how many (row, range) pairs have key block ``kb`` in
    ``start <= kb < stop`` (``start, stop [S, R, Lq]``, in ``[0, nk]``): +1 at ``start``, -1 at
    ``stop`` in each row's query block, then a running sum along the key blocks."""
    sequences, _, q_len = start.shape
    live = (start < stop).to(torch.int32).reshape(sequences, -1)
    row_block = torch.arange(q_len, device=start.device) // q_block * (nk + 1)
    diff = torch.zeros(sequences, nq * (nk + 1), dtype=torch.int32, device=start.device)
    diff.scatter_add_(1, (row_block + start).reshape(sequences, -1), live)
    diff.scatter_add_(1, (row_block + stop).reshape(sequences, -1), -live)
    return diff.view(sequences, nq, nk + 1).cumsum(-1, dtype=torch.int32)[..., :nk]


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """``[S, nq, nk]`` booleans as FlexAttention's ``(num_blocks [S, 1, nq], indices [S, 1, nq, nk])``:
    each row's listed key blocks first, ascending (the order ``create_block_mask`` gives)."""
    dense = blocks.to(torch.int32)[:, None]
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(-1, dtype=torch.int32), indices.to(torch.int32)


def block_mask_from_bounds(lo: Tensor, hi: Tensor, q_len: int, k_len: int, *,
                           block_size: int | tuple[int, int] = 128,
                           mask_mod: MaskMod | None = None) -> BlockMask:
    """FlexAttention's ``BlockMask`` for rows that attend keys ``lo[s, r, i] <= j < hi[s, r, i]``
    (``lo, hi`` int ``[S, R, Lq]``, the R ranges of a row disjoint, as ``row_ranges`` gives them),
    computed from the intervals alone (see the module docstring). ``block_size``: one size, or
    ``(query block, key block)``. ``mask_mod`` (default :func:`interval_mask_mod`) decides the pairs
    of partial blocks; it must agree with the intervals. Batch dim S (1 broadcasts), head dim 1."""
    q_block, k_block = (block_size, block_size) if isinstance(block_size, int) else block_size
    if q_block < 1 or k_block < 1:
        raise ValueError(f"block sizes must be >= 1, got {block_size}")
    if lo.dim() != 3 or lo.shape != hi.shape or lo.shape[-1] != q_len:
        raise ValueError(f"lo and hi must be [S, R, Lq={q_len}], got {tuple(lo.shape)} and {tuple(hi.shape)}")
    nq, nk = -(-q_len // q_block), -(-k_len // k_block)
    lo, hi = lo.clamp(0, k_len), hi.clamp(0, k_len)
    # An empty range touches no block, but its ends rounded out to blocks would (lo = hi = 5 spans
    # key block 0): it becomes [0, 0), empty on both roundings.
    empty = lo >= hi
    lo, hi = lo.masked_fill(empty, 0), hi.masked_fill(empty, 0)
    # Every bound lands in [0, nk], so a row's +1/-1 stays inside its query block's nk + 1 slots.
    touched = _rows_per_block(lo // k_block, (hi + k_block - 1) // k_block, q_block, nq, nk)
    covered = _rows_per_block((lo + k_block - 1) // k_block, hi // k_block, q_block, nq, nk)
    # A row covers a block within at most one of its disjoint ranges, so a count of q_block means
    # every row does; a short last query block or key block never gets there (as create_block_mask).
    full = covered == q_block
    partial = (touched > 0) & ~full
    kv_num_blocks, kv_indices = _ordered(partial)
    full_kv_num_blocks, full_kv_indices = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                                    BLOCK_SIZE=(q_block, k_block),
                                    mask_mod=mask_mod if mask_mod is not None else interval_mask_mod(lo, hi),
                                    seq_lengths=(q_len, k_len))


# -- mask_mods -------------------------------------------------------------------------------------


def _per_row(values: Tensor) -> Tensor:
    """``[S, n]`` row data as the mods index it: ``[n]`` when shared (the mod is called with the
    real batch index, which a shared mask must ignore), else ``[S, n]`` read at ``[b, i]``."""
    return values[0] if values.shape[0] == 1 else values


def _at(values: Tensor, b: Tensor, index: Tensor) -> Tensor:
    """Entry ``index`` of sequence ``b`` of :func:`_per_row` data."""
    return values[index] if values.dim() == 1 else values[b, index]


def interval_mask_mod(lo: Tensor, hi: Tensor) -> MaskMod:
    """A ``mask_mod`` reading each row's key ranges: ``(b, h, i, j)`` is allowed iff
    ``lo[s, r, i] <= j < hi[s, r, i]`` for some range r (``s = b``, or 0 when S = 1). ``lo, hi``
    ``[S, R, Lq]``, kept as int32 copies (two loads a row, whatever the mask)."""
    bounds = tuple((_per_row(lo[:, r].to(torch.int32)), _per_row(hi[:, r].to(torch.int32)))
                   for r in range(lo.shape[1]))

    def interval_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        inside = [(_at(start, b, q_idx) <= kv_idx) & (kv_idx < _at(stop, b, q_idx)) for start, stop in bounds]
        return functools.reduce(operator.or_, inside)

    return interval_mask


def _rule_mask_mod(offset: Tensor, left: Tensor | None, right: Tensor | None,
                   documents: tuple[Tensor, Tensor] | None) -> MaskMod:
    """``p - left <= j <= p + right`` (``p = i + offset``; None: no bound on that side) and, with
    ``documents = (query ids [S?, Lq], key ids [S?, Lk])``, equal document ids."""

    def rule_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        position = q_idx + offset
        terms = [kv_idx >= 0]  # true: a mask with no rule left (full attention)
        if left is not None:
            terms.append(kv_idx >= position - left)
        if right is not None:
            terms.append(kv_idx <= position + right)
        if documents is not None:
            terms.append(_at(documents[0], b, q_idx) == _at(documents[1], b, kv_idx))
        return functools.reduce(operator.and_, terms)

    return rule_mask


def _document_ids(document: _Document, q_len: int, k_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Per-position document labels (the document's first position) for the queries (at their key
    positions, bottom-right) and the keys; positions outside the packed sequence get -1 (queries)
    and -2 (keys), which match nothing."""

    def labels(positions: Tensor, outside: int) -> Tensor:
        starts, _ = document.bounds(positions)
        inside = (positions >= 0) & (positions < document.length)
        values = torch.where(inside, starts, outside).to(torch.int32)
        return values if values.dim() == 2 else values[None]

    queries = labels(torch.arange(q_len, device=device) + (k_len - q_len), -1)
    keys = labels(torch.arange(k_len, device=device), -2)
    return _per_row(queries), _per_row(keys)


def mask_mod_for(structure: StructuredMask | None, causal_too: bool, q_len: int, k_len: int,
                 lo: Tensor, hi: Tensor) -> MaskMod:
    """The ``mask_mod`` for a call's mask: an arithmetic rule when the mask is causal, sliding
    windows and at most one packing of documents intersected (``causal_too``: and causal), else
    :func:`interval_mask_mod` over ``lo, hi`` (its intervals). Tensors on ``lo``'s device."""
    if structure is None:
        parts = []
    else:
        parts = list(structure.parts) if isinstance(structure, _Intersection) else [structure]
    device = lo.device
    reach = q_len + k_len  # a reach beyond it is no bound, and keeps the numbers in int32
    left: int | None = None
    right: int | None = 0 if causal_too else None
    document = None
    for part in parts:
        if isinstance(part, (_Causal, _SlidingWindow)):
            part_left, part_right = (None, 0) if isinstance(part, _Causal) else (part.left, part.right)
            if part_left is not None:
                left = min(part_left, reach) if left is None else min(left, part_left)
            if part_right is not None:
                right = min(part_right, reach) if right is None else min(right, part_right)
        elif isinstance(part, _Document) and document is None:
            document = part
        else:
            return interval_mask_mod(lo, hi)

    def scalar(value: int | None) -> Tensor | None:
        return None if value is None else device_scalar(value, torch.int32, device)

    return _rule_mask_mod(scalar(k_len - q_len), scalar(left), scalar(right),
                          None if document is None else _document_ids(document, q_len, k_len, device))


# -- attention -------------------------------------------------------------------------------------


def _score_mod(softcap: float | None, slopes: Tensor | None, offset: Tensor) -> ScoreMod | None:
    """Soft-capping, then ALiBi ``-slope[b, h] * |i + offset - j|`` (``slopes [N, H]``), as a score_mod."""
    if softcap is None and slopes is None:
        return None
    cap = None if softcap is None else device_scalar(float(softcap), torch.float32, offset.device)

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        if slopes is not None:
            score = score - slopes[b, h] * (q_idx + offset - kv_idx).abs()
        return score

    return score_mod


#: Compiled versions of the engine kept per process (dynamo's default is 8 per function): one per
#: mask rule x score modifier x dtype x GQA x training that a program uses.
RECOMPILE_LIMIT = 64


class FlexUnavailable(RuntimeError):
    """The compiled engine cannot run this call without falling back to FlexAttention's unfused
    implementation (an ``Lq x Lk`` score matrix): it has used up :data:`RECOMPILE_LIMIT` versions."""


def _flex_call(query: Tensor, key: Tensor, value: Tensor, options: dict) -> tuple[Tensor, object]:
    """What is compiled: a function of attnkit's own, so its compiled versions (and dynamo's limit on
    them) are not shared with a program's own ``torch.compile(flex_attention)``."""
    return flex_attention(query, key, value, **options)


@functools.cache
def _compiled_flex(backend: str = "inductor") -> Callable[..., object]:
    """:func:`_flex_call` compiled, made on first use and shared: each version is cached by the
    shapes (and the mods' code), so every call of one shape class reuses it. ``fullgraph``: a
    graph break or an exhausted cache raises rather than run FlexAttention unfused."""
    return torch.compile(_flex_call, backend=backend, fullgraph=True)


def _run_compiled(query: Tensor, key: Tensor, value: Tensor, options: dict, backend: str) -> tuple[Tensor, object]:
    compiled = _compiled_flex(backend)
    with _torch_private.recompile_limit(RECOMPILE_LIMIT):
        try:
            return compiled(query, key, value, options)
        except _torch_private.recompile_limit_hit() as error:
            raise FlexUnavailable(f"attnkit's compiled FlexAttention holds {RECOMPILE_LIMIT} versions "
                                  f"(attnkit._backends.flex.RECOMPILE_LIMIT) and this call needs another") from error


def flex_interval_attention(query: Tensor, key: Tensor, value: Tensor, lo: Tensor, hi: Tensor, *,
                            scale: float, softcap: float | None = None, alibi_slopes: Tensor | None = None,
                            sinks: Tensor | None = None, mask_mod: MaskMod | None = None,
                            block_mask: BlockMask | None = None, compiled: bool = False,
                            backend: str = "inductor", every_row_attends: bool = False) -> tuple[Tensor, Tensor]:
    """Attention of ``query [N, H, Lq, D]`` over ``key [N, Hkv, Lk, D]``, ``value [N, Hkv, Lk, Dv]``
    (``H % Hkv == 0``) where row ``i`` of sequence ``n`` attends keys ``lo[s, r, i] <= j <
    hi[s, r, i]`` (``[S, R, Lq]``, ``s = n`` or 0 when S = 1). Scores ``scale * q.k``, soft-capped,
    minus ALiBi (``alibi_slopes [H]`` or ``[N, H]``, bottom-right positions); ``sinks [H]`` join
    every row's normaliser. Returns ``(out [N, H, Lq, Dv]`` in the input dtype, ``lse [N, H, Lq])``
    (natural log, float32 for half precision); a row with no key gives zeros and lse ``-inf`` (the
    sink, with sinks). ``block_mask``: a prebuilt :func:`block_mask_from_bounds` (else built here,
    with ``mask_mod``, default :func:`interval_mask_mod`); ``compiled``: run it compiled (with
    ``backend``; while ``torch.compile`` traces, the caller's compile does it) instead of the eager
    one. Differentiable through FlexAttention's autograd (q, k, v, sinks), where PyTorch runs its
    backward (not on the CPU). Raises :class:`FlexUnavailable` where compiled Flex would run unfused.
    ``every_row_attends``: the caller knows no row is empty (two full-size copies fewer)."""
    batch, heads, q_len, _ = query.shape
    k_len = key.shape[-2]
    if lo.dim() != 3 or lo.shape != hi.shape or lo.shape[0] not in (1, batch) or lo.shape[-1] != q_len:
        raise ValueError(f"lo and hi must be [1 or N={batch}, R, Lq={q_len}], "
                         f"got {tuple(lo.shape)} and {tuple(hi.shape)}")
    lo, hi = to_device(lo, query.device).clamp(0, k_len), to_device(hi, query.device).clamp(0, k_len)
    work = work_dtype(query.dtype)
    if q_len == 0 or k_len == 0:  # nothing to run: FlexAttention needs a block of each
        out = query.new_zeros(batch, heads, q_len, value.shape[-1])
        lse = torch.full((batch, heads, q_len), float("-inf"), dtype=work, device=query.device)
        return fold_sinks(out, lse, sinks)
    if block_mask is None:
        block_mask = block_mask_from_bounds(lo, hi, q_len, k_len, mask_mod=mask_mod)
    slopes = None
    if alibi_slopes is not None:  # [N, H] so that the mod reads slopes[b, h] in either form
        slopes = alibi_slopes.to(device=query.device, dtype=work).expand(batch, heads).contiguous()
    offset = device_scalar(k_len - q_len, torch.int32, query.device)
    options = dict(score_mod=_score_mod(softcap, slopes, offset), block_mask=block_mask, scale=scale,
                   enable_gqa=key.shape[1] != heads)
    # The lse comes back in natural log: the kernels keep log2 statistics and flex_attention
    # converts them itself (checked against the reference by the tests, eager and on CUDA).
    if AuxRequest is not None:
        options["return_aux"] = AuxRequest(lse=True)
    else:  # pragma: no cover - torch < 2.9
        options["return_lse"] = True
    if compiled and not torch.compiler.is_compiling():
        out, aux = _run_compiled(query, key, value, options, backend)
    else:
        out, aux = flex_attention(query, key, value, **options)
    lse = aux.lse if AuxRequest is not None else aux
    # FlexAttention gives rows with no key zeros and lse -inf (2.13, eager; its kernels intend the
    # same): enforced here whatever a backend gives, which also stops any gradient into them.
    lse = lse.to(work)
    if not every_row_attends:
        has_key = rows_with_keys(lo, hi)
        lse = torch.where(has_key, lse, float("-inf"))
        out = torch.where(has_key[..., None], out, 0.0)
    if sinks is not None:
        out, lse = fold_sinks(out.to(work), lse, sinks)
        out = out.to(query.dtype)
    return out, lse
