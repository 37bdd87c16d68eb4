"""The structured masks by name: ``causal()``, ``sliding_window(...)``, ``document(...)``,
``prefix_lm(...)``, ``padding(...)``, ``first_keys(...)``, ``key_ranges(...)`` and ``varlen(...)``,
each checking its arguments and returning a :class:`attnkit.masks.StructuredMask` (the rules and
their algebra live in :mod:`attnkit.masks.structured`). Combine them with ``&`` and ``|``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from . import _integers
from .structured import StructuredMask, _Causal, _SlidingWindow, _PrefixLM, _Padding, _Document, _FirstKeys, _KeyRanges, _Varlen, MAX_RANGES

__all__ = ["causal", "sliding_window", "document", "prefix_lm", "padding", "first_keys", "key_ranges", "varlen"]


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

    Returns:
        The mask (``is_causal`` is True: dense paths run it as ``causal=True``).

    Example:

        >>> import torch
        >>> import attnkit
        >>> from attnkit import masks
        >>> q, k, v = (torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
        >>> torch.allclose(attnkit.attention(q, k, v, mask=masks.causal()),
        ...                attnkit.attention(q, k, v, causal=True), atol=1e-6)
        True
        >>> print(masks.causal().to_string(2, 4))
        # # # .
        # # # #
    """
    return _Causal()


def sliding_window(size: int, right: int | None = None, *, causal: bool | None = None) -> StructuredMask:
    """Local attention, in two spellings.

    ``sliding_window(size)`` (``causal=True``, the default): position ``p`` sees the ``size`` most
    recent keys, ``p - size < j <= p`` (itself included). ``sliding_window(size, causal=False)``:
    keys with ``|j - p| < size`` (``size - 1`` on each side). ``sliding_window(3)`` and
    ``sliding_window(2, causal=False)``::

        # . . . .        # # . . .
        # # . . .        # # # . .
        # # # . .        . # # # .
        . # # # .        . . # # #
        . . # # #        . . . # #

    ``sliding_window(left, right)``: FlashAttention's ``window_size=(left, right)``, keys
    ``p - left <= j <= p + right``, ``-1`` for no bound on that side (``(-1, -1)`` is every key,
    ``(-1, 0)`` is causal). ``sliding_window(1, 2)`` and ``sliding_window(-1, 1)``, bottom-right
    aligned like everything here (``p = i + Lk - Lq``)::

        # # # . .        # # . . .
        # # # # .        # # # . .
        . # # # #        # # # # .
        . . # # #        # # # # #
        . . . # #        # # # # #

    Intersect with ``document(...)`` for windows inside packed documents, with ``varlen(...)`` for
    windows aligned to each sequence's own length.

    Args:
        size: the window (``>= 1``); or, with ``right``, the left reach ``left`` (``-1``: unbounded).
        right: the right reach (``-1``: unbounded); ``None`` for the ``size`` spelling.
        causal: with ``size`` alone: the default ``True`` (only past keys) or ``False`` (both sides).

    Raises:
        TypeError: a non-int reach, a non-bool ``causal``, or ``causal`` given with ``right``.
        ValueError: ``size < 1``, or a reach below ``-1``.

    Example:

        >>> import torch
        >>> from attnkit import masks
        >>> print(masks.sliding_window(2, causal=False).to_string(4))
        # # . .
        # # # .
        . # # #
        . . # #
        >>> torch.equal(masks.sliding_window(-1, 0).dense(4), masks.causal().dense(4))
        True
        >>> print((masks.sliding_window(2) & masks.document([2, 3])).to_string(5))
        # . . . .
        # # . . .
        . . # . .
        . . # # .
        . . . # #
    """
    if right is None:
        causal = True if causal is None else causal
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        size = _integers.integer("size", size, minimum=1)
        spelled = f"sliding_window({size})" if causal else f"sliding_window({size}, causal=False)"
        return _SlidingWindow(size - 1, 0 if causal else size - 1, spelled)
    if causal is not None:
        raise TypeError("sliding_window(left, right) takes no causal=: a right reach of 0 is causal")
    left = _integers.integer("left", size, minimum=-1)
    right = _integers.integer("right", right, minimum=-1)
    return _SlidingWindow(None if left == -1 else left, None if right == -1 else right,
                          f"sliding_window({left}, {right})")


