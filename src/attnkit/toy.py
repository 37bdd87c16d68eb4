"""The toy example of seed notebook 002: six tokens of "Your journey starts with one step",
each a hand-written 3-d embedding. Small enough to follow every number by hand."""

from __future__ import annotations

import torch
from torch import Tensor

TOKENS: tuple[str, ...] = ("Your", "journey", "starts", "with", "one", "step")

_EMBEDDINGS = (
    (0.43, 0.15, 0.89),  # Your
    (0.55, 0.87, 0.66),  # journey
    (0.57, 0.85, 0.64),  # starts
    (0.22, 0.58, 0.33),  # with
    (0.77, 0.25, 0.10),  # one
    (0.05, 0.80, 0.55),  # step
)


def embeddings(dtype: torch.dtype = torch.float32) -> Tensor:
    """The six token embeddings, ``[6, 3]``."""
    return torch.tensor(_EMBEDDINGS, dtype=dtype)
