"""Where each rank's shard of the sequence sits in the whole: contiguous or zigzag chunks.

``contiguous``: rank ``r`` holds one chunk, the ``r``-th run of positions. ``zigzag`` (ring-flash-
attention's layout): the sequence is cut into ``2P`` chunks and rank ``r`` holds chunks ``r`` and
``2P - 1 - r``, one from each end, so that under a causal mask every rank has about the same work::

    P = 2, 8 positions    contiguous: rank 0 [0 1 2 3]  rank 1 [4 5 6 7]
                          zigzag:     rank 0 [0 1 6 7]  rank 1 [2 3 4 5]

Shards may differ in length (``lengths[r]`` positions on rank ``r``); a zigzag shard of ``n``
positions holds ``(n + 1) // 2`` of the first chunk and ``n // 2`` of the second.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["LAYOUTS", "Chunk", "chunks", "even_lengths", "shard", "unshard"]

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Chunk:
    """A run of ``length`` positions starting at ``start`` in the whole sequence, held by ``rank`` at
    ``local`` in its shard."""

    rank: int
    start: int
    length: int
    local: int

    @property
    def stop(self) -> int:
        return self.start + self.length


def check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout  # type: ignore[return-value]


def chunks(lengths: list[int], layout: str) -> list[list[Chunk]]:
    """Each rank's chunks, in the order of its shard, for shards of ``lengths[r]`` positions."""
    check_layout(layout)
    world = len(lengths)
    if layout == "contiguous":
        pieces = [(r, 0, n) for r, n in enumerate(lengths)]  # (rank, local, length) in global order
    else:
        first = [(r, 0, (n + 1) // 2) for r, n in enumerate(lengths)]
        second = [(r, (n + 1) // 2, n // 2) for r, n in enumerate(lengths)]
        pieces = first + second[::-1]
    result: list[list[Chunk]] = [[] for _ in range(world)]
    start = 0
    for rank, local, length in pieces:
        result[rank].append(Chunk(rank, start, length, local))
        start += length
    for own in result:
        own.sort(key=lambda c: c.local)
    return result


def even_lengths(total: int, world: int, layout: str = "contiguous") -> list[int]:
    """Shard lengths for ``total`` positions over ``world`` ranks, as even as the layout allows
    (zigzag: ``2 * world`` chunks as even as possible, rank ``r`` taking chunks ``r`` and ``2P-1-r``)."""
    check_layout(layout)
    parts = world if layout == "contiguous" else 2 * world
    sizes = [total // parts + (1 if i < total % parts else 0) for i in range(parts)]
    if layout == "contiguous":
        return sizes
    return [sizes[r] + sizes[parts - 1 - r] for r in range(world)]


def shard(x: Tensor, rank: int, world_size: int, *, layout: str = "contiguous",
          lengths: list[int] | None = None, dim: int = -2) -> Tensor:
    """Rank ``rank``'s shard of the whole sequence ``x`` (positions along ``dim``, default ``-2`` as
    in ``[B, H, L, D]``; use ``dim=1`` for ``[B, L, E]``): a copy, contiguous. ``lengths``: each
    rank's shard length (default :func:`even_lengths`)."""
    total = x.shape[dim]
    lengths = even_lengths(total, world_size, layout) if lengths is None else list(lengths)
    if len(lengths) != world_size or sum(lengths) != total or min(lengths) < 0:
        raise ValueError(f"lengths must be {world_size} non-negative shard lengths summing to the sequence's "
                         f"{total} (dim {dim} of {tuple(x.shape)}), got {lengths}")
    return torch.cat([x.narrow(dim, c.start, c.length) for c in chunks(lengths, layout)[rank]], dim=dim).contiguous()


def unshard(shards: list[Tensor], *, layout: str = "contiguous", dim: int = -2) -> Tensor:
    """The whole sequence from every rank's shard (``shards[r]``, e.g. from ``all_gather``)."""
    lengths = [s.shape[dim] for s in shards]
    placed = sorted(((c.start, shards[r].narrow(dim, c.local, c.length))
                     for r, own in enumerate(chunks(lengths, layout)) for c in own), key=lambda pair: pair[0])
    return torch.cat([t for _, t in placed], dim=dim)