def first_keys(count: int) -> StructuredMask:
    """Every query sees the first ``count`` keys: StreamingLLM's attention sinks as a mask rule.
    Unite it with a window and intersect with causal, ``(sliding_window(3) | first_keys(1)) &
    causal()``, two key ranges a row on 6 x 6::

        # . . . . .
        # # . . . .
        # # # . . .
        # # # # . .
        # . # # # .
        # . . # # #

    Args:
        count: how many keys, from the first one (``>= 0``).

    Raises:
        TypeError: a non-int ``count``.
        ValueError: a negative one.

    Example:

        >>> from attnkit import masks
        >>> streaming = (masks.sliding_window(2) | masks.first_keys(1)) & masks.causal()
        >>> streaming
        (sliding_window(2) | first_keys(1)) & causal()
        >>> print(streaming.to_string(5))
        # . . . .
        # # . . .
        # # # . .
        # . # # .
        # . . # #
    """
    return _FirstKeys(_integers.integer("count", count))


def key_ranges(lo: Tensor | Sequence[Tensor], hi: Tensor | Sequence[Tensor]) -> StructuredMask:
    """Explicit key ranges: query row ``i`` attends keys ``lo[i] <= j < hi[i]`` (``[Lq]``, or ``[B, Lq]``
    per sequence; clipped to the keys). For two ranges a row give two of each,
    ``key_ranges([lo1, lo2], [hi1, hi2])`` (their union is taken, so they may overlap). Rows are
    query rows, not positions: the mask fits calls with exactly ``Lq`` queries.
    ``key_ranges(torch.tensor([0, 0, 2]), torch.tensor([1, 3, 4]))`` on 3 x 4::

        # . . .
        # # # .
        . . # #

    Args:
        lo: the first key of each row's range, an integer tensor ``[Lq]`` or ``[B, Lq]`` (or a
            list of two for two ranges a row).
        hi: one past the last key of each row's range, shaped like ``lo``.

    Raises:
        TypeError: ``lo`` / ``hi`` not integer tensors of 1 or 2 dims.
        ValueError: other than one or two ranges, as many ``lo`` as ``hi``, or shapes that describe
            different rows; when used, a call with other than ``Lq`` queries.

    Example:

        >>> import torch
        >>> from attnkit import masks
        >>> mask = masks.key_ranges([torch.tensor([0, 0, 0]), torch.tensor([2, 3, 3])],
        ...                         [torch.tensor([1, 1, 1]), torch.tensor([3, 4, 5])])
        >>> mask
        key_ranges(2 ranges per row, 3 rows)
        >>> print(mask.to_string(3, 5))
        # . # . .
        # . . # .
        # . . # #
    """
    los = list(lo) if isinstance(lo, (list, tuple)) else [lo]
    his = list(hi) if isinstance(hi, (list, tuple)) else [hi]
    if len(los) != len(his) or not 1 <= len(los) <= MAX_RANGES:
        raise ValueError(f"key_ranges takes 1 or {MAX_RANGES} ranges a row, as many lo as hi; "
                         f"got {len(los)} lo and {len(his)} hi")
    expected = "an integer tensor [Lq] or [B, Lq]"
    pairs = [(_integers.integers("lo", a, ndims=(1, 2), minimum=None, maximum=None, expected=expected),
              _integers.integers("hi", b, ndims=(1, 2), minimum=None, maximum=None, expected=expected))
             for a, b in zip(los, his)]
    shapes = {tuple(t.shape) for pair in pairs for t in pair}
    if len({shape[-1] for shape in shapes}) != 1 or len({shape[0] for shape in shapes if len(shape) == 2}) > 1:
        raise ValueError(f"lo and hi must describe the same query rows, got shapes {sorted(shapes)}")
    return _KeyRanges(pairs)


