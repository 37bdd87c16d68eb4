"""The hook through which attention calls report their named intermediates.

Producers call :func:`record` (the reference backend: scores, scaled and masked scores,
weights, ...; attnkit layers: queries, keys, values, heads, ...). Nothing is kept unless a
:class:`Recorder` is active (see :mod:`attnkit.trace`, the public face of this module), and
then the cost when off is one context-variable lookup per step. Under ``torch.compile``
nothing is recorded, since reading a context variable would break the graph.

Events are grouped per attention call: a layer opens a group around its forward pass
(:func:`group`), so the core's steps inside it land in the same group; a bare call of
``attnkit.attention`` opens its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Group:
    """One attention call: who made it (a module, or None for a bare ``attention()`` call)."""

    owner: object | None
    steps: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class Recorder:
    groups: list[Group] = field(default_factory=list)


_recorder: ContextVar[Recorder | None] = ContextVar("attnkit_recorder", default=None)
_current: ContextVar[Group | None] = ContextVar("attnkit_group", default=None)


def active() -> bool:
    """True when a recording is listening (never while torch.compile traces)."""
    return not torch.compiler.is_compiling() and _recorder.get() is not None


def record(name: str, tensor: Tensor) -> None:
    """Report one intermediate (detached) to the active recording, if any."""
    if not active():
        return
    current = _current.get()
    if current is None:  # a producer outside any group: make it a group of its own
        current = Group(owner=None)
        _recorder.get().groups.append(current)  # type: ignore[union-attr]
    current.steps[name] = tensor.detach()


@contextmanager
def group(owner: object | None) -> Iterator[Group | None]:
    """Collect the steps reported inside the block as one attention call made by ``owner``.

    Nested groups join the outer one (a layer's call of the core is part of the layer's call).
    """
    recorder = _recorder.get()
    if recorder is None or torch.compiler.is_compiling() or _current.get() is not None:
        yield _current.get()
        return
    new = Group(owner=owner)
    recorder.groups.append(new)
    token = _current.set(new)
    try:
        yield new
    finally:
        _current.reset(token)


@contextmanager
def recording() -> Iterator[Recorder]:
    """Listen to every attention call made inside the block."""
    recorder = Recorder()
    token = _recorder.set(recorder)
    try:
        yield recorder
    finally:
        _recorder.reset(token)
