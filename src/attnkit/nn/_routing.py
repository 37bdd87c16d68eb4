"""The one switch that routes a layer's self-attention elsewhere: sequence parallelism.

:func:`attnkit.distributed.sequence_parallel` sets a route here for the duration of a ``with``
block; :class:`attnkit.nn.MultiHeadAttention` sends its self-attention calls (no cache, no weights)
through it. ``attnkit.nn`` never imports ``attnkit.distributed``: the route is a plain callable
taking ``(queries, keys, values, *, mask, causal, dropout, backend, softcap, alibi_slopes, sinks)``.

A module-level stack rather than a ``ContextVar``: ``torch.compile`` reads (and guards on) a global
without a graph break, where ``ContextVar.get`` cannot be traced; a compiled layer inside the block
then tries to trace the route and fails loudly rather than silently attending locally.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

__all__ = ["current", "routed"]

_routes: list[Callable] = []


def current() -> Callable | None:
    """The active route, or None."""
    return _routes[-1] if _routes else None


@contextlib.contextmanager
def routed(route: Callable) -> Iterator[None]:
    _routes.append(route)
    try:
        yield
    finally:
        _routes.remove(route)
