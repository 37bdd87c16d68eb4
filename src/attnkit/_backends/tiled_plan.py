"""Planning for the ``"tiled"`` backend: which kernel calls cover a call's attended pairs.

A query row may attend one interval of keys ``[lo, hi)`` (:mod:`attnkit.masks.structured`).
Rows are cut into blocks; each block gets the key ranges its rows attend (full: no mask;
partial: a small dense mask; the rest is skipped), at the finest level and, for blocks whose
rows all start at one key, at coarser levels that take the bulk of causal-like masks. Runs of
alike blocks become one :class:`BlockRun`, one kernel call over strided views. Pure index
arithmetic: no attention is computed here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch
from torch import Tensor

from .._call import AttentionCall
from ..masks import StructuredMask, causal
from .interval_inputs import KERNELS


@dataclass(frozen=True)
class Settings:
    """How the tiled backend cuts a call on PyTorch's kernels (the native kernel has its own
    tiles, :mod:`.native.tile_tables`). Read from a context variable: :func:`tuning` changes them
    for one block of code in one thread or task, never for the rest of the process."""

    #: Queries per block. Small blocks waste little of a window on its masked corners (a 512-key
    #: window computes 543 keys per row with 32-row blocks); the fused kernel still sees large
    #: problems because runs of similar blocks are batched into one call. benchmarks/masks.py: 32
    #: was 7% faster than 64 on the 512 window at L = 16384, equal on documents and causal+padding.
    block_size: int = 32
    #: A block whose key ranges span at most this many keys runs them as one range with a dense
    #: mask over the span, rather than one unmasked range plus masked edges: below it, the extra
    #: calls and merges cost more than masking the whole span.
    merge_span: int = 1024
    #: Masked key ranges are widened to a multiple of this many keys, into keys that no row of the
    #: block attends (so the widened keys are masked for every row and nothing is counted twice).
    #: The fused kernel is slower per pair on odd lengths: 543 keys per 32-row block (a 512 window)
    #: cost 5-10% more per pair than 544 (its vector loops run a scalar tail); benchmarks/masks.py.
    key_align: int = 16
    #: Levels of coarser blocks above ``block_size`` (each 4x the one below), see ``level_ranges``.
    levels: int = 3
    #: Limits of one kernel call, so that its temporaries stay small next to the inputs: the
    #: plain-ops kernel (dropout, other devices) materialises its scores; the fused kernel returns a
    #: partial output of ``rows x heads x Dv`` (32k rows x heads: 8 MiB at Dv = 64 in fp32).
    call_scores: int = 1 << 23
    call_rows: int = 1 << 15
    #: The interval op's kernel, forced (one of ``interval_inputs.KERNELS``), where a route names none:
    #: tests run the Triton kernel on CPU tensors through Triton's interpreter this way. ``""``: the
    #: policy's choice.
    kernel: str = ""
    #: The ``torch.compile`` backend the FlexAttention engine is compiled with off the CPU; tests use
    #: ``"eager"`` to trace it on CPU tensors without generating kernels.
    flex_backend: str = "inductor"


_settings: ContextVar[Settings] = ContextVar("attnkit_tiled_settings", default=Settings())


def settings() -> Settings:
    """The settings in force here."""
    return _settings.get()


@contextmanager
def tuning(**overrides: int | str) -> Iterator[Settings]:
    """Run the tiled backend with other :class:`Settings` inside the ``with`` (tests use tiny
    blocks and no merging to exercise many blocks and partial merges cheaply, and several
    alignments). Only this thread or task sees them."""
    known = {f.name for f in fields(Settings)}
    for name, value in overrides.items():
        if name not in known:
            raise TypeError(f"tuning() got an unknown setting {name!r}; known: {sorted(known)}")
        if name == "kernel":
            if value not in ("", *KERNELS):
                raise ValueError(f"kernel must be one of {KERNELS} or '', got {value!r}")
            continue
        if name == "flex_backend":
            if not isinstance(value, str) or not value:
                raise TypeError(f"flex_backend must be the name of a torch.compile backend, got {value!r}")
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < (0 if name in ("merge_span", "levels") else 1):
            raise ValueError(f"{name} must be >= {0 if name in ('merge_span', 'levels') else 1}, got {value}")
    new = replace(settings(), **overrides)
    token = _settings.set(new)
    try:
        yield new
    finally:
        _settings.reset(token)


class KeyRange(NamedTuple):
    """Keys ``start <= j < stop`` that a block of queries may attend.

    ``full``: every query of the block may attend every key of the range (no mask needed);
    otherwise some (query, key) pairs inside are masked and a dense mask must be applied.
    """

    start: int
    stop: int
    full: bool


def plan_blocks(lo: Tensor, hi: Tensor, block_size: int) -> list[list[KeyRange]]:
    """Cut the rows of ``lo, hi`` (``[..., Lq]``, clipped) into blocks of ``block_size`` queries
    and give each block its key ranges: ``[union start, full start)`` partial, ``[full start,
    full stop)`` full, ``[full stop, union stop)`` partial, leaving out empty ones. Leading dims
    (sequences) count as more rows of the same block. Vectorised: a few tensor ops for any Lq."""
    q_len = lo.shape[-1]
    if q_len == 0:
        return []
    blocks = -(-q_len // block_size)
    pad = blocks * block_size - q_len
    lo2 = lo.reshape(-1, q_len)
    hi2 = hi.reshape(-1, q_len)
    nonempty = lo2 < hi2
    big = 2**62

    def per_block(t: Tensor, fill: int) -> Tensor:
        # The last block's missing rows get a neutral fill: they neither widen the union nor
        # shrink the range attended by all rows.
        t = torch.cat([t, t.new_full((t.shape[0], pad), fill)], dim=1)
        return t.reshape(t.shape[0], blocks, block_size).transpose(0, 1).reshape(blocks, -1)

    any_lo = per_block(torch.where(nonempty, lo2, big), big).amin(1)
    any_hi = per_block(torch.where(nonempty, hi2, -1), -1).amax(1)
    # A key is attended by every row of the block iff it is inside every row's interval.
    all_lo = per_block(lo2, -big).amax(1)
    all_hi = per_block(hi2, big).amin(1)
    plan = []
    for u0, u1, f0, f1 in zip(any_lo.tolist(), any_hi.tolist(), all_lo.tolist(), all_hi.tolist()):
        if u0 >= u1:
            plan.append([])
        elif f0 >= f1:
            plan.append([KeyRange(u0, u1, False)])
        else:
            ranges = [KeyRange(u0, f0, False), KeyRange(f0, f1, True), KeyRange(f1, u1, False)]
            plan.append([r for r in ranges if r.start < r.stop])
    return plan


def key_ranges(mask: StructuredMask, q_start: int, q_stop: int, q_len: int, k_len: int | None = None) -> list[KeyRange]:
    """Which keys the queries ``q_start <= i < q_stop`` of ``mask`` may attend, as sorted disjoint
    ranges; keys outside them are masked for every query of the block (and every sequence)."""
    if not 0 <= q_start <= q_stop <= q_len:
        raise ValueError(f"need 0 <= q_start <= q_stop <= q_len, got {q_start}, {q_stop}, {q_len}")
    if q_stop == q_start:
        return []
    lo, hi = mask.row_ranges(q_len, k_len)
    block = q_stop - q_start
    found = [r for slot in range(lo.shape[1])
             for r in plan_blocks(lo[:, slot, q_start:q_stop], hi[:, slot, q_start:q_stop], block)[0]]
    found.sort(key=lambda r: r.start)
    merged: list[KeyRange] = []
    for r in found:  # ranges of different slots may touch or overlap across rows: join those
        if merged and r.start < merged[-1].stop:
            last = merged.pop()
            merged.append(KeyRange(last.start, max(last.stop, r.stop), False))
        else:
            merged.append(r)
    return merged


# -- planning ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockRun:
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
    #: The blocks' rows and keys are the same positions and the mask is causal: PyTorch's kernel
    #: applies it itself (its own causal path), no mask tensor.
    causal: bool = False
    #: Which of a row's key ranges the run covers (None: all of them, as one dense mask).
    slot: int | None = 0

    @property
    def q1(self) -> int:
        return self.q0 + self.count * self.rows


def combined(structure: StructuredMask | None, causal_too: bool) -> StructuredMask | None:
    """A structured mask with ``causal=True`` folded in (None when there is neither)."""
    if causal_too:
        return causal() if structure is None else structure & causal()
    return structure


def intervals(structure: StructuredMask | None, causal_too: bool, q_len: int, k_len: int) -> tuple[Tensor, Tensor]:
    """``lo, hi`` of every query row's key ranges, ``[S, R, Lq]``: S = 1 or one per sequence, R = 1
    or 2 ranges a row (disjoint)."""
    mask = combined(structure, causal_too)
    if mask is None:
        lo = torch.zeros(1, 1, q_len, dtype=torch.int64)
        return lo, torch.full_like(lo, k_len)
    return mask.row_ranges(q_len, k_len)


def row_bounds(call: AttentionCall) -> tuple[Tensor, Tensor]:
    """:func:`intervals` of a call, ``[S, R, Lq]``."""
    return intervals(call.structure, call.causal, call.q_len, call.k_len)


def block_ranges(lo: Tensor, hi: Tensor, size: int, merge_span: int) -> list[list[KeyRange]]:
    """Each block's key ranges, with spans of at most ``merge_span`` keys merged into one masked range."""
    blocks = plan_blocks(lo, hi, size)
    for index, ranges in enumerate(blocks):
        if len(ranges) > 1 and ranges[-1].stop - ranges[0].start <= merge_span:
            blocks[index] = [KeyRange(ranges[0].start, ranges[-1].stop, False)]
    return blocks


