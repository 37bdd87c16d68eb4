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
    """The six token embeddings, ``[6, 3]``: row ``i`` is the vector of ``TOKENS[i]``.

    Args:
        dtype: the floating dtype of the result.

    Returns:
        A new ``[6, 3]`` tensor each call (changing it changes nothing here).

    Example:

        Seed 002's weightless self-attention: the embeddings are queries, keys and values at once.

        >>> import torch
        >>> import attnkit
        >>> from attnkit import toy
        >>> x = toy.embeddings()
        >>> x.shape, x.dtype
        (torch.Size([6, 3]), torch.float32)
        >>> toy.TOKENS[1], x[1]
        ('journey', tensor([0.5500, 0.8700, 0.6600]))
        >>> context, weights = attnkit.attention(x, x, x, scale=1.0, return_weights=True)
        >>> weights[1]                     # how much "journey" attends to each token
        tensor([0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581])
        >>> context.shape                  # one context vector per token
        torch.Size([6, 3])
    """
    return torch.tensor(_EMBEDDINGS, dtype=dtype)
