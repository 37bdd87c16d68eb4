"""Observe the named intermediate steps of the readable reference computation.

The reference backend reports each step (scores, scaled scores, masked scores, weights, ...)
through :func:`record`. Nobody listens unless :func:`recording` is active, and then the cost
when off is one context-variable lookup per step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

_listener: ContextVar[list[tuple[str, Tensor]] | None] = ContextVar("attnkit_steps", default=None)


def record(name: str, tensor: Tensor) -> None:
    """Report one intermediate (a detached view) to the active recording, if any.

    Inside ``torch.compile`` nothing is recorded: reading a context variable would break the graph.
    """
    if torch.compiler.is_compiling():
        return
    steps = _listener.get()
    if steps is not None:
        steps.append((name, tensor.detach()))


@contextmanager
def recording() -> Iterator[list[tuple[str, Tensor]]]:
    """Collect ``(name, tensor)`` for every step the reference backend runs inside the block."""
    steps: list[tuple[str, Tensor]] = []
    token = _listener.set(steps)
    try:
        yield steps
    finally:
        _listener.reset(token)
