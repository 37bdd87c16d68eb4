"""One 4-D layout for every rank: ``[..., L, D]`` inputs as ``[N, H, L, D]``.

Kernels and the dropout hash work on ``[N, H, L, D]``. A call's ``[..., L, D]`` inputs fold into it
without copying: 2-D ``[L, D]`` is ``[1, 1, L, D]``, 3-D ``[N, L, D]`` is ``[N, 1, L, D]``, and from
4-D on the first dim stays the batch (the dim per-sequence masks describe) and the dims between
it and ``L`` become the heads (grouped-query attention, 4-D only, keeps key/value's own ``Hkv``).
"""

from __future__ import annotations

import math

from torch import Tensor

__all__ = ["fold", "unfold", "fold_mask", "batch_heads"]


def batch_heads(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(N, H)`` of a ``[..., L, D]`` shape folded to ``[N, H, L, D]``."""
    lead = shape[:-2]
    if not lead:
        return 1, 1
    return lead[0], math.prod(lead[1:])


def fold(t: Tensor) -> Tensor:
    """``[..., L, D]`` -> ``[N, H, L, D]`` (a view where the strides allow it)."""
    batch, heads = batch_heads(tuple(t.shape))
    return t.reshape(batch, heads, *t.shape[-2:])


def unfold(t: Tensor, lead: tuple[int, ...]) -> Tensor:
    """``[N, H, L, ...]`` back to the call's leading dims ``lead`` (``[*lead, L, ...]``)."""
    return t.reshape(*lead, *t.shape[2:])


def fold_mask(mask: Tensor, scores_shape: tuple[int, ...]) -> Tensor:
    """A mask broadcastable to ``scores_shape = [..., Lq, Lk]`` as one broadcastable to the folded
    ``[N, H, Lq, Lk]``: ``[Nm, Hm, Lq, Lk]`` with ``Nm``, ``Hm`` 1 where it broadcasts. The head dims
    are expanded (a copy) only when they broadcast partly."""
    rank = len(scores_shape)
    mask = mask.reshape((1,) * (rank - mask.dim()) + tuple(mask.shape))
    q_len, k_len = scores_shape[-2:]
    mask = mask.expand(*mask.shape[:-2], q_len, k_len)
    if rank == 2:
        return mask[None, None]
    if rank == 3:
        return mask[:, None]
    middle = mask.shape[1:-2]
    if all(size == 1 for size in middle):
        return mask.reshape(mask.shape[0], 1, q_len, k_len)
    return mask.expand(mask.shape[0], *scores_shape[1:-2], q_len, k_len).reshape(
        mask.shape[0], math.prod(scores_shape[1:-2]), q_len, k_len)
