"""A small, dependency-free progress bar on stderr, for loops over many texts."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

T = TypeVar("T")

# Fewer items than this finish before a bar would be worth reading.
MANY = 4


def progress(
    items: Iterable[T],
    *,
    total: int | None = None,
    label: str = "",
    enabled: bool | None = None,
    stream: TextIO | None = None,
    width: int = 30,
) -> Iterator[T]:
    """Yield ``items`` while drawing ``label [#####.....] 3/10 1.2s`` on ``stream`` (stderr).

    ``enabled=None`` shows the bar only when there are at least ``MANY`` items (``total`` or
    ``len(items)``). The line is redrawn in place (carriage return) at most ten times a second,
    and always for the last item, then ended with a newline.

    Args:
        items: any iterable; it is consumed lazily, as the caller's loop asks.
        total: the number of items, for the bar and the count; default ``len(items)`` where it
            has one (else only the count is drawn).
        label: the text before the bar.
        enabled: ``True`` / ``False`` to force the bar on or off; ``None`` decides as above.
        stream: where to draw; default ``sys.stderr``.
        width: the bar's width in characters.

    Returns:
        A generator yielding ``items`` unchanged.

    Example:

        >>> import io
        >>> from attnkit.viz import progress
        >>> stream = io.StringIO()
        >>> [n * n for n in progress(range(5), label="squaring", stream=stream, width=10)]
        [0, 1, 4, 9, 16]
        >>> stream.getvalue().splitlines()[-1]      # the last drawing (each starts with a carriage return)
        'squaring [##########] 5/5 ...s'
        >>> quiet = io.StringIO()
        >>> list(progress(range(3), stream=quiet)), quiet.getvalue()   # 3 < MANY: no bar
        ([0, 1, 2], '')
    """
    if total is None:
        total = len(items) if hasattr(items, "__len__") else None  # type: ignore[arg-type]
    if enabled is None:
        enabled = total is not None and total >= MANY
    if not enabled:
        yield from items
        return
    stream = sys.stderr if stream is None else stream
    start = last = time.perf_counter()
    done = 0

    def draw() -> None:
        elapsed = time.perf_counter() - start
        if total:
            filled = width * done // total
            bar = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"
        else:
            bar = f"{done}"
        stream.write(f"\r{label + ' ' if label else ''}{bar} {elapsed:.1f}s")
        stream.flush()

    draw()
    for item in items:
        yield item
        done += 1
        now = time.perf_counter()
        if now - last >= 0.1 or done == total:
            last = now
            draw()
    if done != total:
        draw()
    stream.write("\n")
    stream.flush()
