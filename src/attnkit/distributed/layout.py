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
    ``local`` in its shard (all ints; frozen). :func:`attnkit.distributed.layout.chunks` makes them.

    Example:

        >>> from attnkit.distributed.layout import Chunk
        >>> chunk = Chunk(rank=1, start=4, length=2, local=2)  # positions 4, 5 at 2, 3 of rank 1's shard
        >>> chunk.stop
        6
    """

    rank: int
    start: int
    length: int
    local: int

    @property
    def stop(self) -> int:
        """The position after the chunk's last in the whole sequence: ``start + length`` (an int).

        Example:

            >>> from attnkit.distributed.layout import Chunk
            >>> Chunk(rank=0, start=6, length=2, local=2).stop
            8
        """
        return self.start + self.length


def check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout  # type: ignore[return-value]


def chunks(lengths: list[int], layout: str) -> list[list[Chunk]]:
    """Each rank's chunks, in the order of its shard, for shards of ``lengths[r]`` positions.

    Args:
        lengths: the shard length of each rank (``P`` ints).
        layout: ``"contiguous"`` or ``"zigzag"`` (see the module docstring).

    Returns:
        ``P`` lists of :class:`attnkit.distributed.layout.Chunk`: one chunk a rank (contiguous) or
        two (zigzag, either possibly empty).

    Raises:
        ValueError: for an unknown ``layout``.

    Example:

        >>> from attnkit.distributed.layout import chunks
        >>> for own in chunks([4, 4], "zigzag"):
        ...     print([(c.start, c.stop) for c in own])
        [(0, 2), (6, 8)]
        [(2, 4), (4, 6)]
    """
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
    (zigzag: ``2 * world`` chunks as even as possible, rank ``r`` taking chunks ``r`` and ``2P-1-r``).

    Returns:
        ``world`` ints summing to ``total``.

    Raises:
        ValueError: for an unknown ``layout``.

    Example:

        >>> from attnkit.distributed import even_lengths
        >>> even_lengths(10, 4)
        [3, 3, 2, 2]
        >>> even_lengths(10, 4, "zigzag")  # chunks of 2, 2, 1, 1, 1, 1, 1, 1
        [3, 3, 2, 2]
        >>> even_lengths(9, 2, "zigzag")
        [5, 4]
    """
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
    rank's shard length (default :func:`attnkit.distributed.even_lengths`).

    Args:
        x: the whole sequence, e.g. ``[B, H, L, D]`` (``dim=-2``) or ``[B, L, E]`` (``dim=1``).
        rank, world_size: which shard, of how many.
        layout: ``"contiguous"`` or ``"zigzag"`` (see the module docstring).
        lengths: ``world_size`` shard lengths summing to ``L``, or None.
        dim: the dimension holding the positions.

    Returns:
        The shard, ``x`` with ``lengths[rank]`` positions along ``dim``.

    Raises:
        ValueError: for ``lengths`` that are not ``world_size`` non-negative numbers summing to
            ``L``, or an unknown ``layout``.

    Example:

        >>> import torch
        >>> from attnkit.distributed import shard
        >>> x = torch.arange(8).view(1, 1, 8, 1)  # [B, H, L, D], positions 0..7
        >>> [shard(x, r, 2, layout="zigzag").flatten().tolist() for r in range(2)]
        [[0, 1, 6, 7], [2, 3, 4, 5]]
        >>> tokens = torch.arange(8).view(1, 8)  # [B, L]
        >>> shard(tokens, 1, 2, lengths=[3, 5], dim=1)
        tensor([[3, 4, 5, 6, 7]])
    """
    total = x.shape[dim]
    lengths = even_lengths(total, world_size, layout) if lengths is None else list(lengths)
    if len(lengths) != world_size or sum(lengths) != total or min(lengths) < 0:
        raise ValueError(f"lengths must be {world_size} non-negative shard lengths summing to the sequence's "
                         f"{total} (dim {dim} of {tuple(x.shape)}), got {lengths}")
    return torch.cat([x.narrow(dim, c.start, c.length) for c in chunks(lengths, layout)[rank]], dim=dim).contiguous()


def unshard(shards: list[Tensor], *, layout: str = "contiguous", dim: int = -2) -> Tensor:
    """The whole sequence from every rank's shard (``shards[r]``, e.g. from ``all_gather``): the
    inverse of :func:`attnkit.distributed.shard`. The shard lengths are read from ``shards``.

    Args:
        shards: each rank's shard, e.g. ``[B, H, n_r, D]`` (positions along ``dim``).
        layout: the layout the shards were cut by.
        dim: the dimension holding the positions.

    Returns:
        The whole sequence, ``sum(n_r)`` positions along ``dim``.

    Raises:
        ValueError: for an unknown ``layout``.

    Example:

        >>> import torch
        >>> from attnkit.distributed import shard, unshard
        >>> x = torch.randn(2, 3, 10, 4)
        >>> shards = [shard(x, r, 3, layout="zigzag") for r in range(3)]
        >>> [s.shape[2] for s in shards]
        [3, 3, 4]
        >>> torch.equal(unshard(shards, layout="zigzag"), x)
        True
    """
    lengths = [s.shape[dim] for s in shards]
    placed = sorted(((c.start, shards[r].narrow(dim, c.local, c.length))
                     for r, own in enumerate(chunks(lengths, layout)) for c in own), key=lambda pair: pair[0])
    return torch.cat([t for _, t in placed], dim=dim)
