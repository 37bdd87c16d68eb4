"""Query rows with no key to attend: how the fused paths keep them NaN-free.

A softmax over a row whose scores are all ``-inf`` is ``0 / 0``. The fused paths avoid ever
computing it: such rows are given a key to attend (any finite row will do), and their result
is zeroed afterwards, which also makes their gradients exactly zero.
"""

from __future__ import annotations

import torch
from torch import Tensor


def give_empty_rows_a_key(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Let rows with no allowed key attend everything; return the new mask and those rows.

    ``mask`` is boolean (True = may attend) or additive (``-inf`` removes a key); the rows
    are returned as a boolean ``[..., Lq, 1]`` tensor that broadcasts like ``mask``.
    """
    allowed = mask if mask.dtype == torch.bool else mask != float("-inf")
    no_key = ~allowed.any(dim=-1, keepdim=True)
    if mask.dtype == torch.bool:
        return mask | no_key, no_key
    return mask.masked_fill(no_key, 0.0), no_key