def varlen(q_lengths: Sequence[int] | Tensor, k_lengths: Sequence[int] | Tensor | None = None) -> StructuredMask:
    """A variable-length batch, padded on the right: sequence ``b`` has ``q_lengths[b]`` real queries
    and ``k_lengths[b]`` real keys (default: the same). Padding rows attend nothing (zeros), padding
    keys are never attended, and, intersected with ``causal()`` or ``sliding_window(...)``, each
    sequence aligns bottom-right to **its own** lengths (FlashAttention's ``cu_seqlens``
    semantics), not to the padded ones. ``varlen([3, 5]) & causal()`` on 5 x 5::

        sequence 0:        sequence 1:
        # . . . .          # . . . .
        # # . . .          # # . . .
        # # # . .          # # # . .
        . . . . .          # # # # .
        . . . . .          # # # # #

    Plain ``causal() & padding([3, 5])`` aligns every sequence to the padded length instead: its
    padding rows still attend keys, and with fewer queries than keys (a chunk of new tokens after
    a cache) sequence 0's queries would sit level with key 4, past its real keys.

    Args:
        q_lengths: real queries of each sequence, ``[B]`` ints.
        k_lengths: real keys of each sequence, ``[B]`` ints; default ``q_lengths``.

    Raises:
        TypeError: lengths that are not 1-D ints.
        ValueError: negative lengths, or ``q_lengths`` and ``k_lengths`` of different sizes.

    Example:

        One new token of sequence 0 after 2 cached keys, two of sequence 1 after 4:

        >>> from attnkit import masks
        >>> mask = masks.varlen([1, 2], [3, 6]) & masks.causal()
        >>> mask.batch_size
        2
        >>> print(mask.to_string(2, 6))
        sequence 0:
        # # # . . .
        . . . . . .
        sequence 1:
        # # # # # .
        # # # # # #
    """
    q = _integers.integers("q_lengths", q_lengths, expected="a 1-D sequence of ints [B]")
    k = q.clone() if k_lengths is None else _integers.integers("k_lengths", k_lengths,
                                                                expected="a 1-D sequence of ints [B]")
    if q.shape != k.shape:
        raise ValueError(f"q_lengths and k_lengths must have one entry per sequence, got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    return _Varlen(q, k)


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

    Args:
        lengths: the documents' lengths, ints (one packing for every sequence).
        ids: instead, integer labels ``[T]`` or ``[B, T]``, one per position.

    Raises:
        TypeError: both or neither of ``lengths`` and ``ids``, or non-int values.
        ValueError: negative lengths, or ids that reuse a label after another run.

    Example:

        >>> import torch
        >>> from attnkit import masks
        >>> packed = masks.document(ids=torch.tensor([[0, 0, 1, 1], [5, 5, 5, 7]]))
        >>> packed.batch_size
        2
        >>> print((packed & masks.causal()).to_string(4))
        sequence 0:
        # . . .
        # # . .
        . . # .
        . . # #
        sequence 1:
        # . . .
        # # . .
        # # # .
        . . . #
    """
    if (lengths is None) == (ids is None):
        raise TypeError("document() takes either lengths (positional) or ids=..., exactly one of them")
    if lengths is not None:
        sizes = _integers.integers("lengths", lengths, expected="a 1-D sequence of ints (one per document)")
        total = sum(sizes.tolist())  # in Python: an int64 sum could wrap around
        if total > _integers.LIMIT:
            raise ValueError(f"lengths must sum to at most 2**62 positions, got {total}")
        return _Document.from_lengths(sizes.cpu(), f"{sizes.tolist()}")
    labels = _integers.integers("ids", ids, ndims=(1, 2), minimum=None, maximum=None,
                                expected="an integer tensor [T] or [B, T]")
    return _Document.from_ids(labels.cpu(), f"ids={labels.tolist()}" if labels.numel() <= 16
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

    Args:
        prefix_length: the bidirectional prefix, an int or ``[B]`` ints (one per sequence).

    Raises:
        TypeError: a non-int length.
        ValueError: a negative one.

    Example:

        >>> from attnkit import masks
        >>> mask = masks.prefix_lm([1, 3])
        >>> mask.batch_size, mask.dense(4).shape
        (2, torch.Size([2, 1, 4, 4]))
        >>> print(mask.to_string(4))
        sequence 0:
        # . . .
        # # . .
        # # # .
        # # # #
        sequence 1:
        # # # .
        # # # .
        # # # .
        # # # #
    """
    return _PrefixLM(_int_or_lengths("prefix_length", prefix_length))


def padding(lengths: int | Sequence[int] | Tensor) -> StructuredMask:
    """Key padding: sequence ``b`` has ``lengths[b]`` real keys, the rest are padding and never
    attended. ``lengths`` is ``[B]`` (or one int for all sequences). ``padding([3])`` on 3 x 5::

        # # # . .
        # # # . .
        # # # . .

    Args:
        lengths: real keys per sequence, ``[B]`` ints, or one int.

    Raises:
        TypeError: a non-int length.
        ValueError: a negative one.

    Example:

        >>> import torch
        >>> import attnkit
        >>> from attnkit import masks
        >>> mask = masks.padding([2, 4])
        >>> mask.batch_size, mask.dense(3, 4).shape
        (2, torch.Size([2, 1, 3, 4]))
        >>> q = torch.randn(2, 2, 3, 8, generator=torch.Generator().manual_seed(0))  # [B, H, Lq, D]
        >>> k = v = torch.randn(2, 2, 4, 8, generator=torch.Generator().manual_seed(1))
        >>> _, weights = attnkit.attention(q, k, v, mask=mask, return_weights=True)
        >>> bool((weights[0, ..., 2:] == 0).all())  # sequence 0 never attends its padding keys
        True
    """
    value = _int_or_lengths("lengths", lengths)
    if isinstance(value, int):
        value = torch.tensor([value])
    return _Padding(value)
