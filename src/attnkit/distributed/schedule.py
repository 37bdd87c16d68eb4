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
    """Keys ``[start, stop)`` (global) of ``chunk``, sent to one receiver (or kept: own chunk)."""

    chunk: Chunk
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start

    @property
    def local(self) -> int:
        """Where the piece starts in its owner's shard."""
        return self.chunk.local + self.start - self.chunk.start


@dataclass(frozen=True)
class Unit:
    """One kernel call on the receiver: query chunk ``query`` against the ``index``-th piece of the
    message from ``owner`` (``owner == rank``: its own keys), with local ranges ``lo, hi [S, R, n]``."""

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
    row ranges go (the inputs' device)."""

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
    the same exchange."""
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
