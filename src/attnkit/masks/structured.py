"""Structured masks: small rules instead of ``Lq x Lk`` tensors, so attention can skip work.

Each mask here gives every query row **one or two intervals of keys** it may attend,
``lo <= key < hi`` (empty when ``lo >= hi``). That covers causal, sliding windows (any left and
right reach), packed documents, prefix-LM, key padding, variable-length batches, explicit per-row
ranges and the first keys every query sees (attention sinks), and it is closed under
intersection (``&``: the larger ``lo``, the smaller ``hi``) and, up to two ranges a row, union
(``|``). A few numbers per row describe the whole mask in O(L) memory, and a block of queries can
tell at once which keys are attended by **all** of its rows (no mask needed there), which by
**some** (a small dense mask), and which by none (skipped)::

    sliding_window(3) & document([4, 4]) on 8 x 8     as 4 x 4 blocks
    # . . . . . . .                                    + .
    # # . . . . . .                                    . +
    # # # . . . . .
    . # # # . . . .     (+: partly allowed, .: skipped)
    . . . . # . . .
    . . . . # # . .
    . . . . # # # .
    . . . . . # # #

Positions: query ``i`` sits at key position ``p = i + Lk - Lq`` (**bottom-right** alignment, as
``causal`` everywhere in attnkit), so the last query is level with the last key. ``causal()``
lets ``p`` see keys ``j <= p``; rows with ``p < 0`` (when ``Lq > Lk``) see nothing and give zeros.
With ``varlen(q_lengths, k_lengths)`` in an intersection, each sequence aligns to its own real
lengths instead (FlashAttention's variable-length semantics; see :func:`attnkit.masks.varlen`).

Masks made from per-sequence data (``padding(lengths)``, ``document(ids=[B, T])``,
``prefix_lm([B])``, ``varlen``, ``key_ranges([B, Lq])``) have a ``batch_size``; their dense form is
``[B, 1, Lq, Lk]`` and broadcasts against ``[B, H, Lq, Lk]`` scores. The others are the same for
every sequence: ``[Lq, Lk]``. Boolean forms mean **True = may attend**, as everywhere in attnkit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import _integers
from .dense import to_string as _draw_dense

__all__ = ["StructuredMask"]  # made by the constructors of attnkit.masks.constructors

#: The most key ranges a row of a structured mask may have (attention sinks next to a window).
MAX_RANGES = 2


class StructuredMask:
    """A mask given by one or two key intervals ``[lo, hi)`` per query row. Combine with ``&``
    (intersection) and ``|`` (union, at most two ranges a row).

    Subclasses implement :meth:`~attnkit.masks.StructuredMask.bounds`; everything else (dense
    form, key ranges of a block, drawing) follows from it. Make masks with the constructors of
    :mod:`attnkit.masks` (:func:`attnkit.masks.causal`, :func:`attnkit.masks.sliding_window`,
    :func:`attnkit.masks.document`, ...) and pass them as ``mask=`` to :func:`attnkit.attention`
    or a layer.

    Raises:
        ValueError: from ``&`` / ``|``: masks describing different numbers of sequences (other than 1),
            a union that would give rows more than two key ranges, or more than one ``varlen(...)``.

    Example:

        >>> import torch
        >>> import attnkit
        >>> from attnkit import masks
        >>> mask = masks.sliding_window(3) & masks.document([4, 4])
        >>> mask
        sliding_window(3) & document([4, 4])
        >>> print(mask.to_string(8, block_size=4))  # 4 x 4 blocks: "+" partly allowed, "." skipped
        + .
        . +
        >>> q, k, v = (torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
        >>> out = attnkit.attention(q, k, v, mask=mask)
        >>> torch.allclose(out, attnkit.attention(q, k, v, mask=mask.dense(8)), atol=1e-6)
        True
    """

    #: Number of sequences the mask describes, or None when it is the same for all of them.
    batch_size: int | None = None
    #: True only for ``causal()`` itself, which dense paths can pass as ``causal=True`` instead.
    is_causal: bool = False

    def bounds(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Keys ``lo <= j < hi`` for each query at ``positions`` (int64 ``[n]``, or ``[B, n]`` in a
        variable-length batch; key coordinates, may be negative). Returns ``lo, hi`` broadcastable
        to ``[n]``, or ``[B, n]`` for per-sequence masks; not clipped to the key range.

        Raises:
            NotImplementedError: in the base class (each mask implements it).

        Example:

            >>> import torch
            >>> from attnkit import masks
            >>> lo, hi = masks.sliding_window(3).bounds(torch.arange(5))  # p - 3 < j <= p
            >>> lo, hi
            (tensor([-2, -1,  0,  1,  2]), tensor([1, 2, 3, 4, 5]))
            >>> masks.document([2, 3]).bounds(torch.arange(5))
            (tensor([0, 0, 2, 2, 2]), tensor([2, 2, 5, 5, 5]))
        """
        raise NotImplementedError

    def ranges(self, positions: Tensor, rows: Tensor) -> list[tuple[Tensor, Tensor]]:
        """The rows' key intervals, one ``(lo, hi)`` pair per range (at most two,
        ``attnkit.masks.structured.MAX_RANGES``), each broadcastable to ``positions``' shape as in
        :meth:`~attnkit.masks.StructuredMask.bounds` and not clipped to the key range.
        ``positions``: int64 ``[n]`` (or ``[B, n]``) key coordinates of the queries; ``rows``: their
        query indices ``[n]`` (masks given per row use them).

        Example:

            >>> import torch
            >>> from attnkit import masks
            >>> sinks_and_window = masks.sliding_window(2) | masks.first_keys(1)
            >>> rows = torch.arange(5)
            >>> for lo, hi in sinks_and_window.ranges(rows, rows):  # positions = rows when Lq = Lk
            ...     print(lo.tolist(), hi.tolist())
            [-1, 0, 0, 0, 0] [1, 2, 3, 1, 1]
            [0, 0, 0, 2, 3] [0, 0, 0, 4, 5]
        """
        return [self.bounds(positions)]

    def aligner(self) -> _Varlen | None:
        """The ``varlen`` part that sets each sequence's alignment, if any.

        Returns:
            The ``varlen(...)`` mask (see :func:`attnkit.masks.varlen`) this mask holds, or ``None``
            (every query then aligns bottom-right with the padded lengths).

        Example:

            >>> from attnkit import masks
            >>> (masks.varlen([3, 5]) & masks.causal()).aligner()
            varlen([3, 5])
            >>> masks.causal().aligner() is None
            True
        """
        return None

    # -- derived views -------------------------------------------------------------------------

    def row_ranges(self, q_len: int, k_len: int | None = None, *,
                   device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
        """``lo, hi`` (int64, ``[S, R, Lq]``: S = 1 or one per sequence, R = 1 or 2 ranges) clipped
        to ``[0, Lk]``, the ranges of a row disjoint and in order: query ``i`` of sequence ``s`` may
        attend keys ``lo[s, r, i] <= j < hi[s, r, i]`` for each ``r``.

        Args:
            q_len: ``Lq``, the number of queries.
            k_len: ``Lk``, the number of keys; default ``q_len``.
            device: where to compute the ranges.

        Raises:
            ValueError: a negative length, or a mask that does not fit the call (``key_ranges`` made for
                another number of query rows).

        Example:

            >>> from attnkit import masks
            >>> lo, hi = masks.padding([2, 4]).row_ranges(3, 4)  # 2 sequences, 1 range a row
            >>> lo.shape
            torch.Size([2, 1, 3])
            >>> hi[:, 0]
            tensor([[2, 2, 2],
                    [4, 4, 4]])
            >>> lo, hi = (masks.sliding_window(2) | masks.first_keys(1)).row_ranges(5)  # 2 ranges a row
            >>> print(lo[0].tolist(), hi[0].tolist())
            [[0, 0, 0, 0, 0], [0, 0, 0, 2, 3]] [[1, 2, 3, 1, 1], [0, 0, 0, 4, 5]]
        """
        k_len = q_len if k_len is None else k_len
        _check_lengths(q_len, k_len)
        rows = torch.arange(q_len, device=device, dtype=torch.int64)
        aligner = self.aligner()
        positions = rows + (k_len - q_len) if aligner is None else aligner.positions(rows, k_len)
        parts = [(lo.clamp(0, k_len), hi.clamp(0, k_len)) for lo, hi in self.ranges(positions, rows)]
        # broadcast_tensors, not broadcast_shapes: the latter imports sympy on first use (~1.5 s)
        expanded = torch.broadcast_tensors(*(t for pair in parts for t in pair), rows)[:-1]
        lo = torch.stack(expanded[0::2], dim=-2)
        hi = torch.stack(expanded[1::2], dim=-2)
        return (lo[None], hi[None]) if lo.dim() == 2 else (lo, hi)

    def row_bounds(self, q_len: int, k_len: int | None = None, *,
                   device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
        """``lo, hi`` (int64, ``[Lq]`` or ``[B, Lq]``) clipped to ``[0, Lk]`` for a mask of one range
        per row: query ``i`` may attend keys ``lo[i] <= j < hi[i]``; the row is empty when
        ``lo[i] >= hi[i]``. A mask with two ranges a row raises; use
        :meth:`~attnkit.masks.StructuredMask.row_ranges`.

        Args:
            q_len: ``Lq``, the number of queries.
            k_len: ``Lk``, the number of keys; default ``q_len``.
            device: where to compute the bounds.

        Raises:
            ValueError: a mask with two key ranges a row, or a negative length.

        Example:

            >>> from attnkit import masks
            >>> masks.causal().row_bounds(3, 5)  # bottom-right: the last query sees every key
            (tensor([0, 0, 0]), tensor([3, 4, 5]))
            >>> masks.padding([2, 4]).row_bounds(2, 4)
            (tensor([[0, 0],
                    [0, 0]]), tensor([[2, 2],
                    [4, 4]]))
        """
        lo, hi = self.row_ranges(q_len, k_len, device=device)
        if lo.shape[1] != 1:
            raise ValueError(f"{self!r} gives rows two key ranges; row_bounds describes one: use row_ranges")
        lo, hi = lo[:, 0], hi[:, 0]
        return (lo[0], hi[0]) if self.batch_size is None else (lo, hi)

    def dense(self, q_len: int, k_len: int | None = None, *, ndim: int = 4,
              device: torch.device | str | None = None) -> Tensor:
        """The boolean mask (True = may attend): ``[Lq, Lk]``, or ``[B, 1, ..., Lq, Lk]`` with
        ``ndim`` dims for per-sequence masks (``ndim=4`` broadcasts against ``[B, H, Lq, Lk]``).

        Args:
            q_len: ``Lq``, the number of queries.
            k_len: ``Lk``, the number of keys; default ``q_len``.
            ndim: the dims of a per-sequence mask's dense form (at least 3, or 2 for one sequence).
            device: where to create the mask.

        Raises:
            ValueError: ``ndim < 3`` for a mask of several sequences, or a negative length.

        Example:

            >>> import torch
            >>> from attnkit import masks
            >>> torch.equal(masks.causal().dense(2, 4), masks.causal_mask(2, 4))
            True
            >>> masks.padding([2, 4]).dense(3, 4).shape
            torch.Size([2, 1, 3, 4])
            >>> masks.padding([2, 4]).dense(3, 4, ndim=3).shape
            torch.Size([2, 3, 4])
        """
        k_len = q_len if k_len is None else k_len
        lo, hi = self.row_ranges(q_len, k_len, device=device)
        keys = torch.arange(k_len, device=lo.device)
        allowed = ((keys >= lo[..., None]) & (keys < hi[..., None])).any(1)  # [S, Lq, Lk]
        if self.batch_size is None:
            return allowed[0]
        if ndim == 2 and allowed.shape[0] == 1:
            return allowed[0]
        if ndim < 3:
            raise ValueError(
                f"{self!r} holds {allowed.shape[0]} sequences; its dense form needs ndim >= 3 "
                f"([B, ..., Lq, Lk]), got ndim={ndim}"
            )
        return allowed.reshape(allowed.shape[0], *([1] * (ndim - 3)), q_len, k_len)

    def to_string(self, q_len: int, k_len: int | None = None, *, block_size: int | None = None) -> str:
        """Draw the mask as text, one line per query (``#`` may attend, ``.`` may not), or with
        ``block_size`` one character per block: ``#`` all allowed, ``+`` partly, ``.`` skipped.
        Per-sequence masks draw each sequence under a ``sequence b:`` heading.

        Args:
            q_len: ``Lq``, the number of queries.
            k_len: ``Lk``, the number of keys; default ``q_len``.
            block_size: draw blocks of ``block_size`` queries by ``block_size`` keys.

        Raises:
            ValueError: ``block_size < 1``, or a negative length.

        Example:

            >>> from attnkit import masks
            >>> print(masks.causal().to_string(3, 5))
            # # # . .
            # # # # .
            # # # # #
            >>> print(masks.causal().to_string(8, block_size=4))  # "#" all allowed, "+" partly
            + .
            # +
            >>> print(masks.padding([2, 3]).to_string(2, 4))
            sequence 0:
            # # . .
            # # . .
            sequence 1:
            # # # .
            # # # .
        """
        k_len = q_len if k_len is None else k_len
        lo, hi = self.row_ranges(q_len, k_len)
        if self.batch_size is None:
            return _draw(lo[0], hi[0], k_len, block_size)
        return "\n".join(f"sequence {b}:\n{_draw(lo[b], hi[b], k_len, block_size)}" for b in range(lo.shape[0]))

    def __and__(self, other: StructuredMask) -> StructuredMask:
        if not isinstance(other, StructuredMask):
            return NotImplemented
        return _Intersection(self, other)

    def __or__(self, other: StructuredMask) -> StructuredMask:
        if not isinstance(other, StructuredMask):
            return NotImplemented
        return _Union(self, other)


def _check_lengths(q_len: int, k_len: int) -> None:
    if q_len < 0 or k_len < 0:
        raise ValueError(f"lengths must be non-negative, got q_len={q_len}, k_len={k_len}")


def _draw(lo: Tensor, hi: Tensor, k_len: int, block_size: int | None) -> str:
    """Draw the rows of ``lo, hi [R, Lq]`` (R ranges a row, disjoint)."""
    if block_size is None:
        keys = torch.arange(k_len)
        return _draw_dense(((keys >= lo[..., None]) & (keys < hi[..., None])).any(0))
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    lines = []
    for q0 in range(0, lo.shape[-1], block_size):
        rows_lo, rows_hi = lo[:, q0:q0 + block_size, None], hi[:, q0:q0 + block_size, None]
        k0 = torch.arange(0, k_len, block_size)
        k1 = (k0 + block_size).clamp(max=k_len)
        # allowed pairs of each (query block, key block), counted from the intervals
        count = (torch.minimum(rows_hi, k1) - torch.maximum(rows_lo, k0)).clamp(min=0).sum((0, 1))
        area = (k1 - k0) * rows_lo.shape[1]
        lines.append(" ".join("#" if c == a else "." if c == 0 else "+" for c, a in zip(count.tolist(), area.tolist())))
    return "\n".join(lines)


# -- the masks -----------------------------------------------------------------------------------


class _Causal(StructuredMask):
    is_causal = True

    def bounds(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return torch.zeros_like(positions), positions + 1

    def __repr__(self) -> str:
        return "causal()"


class _SlidingWindow(StructuredMask):
    """Keys ``p - left <= j <= p + right`` (FlashAttention's ``window_size``; None: unbounded)."""

    def __init__(self, left: int | None, right: int | None, spelled: str) -> None:
        self.left, self.right, self.spelled = left, right, spelled

    def bounds(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        unbounded = 2**62
        lo = positions - self.left if self.left is not None else torch.full_like(positions, -unbounded)
        hi = positions + self.right + 1 if self.right is not None else torch.full_like(positions, unbounded)
        return lo, hi

    def __repr__(self) -> str:
        return self.spelled


def _per_sequence(values: Tensor, positions: Tensor) -> Tensor:
    """``[B]`` values broadcast along the query positions (``[n]``, or ``[B, n]``): ``[B, n]``."""
    return values.to(positions.device)[:, None].expand(values.shape[0], positions.shape[-1])


class _PrefixLM(StructuredMask):
    def __init__(self, prefix: int | Tensor) -> None:
        self.prefix = prefix
        self.batch_size = None if isinstance(prefix, int) else prefix.shape[0]

    def bounds(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        prefix = self.prefix if isinstance(self.prefix, int) else _per_sequence(self.prefix, positions)
        hi = torch.maximum(positions + 1, torch.as_tensor(prefix, device=positions.device))
        return torch.zeros_like(hi), hi

    def __repr__(self) -> str:
        shown = self.prefix if isinstance(self.prefix, int) else self.prefix.tolist()
        return f"prefix_lm({shown})"


class _Padding(StructuredMask):
    def __init__(self, lengths: Tensor) -> None:
        self.lengths = lengths
        self.batch_size = lengths.shape[0]

    def bounds(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        hi = _per_sequence(self.lengths, positions)
        return torch.zeros_like(hi), hi

    def __repr__(self) -> str:
        return f"padding({self.lengths.tolist()})"


class _Document(StructuredMask):
    """Packed documents: a query attends the keys of its own document. ``edges [S, D + 1]`` (S = 1
    shared, or one per sequence) hold each document's first position and, last, ``length``:
    document ``d`` spans ``edges[s, d] <= t < edges[s, d + 1]`` (a sequence with fewer documents
    repeats ``length``: empty documents). O(number of documents) memory, whatever ``length``."""

    def __init__(self, edges: Tensor, length: int, batched: bool, description: str) -> None:
        self.description = description
        self.edges = edges
        self.length = length
        self.batch_size = edges.shape[0] if batched else None

    @classmethod
    def from_lengths(cls, sizes: Tensor, description: str) -> _Document:
        edges = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.to(torch.int64).cumsum(0)])
        return cls(edges[None], int(edges[-1]), False, description)

    @classmethod
    def from_ids(cls, ids: Tensor, description: str) -> _Document:
        batched = ids.dim() == 2
        ids2 = ids if batched else ids[None]
        length = ids2.shape[1]
        first = torch.ones_like(ids2, dtype=torch.bool)  # position starts a run
        first[:, 1:] = ids2[:, 1:] != ids2[:, :-1]
        runs = []
        for b in range(ids2.shape[0]):
            if int(first[b].sum()) != ids2[b].unique().numel():
                raise ValueError(
                    f"document ids must label contiguous runs (packed sequences); sequence {b} "
                    f"reuses an id after another: {ids2[b].tolist()}"
                )
            runs.append(first[b].nonzero()[:, 0])
        count = max((r.numel() for r in runs), default=0)
        edges = torch.full((ids2.shape[0], count + 1), length, dtype=torch.int64)
        for b, starts in enumerate(runs):
            edges[b, :starts.numel()] = starts
        return cls(edges, length, batched, description)

    def bounds(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        # Positions outside the packed sequence belong to no document: empty rows.
        inside = (positions >= 0) & (positions < self.length)
        edges = self.edges.to(positions.device)
        rows = edges.shape[0]
        lead = positions if positions.dim() == 2 else positions.expand(rows, positions.shape[-1])
        if edges.shape[1] == 1:  # no document at all
            zeros = torch.zeros_like(lead if self.batch_size is not None or positions.dim() == 2 else positions)
            return zeros, zeros
        if lead.shape[0] != rows:  # per-sequence positions, one shared packing
            edges = edges.expand(lead.shape[0], -1).contiguous()
        # the document holding t: the last edge <= t (empty documents repeat an edge and are skipped)
        index = torch.searchsorted(edges, lead.contiguous(), right=True).clamp(1, edges.shape[1] - 1) - 1
        starts, stops = edges.gather(1, index), edges.gather(1, index + 1)
        if positions.dim() == 1 and self.batch_size is None:
            starts, stops = starts[0], stops[0]
        return torch.where(inside, starts, 0), torch.where(inside, stops, 0)

    def __repr__(self) -> str:
        return f"document({self.description})"


def _same_batch(parts: Sequence[StructuredMask], joined: str) -> int | None:
    sizes = {p.batch_size for p in parts if p.batch_size not in (None, 1)}
    if len(sizes) > 1:
        raise ValueError(f"cannot combine masks describing different numbers of sequences {sorted(sizes)}: "
                         + joined.join(map(repr, parts)))
    batched = [p.batch_size for p in parts if p.batch_size is not None]
    return max(batched) if batched else None


def _disjoint(first: tuple[Tensor, Tensor], second: tuple[Tensor, Tensor]) -> list[tuple[Tensor, Tensor]]:
    """The union of two intervals per row as two disjoint ones in order (the second empty where
    they overlap or touch, or one is empty)."""
    (a0, a1), (b0, b1) = first, second
    a_empty, b_empty = a0 >= a1, b0 >= b1
    joined = (torch.maximum(a0, b0) <= torch.minimum(a1, b1)) & ~a_empty & ~b_empty
    a_first = a0 <= b0
    lo1 = torch.where(b_empty | (~a_empty & a_first), a0, b0)
    hi1 = torch.where(b_empty | (~a_empty & a_first), a1, b1)
    lo2 = torch.where(b_empty | (~a_empty & a_first), b0, a0)
    hi2 = torch.where(b_empty | (~a_empty & a_first), b1, a1)
    lo1, hi1 = torch.where(joined, torch.minimum(a0, b0), lo1), torch.where(joined, torch.maximum(a1, b1), hi1)
    lo2 = torch.where(joined | a_empty | b_empty, 0, lo2)
    hi2 = torch.where(joined | a_empty | b_empty, 0, hi2)
    return [(lo1, hi1), (lo2, hi2)]


class _Intersection(StructuredMask):
    def __init__(self, *parts: StructuredMask) -> None:
        flat: list[StructuredMask] = []
        for part in parts:
            flat.extend(part.parts if isinstance(part, _Intersection) else [part])
        self.batch_size = _same_batch(flat, " & ")
        aligners = [p.aligner() for p in flat if p.aligner() is not None]
        if len(aligners) > 1:
            raise ValueError("an intersection takes at most one varlen(...): " + " & ".join(map(repr, flat)))
        if sum(isinstance(p, _Union) for p in flat) > 1:
            raise ValueError(f"rows would get more than {MAX_RANGES} key ranges: " + " & ".join(map(repr, flat)))
        self.parts = tuple(flat)

    def aligner(self) -> _Varlen | None:
        return next((p.aligner() for p in self.parts if p.aligner() is not None), None)

    def ranges(self, positions: Tensor, rows: Tensor) -> list[tuple[Tensor, Tensor]]:
        result = self.parts[0].ranges(positions, rows)
        for part in self.parts[1:]:  # intersect every range with every range: one side has one
            result = [(torch.maximum(lo, other_lo), torch.minimum(hi, other_hi))
                      for lo, hi in result for other_lo, other_hi in part.ranges(positions, rows)]
        return result

    def bounds(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        (lo, hi), = self.ranges(positions, positions)
        return lo, hi

    def __repr__(self) -> str:
        return " & ".join(map(_grouped, self.parts))


class _Union(StructuredMask):
    def __init__(self, first: StructuredMask, second: StructuredMask) -> None:
        for part in (first, second):
            if isinstance(part, _Union) or (isinstance(part, _Intersection) and any(
                    isinstance(p, _Union) for p in part.parts)):
                raise ValueError(f"rows would get more than {MAX_RANGES} key ranges: {first!r} | {second!r}")
            if part.aligner() is not None:
                raise ValueError(f"varlen(...) sets the alignment of a whole mask: intersect it (&), "
                                 f"not a union: {first!r} | {second!r}")
        self.parts = (first, second)
        self.batch_size = _same_batch(self.parts, " | ")

    def ranges(self, positions: Tensor, rows: Tensor) -> list[tuple[Tensor, Tensor]]:
        (first,), (second,) = (part.ranges(positions, rows) for part in self.parts)
        return _disjoint(first, second)

    def __repr__(self) -> str:
        return " | ".join(map(_grouped, self.parts))


def _grouped(mask: StructuredMask) -> str:
    return f"({mask!r})" if isinstance(mask, (_Intersection, _Union)) else repr(mask)


class _FirstKeys(StructuredMask):
    def __init__(self, count: int) -> None:
        self.count = count

    def bounds(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return torch.zeros_like(positions), torch.full_like(positions, self.count)

    def __repr__(self) -> str:
        return f"first_keys({self.count})"


class _KeyRanges(StructuredMask):
    """Explicit ranges per query row: one or two ``(lo, hi)`` pairs, each ``[Lq]`` or ``[B, Lq]``."""

    def __init__(self, pairs: list[tuple[Tensor, Tensor]]) -> None:
        self.pairs = pairs
        shapes = {tuple(t.shape) for pair in pairs for t in pair}
        self.rows = max(shape[-1] for shape in shapes)
        batched = [shape[0] for shape in shapes if len(shape) == 2]
        self.batch_size = max(batched) if batched else None

    def ranges(self, positions: Tensor, rows: Tensor) -> list[tuple[Tensor, Tensor]]:
        if self.rows != rows.shape[-1]:
            raise ValueError(f"{self!r} describes {self.rows} query rows, the call has {rows.shape[-1]}")
        pairs = [(lo.to(rows.device), hi.to(rows.device)) for lo, hi in self.pairs]
        return pairs if len(pairs) == 1 else _disjoint(*pairs)

    def __repr__(self) -> str:
        return f"key_ranges({len(self.pairs)} range{'s' if len(self.pairs) > 1 else ''} per row, {self.rows} rows)"


class _Varlen(StructuredMask):
    """Sequence ``b`` has ``q_lengths[b]`` real queries and ``k_lengths[b]`` real keys, at the start
    of its row (right padding); its queries are aligned bottom-right with its own keys."""

    def __init__(self, q_lengths: Tensor, k_lengths: Tensor) -> None:
        self.q_lengths, self.k_lengths = q_lengths, k_lengths
        self.batch_size = q_lengths.shape[0]

    def aligner(self) -> _Varlen:
        return self

    def positions(self, rows: Tensor, k_len: int) -> Tensor:
        """``[B, Lq]``: query ``i`` of sequence ``b`` sits at ``i + Lk_b - Lq_b``."""
        shift = (self.k_lengths - self.q_lengths).to(rows.device)
        return rows[None] + shift[:, None]

    def ranges(self, positions: Tensor, rows: Tensor) -> list[tuple[Tensor, Tensor]]:
        real = rows[None] < self.q_lengths.to(rows.device)[:, None]
        hi = torch.where(real, self.k_lengths.to(rows.device)[:, None], 0)
        return [(torch.zeros_like(hi), hi)]

    def __repr__(self) -> str:
        if torch.equal(self.q_lengths, self.k_lengths):
            return f"varlen({self.q_lengths.tolist()})"
        return f"varlen({self.q_lengths.tolist()}, {self.k_lengths.tolist()})"
