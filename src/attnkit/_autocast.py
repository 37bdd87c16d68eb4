"""One rule for ``torch.autocast`` at every public entry that computes attention.

``torch.autocast`` lists ``F.scaled_dot_product_attention`` among its lower-precision ops on the
CPU and CUDA: float32 inputs run in the autocast dtype, and the result comes back in it. attnkit's
entries (:func:`attnkit.attention`, :func:`attnkit.distributed.ring_attention`,
:func:`attnkit.distributed.ulysses_attention`) follow that rule whatever runs behind them, so the
dtype of a result under autocast does not depend on the backend, the kernel or the number of ranks.
Inside, autocast is off: the kernels see the inputs' dtype and nothing casts behind them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

F = TypeVar("F", bound=Callable)


def autocast_dtype(query: object) -> torch.dtype | None:
    """The dtype autocast gives SDPA where it is on for ``query``'s device, else None."""
    if not isinstance(query, Tensor):
        return None
    device_type = query.device.type
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def follows_autocast(entry: F) -> F:
    """Wrap ``entry(query, key, value, **options)``: under autocast its float32 ``query``, ``key``
    and ``value`` are cast to the autocast dtype and it runs with autocast off; otherwise it runs
    as it is. Half-precision inputs and non-tensors pass unchanged (so validation still sees them)."""

    @functools.wraps(entry)
    def wrapped(query, key, value, *args, **options):
        dtype = autocast_dtype(query)
        if dtype is None:
            return entry(query, key, value, *args, **options)
        query, key, value = (t.to(dtype) if isinstance(t, Tensor) and t.dtype == torch.float32 else t
                             for t in (query, key, value))
        with torch.autocast(query.device.type, enabled=False):
            return entry(query, key, value, *args, **options)

    return wrapped  # type: ignore[return-value]
