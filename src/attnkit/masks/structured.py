"""Structured masks: small rules instead of ``Lq x Lk`` tensors, so attention can skip work.

Each mask here gives every query row **one interval of keys** it may attend,
``lo <= key < hi`` (empty when ``lo >= hi``). That covers causal, sliding windows, packed
documents, prefix-LM and key padding, and it is closed under intersection (``&``: the larger
``lo``, the smaller ``hi``). Two numbers per row describe the whole mask in O(L) memory, and a
block of queries can tell at once which keys are attended by **all** of its rows (no mask
needed there), which by **some** (a small dense mask), and which by none (skipped)::

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

Masks made from per-sequence data (``padding(lengths)``, ``document(ids=[B, T])``,
``prefix_lm([B])``) have a ``batch_size``; their dense form is ``[B, 1, Lq, Lk]`` and broadcasts
against ``[B, H, Lq, Lk]`` scores. The others are the same for every sequence: ``[Lq, Lk]``.
Boolean forms mean **True = may attend**, as everywhere in attnkit.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from . import _integers
from .dense import to_string as _draw_dense

__all__ = [
    "StructuredMask",
    "causal",
    "sliding_window",
    "document",
    "prefix_lm",
    "padding",
]


class StructuredMask:
    """A mask given by one key interval ``[lo, hi)`` per query row. Combine with ``&``.

    Subclasses implement :meth:`bounds`; everything else (dense form, key ranges of a block,
    drawing) follows from it.
    """

    #: Number of sequences the mask describes, or None when it is the same for all of them.
    batch_size: int | None = None
    #: True only for ``causal()`` itself, which dense paths can pass as ``causal=True`` instead.
    is_causal: bool = False

    def bounds(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Keys ``lo <= j < hi`` for each query at ``positions`` (int64 ``[n]``, key coordinates,
        may be negative). Returns ``lo, hi`` shaped ``[n]``, or ``[B, n]`` for per-sequence masks;
        not clipped to the key range."""
        raise NotImplementedError

    # -- derived views -------------------------------------------------------------------------

    def row_bounds(self, q_len: int, k_len: int | None = None, *,
                   device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
        """``lo, hi`` (int64, ``[Lq]`` or ``[B, Lq]``) clipped to ``[0, Lk]``: query ``i`` may attend
        keys ``lo[i] <= j < hi[i]``; the row is empty when ``lo[i] >= hi[i]``."""
        k_len = q_len if k_len is None else k_len
        _check_lengths(q_len, k_len)
        positions = torch.arange(q_len, device=device, dtype=torch.int64) + (k_len - q_len)
        lo, hi = self.bounds(positions)
        return lo.clamp(0, k_len), hi.clamp(0, k_len)

    def dense(self, q_len: int, k_len: int | None = None, *, ndim: int = 4,
              device: torch.device | str | None = None) -> Tensor:
        """The boolean mask (True = may attend): ``[Lq, Lk]``, or ``[B, 1, ..., Lq, Lk]`` with
        ``ndim`` dims for per-sequence masks (``ndim=4`` broadcasts against ``[B, H, Lq, Lk]``)."""
        k_len = q_len if k_len is None else k_len
        lo, hi = self.row_bounds(q_len, k_len, device=device)
        keys = torch.arange(k_len, device=lo.device)
        allowed = (keys >= lo[..., None]) & (keys < hi[..., None])
        if lo.dim() == 1:
            return allowed
        if ndim == 2 and lo.shape[0] == 1:
            return allowed[0]
        if ndim < 3:
            raise ValueError(
                f"{self!r} holds {lo.shape[0]} sequences; its dense form needs ndim >= 3 "
                f"([B, ..., Lq, Lk]), got ndim={ndim}"
            )
        return allowed.reshape(allowed.shape[0], *([1] * (ndim - 3)), q_len, k_len)

    def to_string(self, q_len: int, k_len: int | None = None, *, block_size: int | None = None) -> str:
        """Draw the mask as text, one line per query (``#`` may attend, ``.`` may not), or with
        ``block_size`` one character per block: ``#`` all allowed, ``+`` partly, ``.`` skipped.
        Per-sequence masks draw each sequence under a ``sequence b:`` heading."""
        k_len = q_len if k_len is None else k_len
        lo, hi = self.row_bounds(q_len, k_len)
        if lo.dim() == 1:
            return _draw(lo, hi, k_len, block_size)
        return "\n".join(f"sequence {b}:\n{_draw(lo[b], hi[b], k_len, block_size)}" for b in range(lo.shape[0]))

    def __and__(self, other: StructuredMask) -> StructuredMask:
        if not isinstance(other, StructuredMask):
            return NotImplemented
        return _Intersection(self, other)


def _check_lengths(q_len: int, k_len: int) -> None:
    if q_len < 0 or k_len < 0:
        raise ValueError(f"lengths must be non-negative, got q_len={q_len}, k_len={k_len}")


def _draw(lo: Tensor, hi: Tensor, k_len: int, block_size: int | None) -> str:
    if block_size is None:
        keys = torch.arange(k_len)
        return _draw_dense((keys >= lo[:, None]) & (keys < hi[:, None]))
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    lines = []
    for q0 in range(0, lo.shape[0], block_size):
        rows_lo, rows_hi = lo[q0:q0 + block_size, None], hi[q0:q0 + block_size, None]
        k0 = torch.arange(0, k_len, block_size)
        k1 = (k0 + block_size).clamp(max=k_len)
        # allowed pairs of each (query block, key block), counted from the intervals
        count = (torch.minimum(rows_hi, k1) - torch.maximum(rows_lo, k0)).clamp(min=0).sum(0)
        area = (k1 - k0) * rows_lo.shape[0]
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
    def __init__(self, size: int, causal: bool) -> None:
        self.size, self.causal = size, causal

    def bounds(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        lo = positions - self.size + 1
        hi = positions + 1 if self.causal else positions + self.size
        return lo, hi

    def __repr__(self) -> str:
        return f"sliding_window({self.size})" if self.causal else f"sliding_window({self.size}, causal=False)"


def _per_sequence(values: Tensor, positions: Tensor) -> Tensor:
    """``[B]`` values -> ``[B, n]`` (broadcast along the query positions)."""
    return values.to(positions.device)[:, None].expand(-1, positions.shape[0])


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
    """Packed documents: a query attends the keys of its own document. ``starts``/``stops``
    hold, for every position ``t < T``, the first and one-past-last position of its document."""

    def __init__(self, ids: Tensor, description: str) -> None:
        self.description = description
        batched = ids.dim() == 2
        ids2 = ids if batched else ids[None]
        length = ids2.shape[1]
        positions = torch.arange(length).expand_as(ids2)
        first = torch.ones_like(ids2, dtype=torch.bool)  # position starts a run
        first[:, 1:] = ids2[:, 1:] != ids2[:, :-1]
        last = torch.ones_like(ids2, dtype=torch.bool)  # position ends a run
        last[:, :-1] = first[:, 1:]
        for b in range(ids2.shape[0]):
            if int(first[b].sum()) != ids2[b].unique().numel():
                raise ValueError(
                    f"document ids must label contiguous runs (packed sequences); sequence {b} "
                    f"reuses an id after another: {ids2[b].tolist()}"
                )
        starts = torch.where(first, positions, 0).cummax(1).values
        stops = torch.where(last, positions + 1, length).flip(1).cummin(1).values.flip(1)
        self.starts = starts if batched else starts[0]
        self.stops = stops if batched else stops[0]
        self.length = length
        self.batch_size = ids2.shape[0] if batched else None

    def bounds(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        # Positions outside the packed sequence belong to no document: empty rows.
        inside = (positions >= 0) & (positions < self.length)
        index = positions.clamp(0, max(self.length - 1, 0))
        starts, stops = self.starts.to(positions.device), self.stops.to(positions.device)
        if self.length == 0:
            starts = stops = torch.zeros(*starts.shape[:-1], 1, dtype=torch.int64, device=positions.device)
        return torch.where(inside, starts[..., index], 0), torch.where(inside, stops[..., index], 0)

    def __repr__(self) -> str:
        return f"document({self.description})"


class _Intersection(StructuredMask):
    def __init__(self, *parts: StructuredMask) -> None:
        flat: list[StructuredMask] = []
        for part in parts:
            flat.extend(part.parts if isinstance(part, _Intersection) else [part])
        sizes = {p.batch_size for p in flat if p.batch_size not in (None, 1)}
        if len(sizes) > 1:
            raise ValueError(
                f"cannot intersect masks describing different numbers of sequences {sorted(sizes)}: "
                + " & ".join(map(repr, flat))
            )
        self.parts = tuple(flat)
        batched = [p.batch_size for p in flat if p.batch_size is not None]
        self.batch_size = max(batched) if batched else None

    def bounds(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        lo, hi = self.parts[0].bounds(positions)
        for part in self.parts[1:]:
            other_lo, other_hi = part.bounds(positions)
            lo, hi = torch.maximum(lo, other_lo), torch.minimum(hi, other_hi)
        return lo, hi

    def __repr__(self) -> str:
        return " & ".join(map(repr, self.parts))


# -- constructors (the public names) -------------------------------------------------------------


def _int_or_lengths(name: str, value: object) -> int | Tensor:
    """An int, or per-sequence ints ``[B]`` as the mask's own int64 tensor; each in ``[0, 2**62]``."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return _integers.integer(name, value)
    return _integers.integers(name, value, expected="an int or a 1-D sequence of ints [B]")


def causal() -> StructuredMask:
    """Query at position ``p`` sees keys ``j <= p`` (**bottom-right** aligned when ``Lq != Lk``)::

        Lq = 3, Lk = 5       Lq = 4, Lk = 2
        # # # . .            . .   <- no key: zeros
        # # # # .            . .
        # # # # #            # .
                             # #
    """
    return _Causal()


def sliding_window(size: int, *, causal: bool = True) -> StructuredMask:
    """Local attention. ``causal=True``: position ``p`` sees the ``size`` most recent keys,
    ``p - size < j <= p`` (itself included). ``causal=False``: keys with ``|j - p| < size``
    (``size - 1`` on each side). ``sliding_window(3)`` and ``sliding_window(2, causal=False)``::

        # . . . .        # # . . .
        # # . . .        # # # . .
        # # # . .        . # # # .
        . # # # .        . . # # #
        . . # # #        . . . # #
    """
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    return _SlidingWindow(_integers.integer("size", size, minimum=1), causal)


def document(lengths: Sequence[int] | Tensor | None = None, *, ids: Tensor | None = None) -> StructuredMask:
    """Packed documents: a query attends only the keys of its own document.

    Give the documents' ``lengths`` (one packing shared by every sequence, e.g. ``[3, 5, 2]``),
    or ``ids``: ``[T]`` or per sequence ``[B, T]`` integer labels, equal within a document
    (documents are contiguous runs). Positions beyond ``T`` belong to no document. Combine
    with ``causal()`` for packed causal language modelling. ``document([2, 3])``::

        # # . . .
        # # . . .
        . . # # #
        . . # # #
        . . # # #
    """
    if (lengths is None) == (ids is None):
        raise TypeError("document() takes either lengths (positional) or ids=..., exactly one of them")
    if lengths is not None:
        sizes = _integers.integers("lengths", lengths, expected="a 1-D sequence of ints (one per document)")
        total = sum(sizes.tolist())  # in Python: an int64 sum could wrap around
        if total > _integers.LIMIT:
            raise ValueError(f"lengths must sum to at most 2**62 positions, got {total}")
        labels = torch.repeat_interleave(torch.arange(sizes.numel()), sizes.cpu())
        return _Document(labels, f"{sizes.tolist()}")
    labels = _integers.integers("ids", ids, ndims=(1, 2), minimum=None, maximum=None,
                                expected="an integer tensor [T] or [B, T]")
    return _Document(labels.cpu(), f"ids={labels.tolist()}" if labels.numel() <= 16
                     else f"ids of shape {tuple(labels.shape)}")


def prefix_lm(prefix_length: int | Sequence[int] | Tensor) -> StructuredMask:
    """Prefix-LM: every query sees the first ``prefix_length`` keys (bidirectional prefix) and,
    beyond it, keys up to its own position (causal). An int, or one length per sequence ``[B]``.
    ``prefix_lm(2)``::

        # # . . .
        # # . . .
        # # # . .
        # # # # .
        # # # # #
    """
    return _PrefixLM(_int_or_lengths("prefix_length", prefix_length))


def padding(lengths: int | Sequence[int] | Tensor) -> StructuredMask:
    """Key padding: sequence ``b`` has ``lengths[b]`` real keys, the rest are padding and never
    attended. ``lengths`` is ``[B]`` (or one int for all sequences). ``padding([3])`` on 3 x 5::

        # # # . .
        # # # . .
        # # # . .
    """
    value = _int_or_lengths("lengths", lengths)
    if isinstance(value, int):
        value = torch.tensor([value])
    return _Padding(value)
