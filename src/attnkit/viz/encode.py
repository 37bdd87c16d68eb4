"""Compact, exact-enough embedding of attention weights in an HTML page.

A 512-token sentence through 6 layers x 12 heads is 18.9 M weights: as JSON text that is
~200 MB, as float32 bytes 75 MB. The report stores raw little-endian float32 (exact: the very
values the model applied) while a record is small, and float16 above ``EXACT_LIMIT`` weights
(half the size; relative error <= 2**-11 ~ 0.05 %, weights below 6e-8 become 0), base64-encoded
inside a ``<script type="application/octet-stream">`` block that the page decodes lazily.
"""

from __future__ import annotations

import base64
from typing import Literal

import torch
from torch import Tensor

from .._optional import require

Precision = Literal["auto", "float32", "float16"]

# 2**22 weights = 16 MiB as float32: every all-MiniLM-L6-v2 sentence up to 241 tokens stays exact.
EXACT_LIMIT = 1 << 22

_DTYPES = {"float32": ("<f4", torch.float32), "float16": ("<f2", torch.float16)}


def choose_precision(num_weights: int, precision: Precision = "auto") -> str:
    """The storage dtype name for a record of ``num_weights`` weights.

    Args:
        num_weights: how many weights the record holds (``layers * heads * T * T``).
        precision: ``"auto"`` (``"float32"`` up to ``EXACT_LIMIT`` weights, ``"float16"``
            above), or ``"float32"`` / ``"float16"`` to force one.

    Returns:
        ``"float32"`` or ``"float16"``.

    Raises:
        ValueError: ``precision`` is none of the three names.

    Example:

        >>> from attnkit.viz.encode import EXACT_LIMIT, choose_precision
        >>> choose_precision(6 * 12 * 128 * 128)      # 6 layers x 12 heads, 128 tokens
        'float32'
        >>> choose_precision(EXACT_LIMIT + 1)
        'float16'
        >>> choose_precision(100, "float16")
        'float16'
        >>> choose_precision(100, "bfloat16")
        Traceback (most recent call last):
            ...
        ValueError: precision: got 'bfloat16', expected 'auto', 'float32' or 'float16'
    """
    if precision == "auto":
        return "float32" if num_weights <= EXACT_LIMIT else "float16"
    if precision not in _DTYPES:
        raise ValueError(f"precision: got {precision!r}, expected 'auto', 'float32' or 'float16'")
    return precision


def encode_weights(weights: Tensor, precision: Precision = "auto") -> tuple[str, str]:
    """``(dtype name, base64 text)`` of ``weights`` flattened in row-major (C) order.

    Args:
        weights: a tensor of any shape (the report's are ``[layers, heads, T, T]``), on any
            device; it is copied to the CPU, not changed.
        precision: the storage dtype, as :func:`attnkit.viz.encode.choose_precision` picks it.

    Returns:
        The dtype name (``"float32"`` or ``"float16"``) and the little-endian bytes of the
        weights in that dtype, base64-encoded (ASCII).

    Raises:
        ValueError: an unknown ``precision``.
        ImportError: numpy is not installed (the ``attnkit[viz]`` extra).

    Example:

        >>> import torch
        >>> from attnkit.viz.encode import encode_weights
        >>> weights = torch.tensor([[1.0, 0.0], [0.25, 0.75]])    # [T, T]
        >>> encode_weights(weights)                               # 4 weights: exact float32
        ('float32', 'AACAPwAAAAAAAIA+AABAPw==')
        >>> encode_weights(weights, "float16")                    # half the bytes
        ('float16', 'ADwAAAA0ADo=')
    """
    np = require("numpy", "the HTML report")  # the viz extra; the core needs torch only
    name = choose_precision(weights.numel(), precision)
    numpy_dtype, torch_dtype = _DTYPES[name]
    array = weights.detach().to("cpu", torch_dtype).contiguous().numpy()
    return name, base64.b64encode(array.astype(numpy_dtype, copy=False).tobytes()).decode("ascii")


def decode_weights(text: str, dtype: str, shape: tuple[int, ...]) -> Tensor:
    """Inverse of :func:`attnkit.viz.encode.encode_weights` (what the page's script does), as a
    float32 tensor.

    Args:
        text: the base64 text :func:`attnkit.viz.encode.encode_weights` returned.
        dtype: its dtype name, ``"float32"`` or ``"float16"``.
        shape: the shape of the encoded tensor (its number of elements must match the data).

    Returns:
        A new float32 CPU tensor of ``shape``, the very weights for ``"float32"``, the float16
        rounding of them for ``"float16"``.

    Raises:
        KeyError: an unknown ``dtype``.
        ValueError: ``shape`` does not hold the decoded number of weights.
        ImportError: numpy is not installed (the ``attnkit[viz]`` extra).

    Example:

        >>> import torch
        >>> from attnkit.viz.encode import decode_weights, encode_weights
        >>> weights = torch.tensor([[1.0, 0.0], [1 / 3, 2 / 3]])
        >>> dtype, text = encode_weights(weights)
        >>> torch.equal(decode_weights(text, dtype, (2, 2)), weights)     # float32: exact
        True
        >>> dtype, text = encode_weights(weights, "float16")
        >>> decode_weights(text, dtype, (2, 2))[1, 0].item()              # 1/3 to 11 bits
        0.333251953125
    """
    np = require("numpy", "decoding report data")
    array = np.frombuffer(base64.b64decode(text), dtype=_DTYPES[dtype][0]).astype(np.float32)
    return torch.from_numpy(array.reshape(shape).copy())
