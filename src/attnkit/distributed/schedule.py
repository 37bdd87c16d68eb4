"""What each rank computes and receives, decided from the mask before anything is sent.

Every rank computes the same schedule from the same facts (shard lengths, layout, the mask over
global positions), so senders and receivers agree without a word exchanged. The mask's key ranges
per row (``row_ranges``: ``[S, R, L]``, R <= 2) say, for each receiving rank and each chunk of
another rank, which keys its queries attend: the span ``[t0, t1)`` covering them is all that is
sent; a chunk no local query attends is neither sent nor computed (a sliding window: the
neighbours' boundary keys only; packed documents: the chunks sharing a document).

A **unit** is one kernel call: one query chunk against one received piece of keys, whose local
mask is the global ranges of the chunk's rows shifted to the piece's first key and clipped to it
(``masks.key_ranges``); bottom-right causal alignment is global, so ``causal=True`` becomes ranges
here and no unit passes ``causal`` to the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._backends.tiled_plan import intervals
from ..masks import StructuredMask
from .layout import Chunk, chunks


@dataclass(frozen=True)
class Piece:
    """Keys ``[start, stop)`` (global positions) of ``chunk`` (a
    :class:`attnkit.distributed.layout.Chunk`), sent to one receiver (or kept: own chunk). Frozen.

    Example:

        >>> from attnkit.distributed.layout import Chunk
        >>> from attnkit.distributed.schedule import Piece
        >>> chunk = Chunk(rank=1, start=8, length=8, local=0)  # rank 1 holds positions 8..15
        >>> piece = Piece(chunk, start=14, stop=16)  # its last two keys
        >>> piece.length, piece.local
        (2, 6)
    """

    chunk: Chunk
    start: int
    stop: int

    @property
    def length(self) -> int:
        """The number of keys, ``stop - start`` (an int).

        Example:

            >>> from attnkit.distributed.layout import Chunk
            >>> from attnkit.distributed.schedule import Piece
            >>> Piece(Chunk(rank=0, start=0, length=8, local=0), start=6, stop=8).length
            2
        """
        return self.stop - self.start

    @property
    def local(self) -> int:
        """Where the piece starts in its owner's shard (an int), that is the position along the
        shard's sequence dimension of key ``start``.

        Example:

            >>> from attnkit.distributed.layout import Chunk
            >>> from attnkit.distributed.schedule import Piece
            >>> second = Chunk(rank=0, start=12, length=4, local=4)  # zigzag: rank 0's second chunk
            >>> Piece(second, start=13, stop=16).local
            5
        """
        return self.chunk.local + self.start - self.chunk.start


@dataclass(frozen=True)
class Unit:
    """One kernel call on the receiver: query chunk ``query`` against the ``index``-th piece of the
    message from ``owner`` (``owner == rank``: its own keys), with local ranges ``lo, hi [S, R, n]``
    (int64; query row ``i`` of the chunk attends keys ``lo <= j < hi`` of ``piece``, counted from its
    first; ``(0, 0)``: none). Frozen; :func:`attnkit.distributed.schedule.make_schedule` makes them.

    Example:

        Rank 1 of two, shards of 8, a sliding window of 3 keys: its queries attend the last two keys
        of rank 0 and its own.

        >>> from attnkit import masks
        >>> from attnkit.distributed.schedule import make_schedule
        >>> schedule = make_schedule([8, 8], "contiguous", 1, masks.sliding_window(3), causal=False)
        >>> for unit in schedule.units:
        ...     print(unit.owner, (unit.piece.start, unit.piece.stop), unit.lo[0, 0, :3].tolist(),
        ...           unit.hi[0, 0, :3].tolist())
        0 (6, 8) [0, 1, 0] [2, 2, 0]
        1 (8, 16) [0, 0, 0] [1, 2, 3]
    """

    query: Chunk
    owner: int
    index: int
    piece: Piece
    lo: Tensor
    hi: Tensor


@dataclass(frozen=True)
class Schedule:
    """The rank's side of the exchange: ``sends[d]`` the pieces it sends to rank ``d``,
    ``receives[s]`` those it receives from rank ``s`` (own pieces under its own rank), ``units``.
    The planning runs on the CPU (its decisions read values); ``device`` is where the kernel calls'
    row ranges go (the inputs' device). ``chunks``: every rank's chunks (as
    :func:`attnkit.distributed.layout.chunks` gives them). Frozen; made by
    :func:`attnkit.distributed.schedule.make_schedule`.

    Example:

        >>> from attnkit import masks
        >>> from attnkit.distributed.schedule import make_schedule
        >>> window = masks.sliding_window(3)
        >>> first = make_schedule([8, 8], "contiguous", 0, window, causal=False)
        >>> {to: [(p.start, p.stop) for p in pieces] for to, pieces in first.sends.items()}
        {1: [(6, 8)]}
        >>> second = make_schedule([8, 8], "contiguous", 1, window, causal=False)
        >>> {owner: [(p.start, p.stop) for p in pieces] for owner, pieces in second.receives.items()}
        {0: [(6, 8)], 1: [(8, 16)]}
    """

    rank: int
    world: int
    chunks: list[list[Chunk]]
    sends: dict[int, list[Piece]]
    receives: dict[int, list[Piece]]
    units: list[Unit]
    device: torch.device


def _pieces_for(lo: Tensor, hi: Tensor, rows: list[Chunk], owner: list[Chunk]) -> list[tuple[Piece, Tensor, Tensor]]:
    """The pieces of ``owner``'s chunks that the rows of ``rows`` attend: each with the clipped
    global ranges of those rows (``[S, R, n]`` per row chunk, concatenated along n)."""
    index = torch.cat([torch.arange(c.start, c.stop) for c in rows]) if rows else torch.zeros(0, dtype=torch.int64)
    row_lo, row_hi = lo[..., index], hi[..., index]
    found = []
    for chunk in owner:
        c_lo, c_hi = row_lo.clamp(chunk.start, chunk.stop), row_hi.clamp(chunk.start, chunk.stop)
        live = c_hi > c_lo
        if not bool(live.any()):
            continue
        piece = Piece(chunk, int(c_lo[live].min()), int(c_hi[live].max()))
        found.append((piece, c_lo, c_hi))
    return found


def make_schedule(lengths: list[int], layout: str, rank: int, mask: StructuredMask | None,
                  causal: bool, device: torch.device | str = "cpu") -> Schedule:
    """The schedule of rank ``rank`` (see the module docstring); the same facts give every rank
    the same exchange.

    Args:
        lengths: every rank's shard length (``P`` ints).
        layout: ``"contiguous"`` or ``"zigzag"``.
        rank: the rank whose side to plan.
        mask: a structured mask over global positions (:mod:`attnkit.masks`), or None.
        causal: bottom-right causal over the whole sequence.
        device: where the units' ranges go.

    Returns:
        A :class:`attnkit.distributed.schedule.Schedule`.

    Raises:
        ValueError: for an unknown ``layout``.

    Example:

        Causal, two ranks, contiguous: rank 1 needs every key of rank 0, rank 0 none of rank 1's.

        >>> from attnkit.distributed.schedule import make_schedule
        >>> first = make_schedule([8, 8], "contiguous", 0, None, causal=True)
        >>> {to: [(p.start, p.stop) for p in pieces] for to, pieces in first.sends.items()}
        {1: [(0, 8)]}
        >>> sorted(first.receives)  # its own keys only
        [0]
        >>> second = make_schedule([8, 8], "contiguous", 1, None, causal=True)
        >>> sorted(second.receives), second.sends
        ([0, 1], {})
    """
    world = len(lengths)
    layout_chunks = chunks(lengths, layout)
    total = sum(lengths)
    lo, hi = intervals(mask, causal, total, total)
    sends: dict[int, list[Piece]] = {}
    receives: dict[int, list[Piece]] = {}
    units: list[Unit] = []
    for receiver in range(world):
        for owner in range(world):
            if rank not in (receiver, owner):
                continue
            found = _pieces_for(lo, hi, layout_chunks[receiver], layout_chunks[owner])
            if not found:
                continue
            pieces = [piece for piece, _, _ in found]
            if owner == rank:
                sends[receiver] = pieces
            if receiver == rank:
                receives[owner] = pieces
                units += _units(layout_chunks[rank], owner, found)
    if rank in sends:
        del sends[rank]  # own keys are read in place
    return Schedule(rank, world, layout_chunks, sends, receives, units, torch.device(device))


def _units(rows: list[Chunk], owner: int, found: list[tuple[Piece, Tensor, Tensor]]) -> list[Unit]:
    units = []
    for index, (piece, c_lo, c_hi) in enumerate(found):
        offset = 0
        for chunk in rows:
            lo, hi = c_lo[..., offset:offset + chunk.length], c_hi[..., offset:offset + chunk.length]
            offset += chunk.length
            live = hi > lo
            if not bool(live.any()):
                continue
            # shifted to the piece's first key; an empty range is (0, 0)
            units.append(Unit(chunk, owner, index, piece, torch.where(live, lo - piece.start, 0),
                              torch.where(live, hi - piece.start, 0)))
    return units