def _subtract(r: KeyRange, done: tuple[int, int] | None) -> list[KeyRange]:
    """The parts of ``r`` outside the interval ``done`` (keys already computed for these rows)."""
    if done is None or done[1] <= r.start or r.stop <= done[0]:
        return [r]
    parts = [KeyRange(r.start, done[0], r.full), KeyRange(done[1], r.stop, r.full)]
    return [p for p in parts if p.start < p.stop]


def level_ranges(lo: Tensor, hi: Tensor, size: int, levels: int,
                 merge_span: int) -> list[tuple[int, list[list[KeyRange]]]]:
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
    finest = block_ranges(lo, hi, size, merge_span)
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


@dataclass(frozen=True)
class Problem:
    """What a plan depends on: the rows' key ranges ``lo, hi`` (``[S, R, Lq]``, S = 1 or one row per
    sequence, R ranges a row), the lengths, the number of sequences, and whether a dense tensor
    mask comes too (it differs from block to block, so nothing is batched and there are no coarse
    levels)."""

    lo: Tensor  # [S, R, Lq]
    hi: Tensor
    q_len: int
    k_len: int
    batch: int
    has_mask: bool


class PlanCache:
    """The plans of the last few calls, reused when a call has equal plan inputs. A model's layers,
    and a training loop's steps, repeat one mask, and planning costs about 5 ms at L = 16384 (3% of
    a 512-window call). Row bounds are compared by value, so a mask rebuilt alike hits, and a
    lengths tensor changed in place misses, as it must. Safe to share between threads."""

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: list[tuple[tuple, Tensor, Tensor, list[BlockRun]]] = []

    def plan(self, problem: Problem) -> list[BlockRun]:
        config = settings()
        key = (config, problem.q_len, problem.k_len, problem.batch, problem.has_mask)
        with self._lock:
            for index, (other, lo, hi, runs) in enumerate(self._entries):
                if other == key and torch.equal(lo, problem.lo) and torch.equal(hi, problem.hi):
                    self._entries.append(self._entries.pop(index))  # most recently used last
                    return runs
        runs = plan(problem, config)  # outside the lock: planning is pure
        with self._lock:
            self._entries.append((key, problem.lo, problem.hi, runs))
            del self._entries[:-self.capacity]
        return runs

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def dense_plan(problem: Problem, causal_only: bool, heads_per_kv: int) -> list[BlockRun]:
    """One call per sequence over all rows and keys: what PyTorch's fused kernel would run on the
    dense form of the mask (its causal path for a plain causal mask, when GQA does not stack heads
    as rows)."""
    shared = problem.lo.shape[0] == 1
    batches = [slice(0, problem.batch)] if shared else [slice(s, s + 1) for s in range(problem.batch)]
    causal_path = causal_only and problem.q_len == problem.k_len and not problem.has_mask and heads_per_kv == 1
    return [BlockRun(batch, 0, problem.q_len, 1, 0, 0, problem.k_len, full=causal_path, causal=causal_path, slot=None)
            for batch in batches]


