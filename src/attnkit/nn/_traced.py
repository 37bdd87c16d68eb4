"""Each layer's forward is one call in :mod:`attnkit.trace`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from .. import _steps

Forward = TypeVar("Forward", bound=Callable[..., object])


def traced_call(forward: Forward) -> Forward:
    """Group the steps a layer's ``forward`` reports (and those of the ``attention`` call inside
    it) as one traced call owned by the layer. Free when nothing records; under
    ``torch.compile`` nothing records, so the compiled graph never sees the context variables."""

    @functools.wraps(forward)
    def grouped(self: object, *args: object, **kwargs: object) -> object:
        if not _steps.active():
            return forward(self, *args, **kwargs)
        with _steps.group(self):
            return forward(self, *args, **kwargs)

    return grouped  # type: ignore[return-value]
