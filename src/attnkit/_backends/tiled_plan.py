"""Planning for the ``"tiled"`` backend: which kernel calls cover a call's attended pairs.

A query row may attend one interval of keys ``[lo, hi)`` (:mod:`attnkit.masks.structured`).
Rows are cut into blocks; each block gets the key ranges its rows attend (full: no mask;
partial: a small dense mask; the rest is skipped), at the finest level and, for blocks whose
rows all start at one key, at coarser levels that take the bulk of causal-like masks. Runs of
alike blocks become one :class:`Group`, one kernel call over strided views. Pure index
arithmetic: no attention is computed here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .._call import AttentionCall
from ..masks import KeyRange, StructuredMask, causal, plan_blocks

#: Levels of coarser blocks above ``BLOCK_SIZE`` (each 4x the one below), see ``level_ranges``.
LEVELS = 3

#: Queries per block. Small blocks waste little of a window on its masked corners (a 512-key
#: window computes 543 keys per row with 32-row blocks); the fused kernel still sees large
#: problems because runs of similar blocks are batched into one call. benchmarks/masks.py: 32
#: was 7% faster than 64 on the 512 window at L = 16384, equal on documents and causal+padding.
BLOCK_SIZE = 32

#: A block whose key ranges span at most this many keys runs them as one range with a dense mask
#: over the span, rather than one unmasked range plus masked edges: below it, the extra calls and
#: merges cost more than masking the whole span.
MERGE_SPAN = 1024

#: Masked key ranges are widened to a multiple of this many keys, into keys that no row of the
#: block attends (so the widened keys are masked for every row and nothing is counted twice).
#: The fused kernel is slower per pair on odd lengths: 543 keys per 32-row block (a 512 window)
#: cost 5-10% more per pair than 544 (its vector loops run a scalar tail); benchmarks/masks.py.
KEY_ALIGN = 16


@contextmanager
def tuning(*, block_size: int | None = None, merge_span: int | None = None,
           key_align: int | None = None) -> Iterator[None]:
    """Run the tiled backend with other ``BLOCK_SIZE`` / ``MERGE_SPAN`` / ``KEY_ALIGN`` inside the
    ``with`` (tests use tiny blocks and no merging to exercise many blocks and partial merges
    cheaply, and several alignments)."""
    global BLOCK_SIZE, MERGE_SPAN, KEY_ALIGN
    for name, value in (("block_size", block_size), ("key_align", key_align)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    saved = BLOCK_SIZE, MERGE_SPAN, KEY_ALIGN
    BLOCK_SIZE = BLOCK_SIZE if block_size is None else block_size
    MERGE_SPAN = MERGE_SPAN if merge_span is None else merge_span
    KEY_ALIGN = KEY_ALIGN if key_align is None else key_align
    try:
        yield
    finally:
        BLOCK_SIZE, MERGE_SPAN, KEY_ALIGN = saved


# -- planning ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """One kernel call: ``count`` consecutive blocks of ``rows`` queries from ``q0``, of sequences
    ``batch``; block ``i`` attends keys ``key_start + i * key_step + [0, length)``, either all of
    them (``full``) or with the mask pattern shared by the blocks."""

    batch: slice
    q0: int
    rows: int
    count: int
    key_start: int
    key_step: int
    length: int
    full: bool
    seed: int = 0

    @property
    def q1(self) -> int:
        return self.q0 + self.count * self.rows


def structure_of(call: AttentionCall) -> StructuredMask | None:
    """The call's structured mask with ``causal=True`` folded in (None when it has neither)."""
    if call.causal:
        return causal() if call.structure is None else call.structure & causal()
    return call.structure


def row_bounds(call: AttentionCall) -> tuple[Tensor, Tensor]:
    """``lo, hi`` of every query row, ``[S, Lq]`` with S = 1 or one row per sequence."""
    structure = structure_of(call)
    if structure is None:
        lo = torch.zeros(1, call.q_len, dtype=torch.int64)
        return lo, torch.full_like(lo, call.k_len)
    lo, hi = structure.row_bounds(call.q_len, call.k_len)
    return (lo[None], hi[None]) if lo.dim() == 1 else (lo, hi)


def batch_size(call: AttentionCall) -> int:
    """Sequences of the call: dim 0 of 3-D/4-D inputs, 1 for 2-D ones."""
    return call.query.shape[0] if call.query.dim() >= 3 else 1


def block_ranges(lo: Tensor, hi: Tensor, size: int) -> list[list[KeyRange]]:
    """Each block's key ranges, with short spans merged into one masked range (``MERGE_SPAN``)."""
    blocks = plan_blocks(lo, hi, size)
    for index, ranges in enumerate(blocks):
        if len(ranges) > 1 and ranges[-1].stop - ranges[0].start <= MERGE_SPAN:
            blocks[index] = [KeyRange(ranges[0].start, ranges[-1].stop, False)]
    return blocks


