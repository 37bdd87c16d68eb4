"""Argument checks shared by the layers: clear errors that name the argument and the shapes."""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from .._backends import backends


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def optional_positive_int(name: str, value: object, default: int) -> int:
    return default if value is None else positive_int(name, value)


def dropout_probability(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"dropout must be a float in [0, 1), got {value!r}")
    return float(value)


def backend_name(value: object) -> str:
    if not isinstance(value, str) or value not in backends():
        raise ValueError(f"unknown backend {value!r}; available: {backends()}")
    return value  # type: ignore[return-value]


def features(name: str, tensor: object, size: int) -> Tensor:
    """Check that ``tensor`` is ``[B, L, size]`` or ``[L, size]``."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [B, L, {size}] or [L, {size}], got {type(tensor).__name__}")
    if tensor.dim() not in (2, 3) or tensor.shape[-1] != size:
        raise ValueError(f"{name} must be [B, L, {size}] or [L, {size}], got shape {tuple(tensor.shape)}")
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype (token features), got {tensor.dtype}")
    return tensor


def same_batch(query: Tensor, name: str, other: Tensor) -> None:
    """``other`` (key, value or context) has the query's batch layout: both batched alike."""
    if other.dim() != query.dim() or other.shape[:-2] != query.shape[:-2]:
        raise ValueError(
            f"{name} must have the query's batch dims {tuple(query.shape[:-2])} ([B, L, features] or "
            f"[L, features] like query {tuple(query.shape)}), got {name} {tuple(other.shape)}"
        )


def same_sequences(key: Tensor, value: Tensor) -> None:
    """key and value describe the same tokens: same batch and length."""
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(
            f"key and value must have the same batch and length [..., Lk, *], got key {tuple(key.shape)} "
            f"and value {tuple(value.shape)}"
        )


def inputs_with_context(x: Tensor, context: Tensor | None, d_in: int, d_context: int) -> Tensor:
    """Check a layer's ``x`` and ``context`` (default: ``x`` itself); return the context."""
    features("x", x, d_in)
    name = "context" if context is not None else "context (defaulting to x)"
    context = x if context is None else context
    features(name, context, d_context)
    same_batch(x, "context", context)
    return context


def boolean(name: str, value: object) -> bool:
    """A flag: exactly ``True`` or ``False`` (``"no"`` or ``0`` are not silently coerced)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def weight_tensors(**weights: object) -> None:
    """Weights handed to a conversion are tensors (else a TypeError naming the first that is not)."""
    for name, weight in weights.items():
        if not isinstance(weight, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(weight).__name__}")


def optional_softcap(value: object) -> float | None:
    """``None`` or a positive finite float (the soft-capping of the scores)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"softcap must be None or a positive finite number, got {value!r}")
    return float(value)


def optional_head_vector(name: str, value: object, heads: int, device: torch.device | str | None) -> Tensor | None:
    """``None`` or a floating tensor ``[heads]`` (a per-head constant such as ALiBi's slopes), copied."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor [num_heads] or None, got {type(value).__name__}"
                        + (f" of dtype {value.dtype}" if isinstance(value, torch.Tensor) else ""))
    if value.shape != (heads,):
        raise ValueError(f"{name} must have shape [num_heads] = [{heads}], got {list(value.shape)}")
    return value.detach().to(device=device).clone()
