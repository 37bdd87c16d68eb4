"""The one rule every mask constructor applies to the integers it is given.

Accepted: Python ints and numpy integers, alone or in sequences (lists, tuples, ranges, numpy
arrays) and integer tensors. Refused, naming the argument: bools (``True`` is not a length),
floats (``2.7`` is not silently ``2``), anything else, and values outside the argument's range.
Tensors are copied, so a later in-place edit of the caller's tensor cannot bypass validation.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

#: The largest length, size or prefix a mask accepts: a position plus such a value stays
#: inside int64, the dtype every mask computes its key intervals in.
LIMIT = 2**62
_INT64 = (-(2**63), 2**63 - 1)

_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    shown = repr(value)
    return f"{type(value).__name__} {shown if len(shown) <= 60 else shown[:57] + '...'}"


def _is_int(value: object) -> bool:
    # numpy integers register as numbers.Integral (numpy's bool does not); bool must not pass.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_range(name: str, low: int, high: int, minimum: int | None, maximum: int | None, shown: object) -> None:
    if minimum is not None and low < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {shown}")
    if maximum is not None and high > maximum:
        limit = "2**62" if maximum == LIMIT else str(maximum)
        raise ValueError(f"{name} must be <= {limit}, got {shown}")


def integer(name: str, value: object, *, minimum: int = 0, maximum: int = LIMIT) -> int:
    """``value`` as an ``int`` in ``[minimum, maximum]``; TypeError / ValueError naming ``name``."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {_describe(value)}")
    number = int(value)  # type: ignore[call-overload]
    _check_range(name, number, number, minimum, maximum, number)
    return number


def optional_integer(name: str, value: object, *, minimum: int = 0, maximum: int = LIMIT) -> int | None:
    return None if value is None else integer(name, value, minimum=minimum, maximum=maximum)


def _leaves(items: Sequence) -> Iterator[object]:
    for item in items:
        if isinstance(item, Sequence) and not isinstance(item, (str, bytes)):
            yield from _leaves(item)
        else:
            yield item


def _from_sequence(name: str, value: object, expected: str, minimum: int | None, maximum: int | None) -> Tensor:
    items = value.tolist() if hasattr(value, "dtype") and hasattr(value, "tolist") else value  # numpy arrays
    if not isinstance(items, Sequence) or isinstance(items, (str, bytes)):
        raise TypeError(f"{name} must be {expected}, got {_describe(value)}")
    leaves = list(_leaves(items))
    for leaf in leaves:
        if not _is_int(leaf):
            raise TypeError(f"{name} must be {expected}, got {_describe(value)} holding {_describe(leaf)}")
    for number in map(int, leaves):  # type: ignore[arg-type]
        if not _INT64[0] <= number <= _INT64[1]:  # refused before torch would fail to convert it
            _check_range(name, number, number, minimum, maximum, number)
            raise ValueError(f"{name} must hold int64 values, got {number}")
    try:
        return torch.tensor(items, dtype=torch.int64)
    except (TypeError, ValueError):  # ragged nesting
        raise TypeError(f"{name} must be {expected} (rectangular), got {_describe(value)}") from None


def integers(name: str, value: object, *, ndims: tuple[int, ...] = (1,), minimum: int | None = 0,
             maximum: int | None = LIMIT, expected: str = "a 1-D sequence of ints [B]") -> Tensor:
    """``value`` as a new int64 tensor with one of ``ndims`` dims, every entry in ``[minimum,
    maximum]`` (``None``: unbounded). Tensors keep their device; everything else lands on the CPU.
    While ``torch.compile`` traces, a tensor's values are not checked (only its dtype and shape):
    reading them would break the graph."""
    if isinstance(value, Tensor):
        if value.dtype not in _INTEGER_DTYPES:
            raise TypeError(f"{name} must be {expected}, got {_describe(value)}")
        tensor = value.detach().to(torch.int64, copy=True)
    else:
        tensor = _from_sequence(name, value, expected, minimum, maximum)
    if tensor.dim() not in ndims:
        raise TypeError(f"{name} must be {expected}, got {_describe(value)}")
    if tensor.numel() and not torch.compiler.is_compiling():  # reading values would break a compiled graph
        low, high = int(tensor.min()), int(tensor.max())
        shown = tensor.tolist() if tensor.numel() <= 16 else f"values from {low} to {high}"
        _check_range(name, low, high, minimum, maximum, shown)
    return tensor