def _subtract(r: KeyRange, done: tuple[int, int] | None) -> list[KeyRange]:
    """The parts of ``r`` outside the interval ``done`` (keys already computed for these rows)."""
    if done is None or done[1] <= r.start or r.stop <= done[0]:
        return [r]
    parts = [KeyRange(r.start, done[0], r.full), KeyRange(done[1], r.stop, r.full)]
    return [p for p in parts if p.start < p.stop]


def level_ranges(lo: Tensor, hi: Tensor, size: int, levels: int) -> list[tuple[int, list[list[KeyRange]]]]:
    """Key ranges per block at each level: ``(block size, ranges of each block)``, coarse to fine.

    A coarse block (``size * 4**k`` rows) whose rows all start at the same key (causal,
    prefix-LM, padding, inside a document: the fine blocks' ranges would grow from block to
    block and could not be batched) runs the keys that all its rows attend, when they are at
    least as many as its rows and not already run by its parent: one big kernel call that takes
    most of a causal mask's work. The finest blocks (``size``) run everything else; a sliding
    window, whose fine blocks batch into one call, stays entirely at that level."""
    done: dict[int, tuple[int, int]] = {}  # block index at the previous level -> keys run for it
    previous = 0
    result = []
    for level in range(levels, 0, -1):
        coarse = size * 4**level
        current: dict[int, tuple[int, int]] = {}
        runs = []
        anchored = _same_start(lo, hi, coarse)
        for index, ranges in enumerate(plan_blocks(lo, hi, coarse)):
            parent = done.get(index * coarse // previous) if previous else None
            full = next((r for r in ranges if r.full), None)
            fresh = [] if full is None or not anchored[index] else _subtract(full, parent)
            if fresh and sum(r.stop - r.start for r in fresh) >= coarse:
                runs.append(fresh)
                current[index] = (full.start, full.stop)
            else:
                runs.append([])
                if parent is not None:
                    current[index] = parent
        result.append((coarse, runs))
        done, previous = current, coarse
    finest = block_ranges(lo, hi, size)
    if previous:
        finest = [[part for r in ranges for part in _subtract(r, done.get(index * size // previous))]
                  for index, ranges in enumerate(finest)]
    result.append((size, finest))
    return result


def _rows_by_block(lo: Tensor, hi: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor]:
    """``nonempty, lo, hi`` of the rows as ``[blocks, size]``, the last block padded with empty rows."""
    pad = -lo.shape[0] % size

    def by_block(t: Tensor) -> Tensor:
        return torch.cat([t, t.new_zeros(pad)]).view(-1, size)

    return by_block(lo < hi), by_block(lo), by_block(hi)


def _lowest(values: Tensor, nonempty: Tensor) -> Tensor:
    """Per block (row of ``[blocks, size]``), the least value over its non-empty rows."""
    return torch.where(nonempty, values, 2**62).amin(1)


def _highest(values: Tensor, nonempty: Tensor) -> Tensor:
    """Per block, the greatest value over its non-empty rows."""
    return torch.where(nonempty, values, -2**62).amax(1)


def _same_start(lo: Tensor, hi: Tensor, size: int) -> list[bool]:
    """For each block of ``size`` rows: do all its non-empty rows start at the same key?"""
    nonempty, starts, _ = _rows_by_block(lo, hi, size)
    return (~nonempty.any(1) | (_lowest(starts, nonempty) == _highest(starts, nonempty))).tolist()


#: How many recent plans :func:`cached_plan` keeps (each with its ``[S, Lq]`` row bounds).
PLAN_CACHE = 4
_recent_plans: list[tuple[tuple, Tensor, Tensor, list[Group]]] = []


def cached_plan(call: AttentionCall) -> list[Group]:
    """:func:`plan` of ``call``, reused when a recent call had the same plan inputs. A model's
    layers, and a training loop's steps, repeat one mask, and planning costs about 5 ms at
    L = 16384 (3% of a 512-window call). The rows' bounds are compared by value, so a mask
    rebuilt alike hits, and a lengths tensor changed in place misses, as it must."""
    lo, hi = row_bounds(call)
    key = (BLOCK_SIZE, MERGE_SPAN, LEVELS, KEY_ALIGN, call.q_len, call.k_len, batch_size(call), call.mask is None)
    for index, entry in enumerate(_recent_plans):
        if entry[0] == key and torch.equal(entry[1], lo) and torch.equal(entry[2], hi):
            _recent_plans.append(_recent_plans.pop(index))  # most recently used last
            return entry[3]
    groups = plan(call, bounds=(lo, hi))
    _recent_plans.append((key, lo, hi, groups))
    del _recent_plans[:-PLAN_CACHE]
    return groups


def plan(call: AttentionCall, size: int | None = None, bounds: tuple[Tensor, Tensor] | None = None) -> list[Group]:
    """Every kernel call the tiled backend makes for ``call``, in order (``bounds``: the call's
    :func:`row_bounds` when the caller has them already).

    At each level (:func:`level_ranges`), ranges of consecutive full-size blocks join one group
    when they have the same length, fullness and mask pattern (relative to their start) and
    their starts step evenly. A dense tensor mask differs from block to block, so with one there
    are no coarse levels and every range is its own group."""
    size = size or BLOCK_SIZE
    lo, hi = bounds if bounds is not None else row_bounds(call)
    per_sequence = lo.shape[0] > 1
    groups: list[Group] = []
    for s in range(lo.shape[0]):
        batch = slice(s, s + 1) if per_sequence else slice(0, batch_size(call))
        for block, blocks in level_ranges(lo[s], hi[s], size, 0 if call.mask is not None else LEVELS):
            blocks = _aligned(blocks, lo[s], hi[s], block)
            groups.extend(_runs(blocks, block, lo[s], hi[s], batch, call))
    return [_stacked(g) for g in groups]


def _runs(blocks: list[list[KeyRange]], size: int, lo: Tensor, hi: Tensor, batch: slice,
          call: AttentionCall) -> list[Group]:
    """Group the ranges of consecutive blocks of one level into batched kernel calls."""
    patterns = _patterns(lo, hi, blocks, size)
    groups: list[Group] = []
    open_runs: dict[tuple, Group] = {}
    for index, ranges in enumerate(blocks):
        q0 = index * size
        rows = min(size, call.q_len - q0)
        batchable = call.mask is None and rows == size
        extended: dict[tuple, Group] = {}
        for r in ranges:
            signature = (r.stop - r.start, r.full, patterns.get((index, r.start)))
            run = open_runs.pop(signature, None)
            if run is not None and batchable and run.q1 == q0 and (
                    run.count == 1 or run.key_start + run.count * run.key_step == r.start):
                step = r.start - run.key_start if run.count == 1 else run.key_step
                extended[signature] = replace(run, count=run.count + 1, key_step=step)
                continue
            if run is not None:
                groups.append(run)
            new = Group(batch, q0, rows, 1, r.start, 0, r.stop - r.start, r.full)
            if batchable:
                extended[signature] = new
            else:
                groups.append(new)
        groups.extend(open_runs.values())
        open_runs = extended
    groups.extend(open_runs.values())
    return groups


def _aligned(blocks: list[list[KeyRange]], lo: Tensor, hi: Tensor, size: int) -> list[list[KeyRange]]:
    """Widen each block's masked ranges to a multiple of ``KEY_ALIGN`` keys, to the left where
    the range starts at or before every row's first key, else (or for the rest) to the right
    where it ends at or after every row's last key. Keys outside ``[min lo, max hi)`` of the
    block's rows are masked for all of them (the bias is built from ``lo, hi``) and lie in no
    other range of the block, so the result is unchanged. Ranges never grow past the keys that
    some row of the sequence attends: keys nobody attends (padding) may hold anything, even NaN,
    and are never read."""
    nonempty, lo_rows, hi_rows = _rows_by_block(lo, hi, size)
    if not nonempty.any():
        return blocks
    first, last = _lowest(lo_rows, nonempty), _highest(hi_rows, nonempty)
    floor, ceiling = int(first.min()), int(last.max())  # the keys some row of the sequence attends
    first, last = first.tolist(), last.tolist()
    result = []
    for index, ranges in enumerate(blocks):
        widened = []
        for r in ranges:
            short = -(r.stop - r.start) % KEY_ALIGN
            start, stop = r.start, r.stop
            if not r.full and short:
                if start <= first[index]:
                    take = min(short, max(0, start - floor))
                    start, short = start - take, short - take
                if stop >= last[index]:
                    stop += min(short, max(0, ceiling - stop))
            widened.append(KeyRange(start, stop, r.full) if (start, stop) != (r.start, r.stop) else r)
        result.append(widened)
    return result


def _stacked(g: Group) -> Group:
    """Blocks that all attend the same keys (the inside of a document, the rows past a padding
    cut) run as one block of all their rows: one plain call, which the kernel runs best."""
    if g.count > 1 and g.key_step == 0:
        return replace(g, rows=g.rows * g.count, count=1)
    return g


def _patterns(lo: Tensor, hi: Tensor, blocks: list[list[KeyRange]], size: int) -> dict[tuple[int, int], tuple]:
    """For each partial range of each full-size block, its rows' ``lo, hi`` relative to the
    range's start (clipped to it): equal patterns mean equal masks. Computed in one tensor op."""
    partial = [(index, r) for index, ranges in enumerate(blocks) for r in ranges
               if not r.full and (index + 1) * size <= lo.shape[0]]
    if not partial:
        return {}
    rows = torch.tensor([index * size for index, _ in partial])[:, None] + torch.arange(size)
    starts = torch.tensor([r.start for _, r in partial])[:, None]
    lengths = torch.tensor([r.stop - r.start for _, r in partial])[:, None]
    relative = torch.cat([lo[rows] - starts, hi[rows] - starts], dim=1)
    relative = torch.minimum(relative.clamp(min=0), lengths).tolist()
    return {(index, r.start): tuple(row) for (index, r), row in zip(partial, relative)}