def visited_fraction(problem: Problem) -> float:
    """Share of the ``Lq x Lk`` (query, key) pairs, over the batch, that :func:`plan` computes."""
    area = sum(g.count * g.rows * g.length * (g.batch.stop - g.batch.start) for g in plans.plan(problem))
    return area / max(1, problem.q_len * problem.k_len * problem.batch)


#: The process's plan cache (the tiled backend's only state that outlives a call).
plans = PlanCache()


def plan(problem: Problem, config: Settings | None = None) -> list[BlockRun]:
    """Every kernel call the tiled backend makes for ``problem``, in order.

    At each level (:func:`level_ranges`), ranges of consecutive full-size blocks join one run
    when they have the same length, fullness and mask pattern (relative to their start) and
    their starts step evenly. A dense tensor mask differs from block to block, so with one there
    are no coarse levels and every range is its own run."""
    config = config or settings()
    lo, hi = problem.lo, problem.hi
    per_sequence = lo.shape[0] > 1
    runs: list[BlockRun] = []
    for s in range(lo.shape[0]):
        batch = slice(s, s + 1) if per_sequence else slice(0, problem.batch)
        levels = 0 if problem.has_mask else config.levels
        for slot in range(lo.shape[1]):  # a row's ranges are disjoint: each is planned on its own
            row_lo, row_hi = lo[s, slot], hi[s, slot]
            for block, blocks in level_ranges(row_lo, row_hi, config.block_size, levels, config.merge_span):
                blocks = _aligned(blocks, row_lo, row_hi, block, config.key_align)
                runs.extend(replace(g, slot=slot) for g in _runs(blocks, block, row_lo, row_hi, batch, problem))
    return [_stacked(g) for g in runs]


