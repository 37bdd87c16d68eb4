"""JSON from files attnkit does not control, under one rule for a malformed document."""

from __future__ import annotations

import json
from typing import Any


def loads_untrusted(text: str) -> Any:
    """``json.loads(text)``, where a document nested deeper than json's recursion allows (some
    thousands of brackets) is a ``ValueError`` ("nested too deeply") like any other malformed one:
    json raises ``RecursionError`` there, which no reader of a damaged file should have to know.

    Example:

    >>> from attnkit._json import loads_untrusted
    >>> loads_untrusted('{"step": 1}')
    {'step': 1}
    >>> loads_untrusted("[" * 100_000 + "]" * 100_000)
    Traceback (most recent call last):
    ...
    ValueError: nested too deeply
    """
    try:
        return json.loads(text)
    except RecursionError as error:
        raise ValueError("nested too deeply") from error
