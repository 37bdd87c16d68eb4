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
    """The storage dtype name for a record of ``num_weights`` weights."""
    if precision == "auto":
        return "float32" if num_weights <= EXACT_LIMIT else "float16"
    if precision not in _DTYPES:
        raise ValueError(f"precision: got {precision!r}, expected 'auto', 'float32' or 'float16'")
    return precision


def encode_weights(weights: Tensor, precision: Precision = "auto") -> tuple[str, str]:
    """``(dtype name, base64 text)`` of ``weights`` flattened in row-major (C) order."""
    np = require("numpy", "the HTML report")  # the viz extra; the core needs torch only
    name = choose_precision(weights.numel(), precision)
    numpy_dtype, torch_dtype = _DTYPES[name]
    array = weights.detach().to("cpu", torch_dtype).contiguous().numpy()
    return name, base64.b64encode(array.astype(numpy_dtype, copy=False).tobytes()).decode("ascii")


def decode_weights(text: str, dtype: str, shape: tuple[int, ...]) -> Tensor:
    """Inverse of :func:`encode_weights` (what the page's script does), as a float32 tensor."""
    np = require("numpy", "decoding report data")
    array = np.frombuffer(base64.b64decode(text), dtype=_DTYPES[dtype][0]).astype(np.float32)
    return torch.from_numpy(array.reshape(shape).copy())