def _runs(blocks: list[list[KeyRange]], size: int, lo: Tensor, hi: Tensor, batch: slice,
          problem: Problem) -> list[BlockRun]:
    """BlockRun the ranges of consecutive blocks of one level into batched kernel calls."""
    patterns = _patterns(lo, hi, blocks, size)
    runs: list[BlockRun] = []
    open_runs: dict[tuple, BlockRun] = {}
    for index, ranges in enumerate(blocks):
        q0 = index * size
        rows = min(size, problem.q_len - q0)
        batchable = not problem.has_mask and rows == size
        extended: dict[tuple, BlockRun] = {}
        for r in ranges:
            signature = (r.stop - r.start, r.full, patterns.get((index, r.start)))
            run = open_runs.pop(signature, None)
            if run is not None and batchable and run.q1 == q0 and (
                    run.count == 1 or run.key_start + run.count * run.key_step == r.start):
                step = r.start - run.key_start if run.count == 1 else run.key_step
                extended[signature] = replace(run, count=run.count + 1, key_step=step)
                continue
            if run is not None:
                runs.append(run)
            new = BlockRun(batch, q0, rows, 1, r.start, 0, r.stop - r.start, r.full)
            if batchable:
                extended[signature] = new
            else:
                runs.append(new)
        runs.extend(open_runs.values())
        open_runs = extended
    runs.extend(open_runs.values())
    return runs


def _aligned(blocks: list[list[KeyRange]], lo: Tensor, hi: Tensor, size: int,
             key_align: int) -> list[list[KeyRange]]:
    """Widen each block's masked ranges to a multiple of ``key_align`` keys, to the left where
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
            short = -(r.stop - r.start) % key_align
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


def _stacked(g: BlockRun) -> BlockRun:
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
