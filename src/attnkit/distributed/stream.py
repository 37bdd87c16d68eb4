"""The schedule in bounded pieces: messages cut into items of a bounded number of keys, units into
kernel calls of a bounded number of query rows against one item's keys (the backward's:
``block_size`` keys, ``2 * block_size`` rows, :func:`attnkit.distributed.stream.backward_stream`; the forward's:
:func:`attnkit.distributed.stream.forward_stream`).

Why: what a rank holds beyond its own shard is the keys and values it received, their gradients on
the way home, and each kernel call's work space. Sent whole, a message is a whole shard of K and V
(at P = 2: all of the other half), which alone puts a rank above ``1/P`` of one process's memory.
Cut into items, a rank holds two items of keys and values (the one computing, the next one
travelling) and a few of gradients, and a kernel call ``2 * block_size`` rows against
``block_size`` keys: each a fraction of the shard, whatever its length. Bytes do not change, only the number of messages.

Every rank cuts the same way from the same facts (the schedule, ``block_size``), so the labels agree:
item ``j`` of step ``s`` that rank ``r`` sends to ``r + s`` is item ``j`` of step ``s`` that rank
``r + s`` receives from ``r``. An item may end one piece and start the next (zigzag: two pieces a
message); each of its **segments** lies in one piece::

    message (pieces)   [----- piece 0 -----][-- piece 1 --]
    items (size 4)     [ 0  ][ 1  ][ 2  ][ 3    ][ 4  ][5 ]      item 3: two segments
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .schedule import Piece, Schedule, Unit

__all__ = ["Call", "Item", "Stream", "forward_stream", "backward_stream", "make_stream", "default_size", "MIN_SIZE"]

#: The default block holds ``L / (2P + 14)`` keys of the whole sequence's ``L`` (228 at L = 4096 over
#: 2 ranks, 187 over 4), at least ``MIN_SIZE``. Why: beyond its own tensors (``7/8`` of ``1/P`` of
#: one process's ``q, k, v, o, dO, dq, dk, dv``), a rank holds about 16 blocks of key rows at its
#: peak (``docs/performance.md``, "Sequence parallelism"), ``16 c / 8L`` of one process:
#: ``1 / (P + 7)`` with this ``c``, 0.11 at P = 2 and 0.09 at P = 4, within the ``1/P + 10%``
#: goal's slack (``1/(8P) + 0.1``, less ~0.03 of allocator and gloo state) at every P. Larger
#: blocks cost less time (a kernel call has a fixed cost: 128-key blocks took 1.45x the time of
#: whole messages at P = 4, 256-key ones 1.0-1.16x).
MIN_SIZE = 128


@dataclass(frozen=True)
class Call:
    """One kernel call: the rank's query rows ``rows`` (the first at global position ``row_start``)
    against one segment of keys, attending ``lo <= j < hi`` (``[S, R, rows]``, relative to the
    segment's first key; an empty range is ``(0, 0)``; int64 on the schedule's device). Frozen.

    Example:

        Rank 1 of two zigzag shards of 300 (positions 150..449), causal: its first chunk's 150 rows
        against the first 128 keys it receives from rank 0.

        >>> from attnkit.distributed.schedule import make_schedule
        >>> from attnkit.distributed.stream import backward_stream
        >>> schedule = make_schedule([300, 300], "zigzag", 1, None, causal=True)  # rank 1 of 2
        >>> call = backward_stream(schedule, 128).receives[1][0].calls[0][0]
        >>> call.rows, call.row_start, tuple(call.lo.shape)
        (slice(0, 150, None), 150, (1, 1, 150))
        >>> call.lo[0, 0, 0].item(), call.hi[0, 0, 0].item()  # row 150 attends every key of 0..127
        (0, 128)
    """

    rows: slice
    row_start: int
    lo: Tensor
    hi: Tensor


@dataclass(frozen=True)
class Item:
    """Keys that travel together: ``segments`` (parts of the message's pieces, in order) and, on the
    receiver, each segment's kernel calls (``calls[g]`` for ``segments[g]``; empty on the sender):
    ``segments`` are :class:`attnkit.distributed.schedule.Piece`, ``calls`` lists of
    :class:`attnkit.distributed.stream.Call`. Frozen.

    Example:

        >>> from attnkit.distributed.schedule import make_schedule
        >>> from attnkit.distributed.stream import backward_stream
        >>> schedule = make_schedule([300, 300], "zigzag", 1, None, causal=True)  # rank 1 of 2
        >>> items = backward_stream(schedule, 128).receives[1]  # from rank 0: its keys 0..149
        >>> [[(piece.start, piece.stop) for piece in item.segments] for item in items]
        [[(0, 128)], [(128, 150)]]
        >>> [len(calls) for item in items for calls in item.calls]  # both of its query chunks
        [2, 2]
    """

    segments: list[Piece]
    calls: list[list[Call]]


@dataclass(frozen=True)
class Stream:
    """The rank's items: ``own`` (its own pieces, read in place), ``sends[s]`` / ``receives[s]``
    those of step ``s`` (to ``rank + s``, from ``rank - s``), ``labels`` the ``(step, index)`` with
    something to send or receive, in order. ``count``: items per step on every rank (labels are
    ``step * count + index``). Items are :class:`attnkit.distributed.stream.Item`; frozen.

    Example:

        >>> from attnkit.distributed.schedule import make_schedule
        >>> from attnkit.distributed.stream import backward_stream
        >>> schedule = make_schedule([300, 300], "zigzag", 1, None, causal=True)  # rank 1 of 2
        >>> stream = backward_stream(schedule, 128)
        >>> stream.count, stream.labels  # rank 0 needs 300 of its keys: 3 items; it needs 150: 2
        (3, [(1, 0), (1, 1), (1, 2)])
        >>> len(stream.sends[1]), len(stream.receives[1]), len(stream.own)
        (3, 2, 2)
    """

    count: int
    own: list[Item]
    sends: dict[int, list[Item]]
    receives: dict[int, list[Item]]
    labels: list[tuple[int, int]]

    def label(self, step: int, index: int) -> int:
        """The number of item ``index`` of step ``step``: ``step * count + index`` (an int), the same
        on the sender and the receiver (message tags are made from it).

        Example:

            >>> from attnkit.distributed.schedule import make_schedule
            >>> from attnkit.distributed.stream import backward_stream
            >>> schedule = make_schedule([300, 300], "zigzag", 1, None, causal=True)  # rank 1 of 2
            >>> stream = backward_stream(schedule, 128)
            >>> [stream.label(step, index) for step, index in stream.labels]
            [3, 4, 5]
        """
        return step * self.count + index


def default_size(lengths: list[int]) -> int:
    """``ceil(L / (2P + 14))`` keys for shards of ``lengths`` (``P`` of them, ``L`` in all), at least
    ``MIN_SIZE`` (see ``MIN_SIZE``): ring attention's default ``block_size``.

    Args:
        lengths: every rank's shard length (``P`` ints).

    Returns:
        The block size, an int.

    Example:

        >>> from attnkit.distributed.stream import default_size
        >>> default_size([2048, 2048]), default_size([1024] * 4)
        (228, 187)
        >>> default_size([100, 100])  # at least MIN_SIZE
        128
    """
    return max(MIN_SIZE, -(-sum(lengths) // (2 * len(lengths) + 14)))


def forward_stream(schedule: Schedule, size: int) -> Stream:
    """The forward's: items of ``4 * size`` keys, each unit's rows in one call. The forward holds no
    gradients, so with four times the keys in flight it still peaks below the backward (the
    accounting is in ``docs/performance.md``), and each item costs an lse merge over the unit's
    rows (a pass over the output): fewer items, fewer passes.

    Args:
        schedule: the rank's :class:`attnkit.distributed.schedule.Schedule`.
        size: the block size (``block_size``).

    Returns:
        A :class:`attnkit.distributed.stream.Stream`.

    Example:

        >>> from attnkit.distributed.schedule import make_schedule
        >>> from attnkit.distributed.stream import forward_stream
        >>> schedule = make_schedule([300, 300], "zigzag", 1, None, causal=True)  # rank 1 of 2
        >>> stream = forward_stream(schedule, 128)  # items of 512 keys: one a message
        >>> stream.labels, [[(p.start, p.stop) for p in item.segments] for item in stream.receives[1]]
        ([(1, 0)], [[(0, 150)]])
    """
    return make_stream(schedule, 4 * size, None, 4 * size, None)


def backward_stream(schedule: Schedule, size: int) -> Stream:
    """The backward's: items of ``size`` keys, calls of ``2 * size`` rows (each call's query and
    key/value gradients are fresh tensors; the kernel is ~15% slower in ``205 x 205`` calls than in
    ``410 x 205`` ones, and the rows cost less memory than the keys: dQ and dO's rows against
    keys, values, their gradients in flight and the call's dK, dV); the rank's own pieces, during
    which no other rank's keys or gradients are held (only the next item, in flight), in calls of
    ``2 * size`` rows and keys.

    Args:
        schedule: the rank's :class:`attnkit.distributed.schedule.Schedule`.
        size: the block size (``block_size``).

    Returns:
        A :class:`attnkit.distributed.stream.Stream`.

    Example:

        >>> from attnkit.distributed.schedule import make_schedule
        >>> from attnkit.distributed.stream import backward_stream
        >>> schedule = make_schedule([300, 300], "zigzag", 1, None, causal=True)  # rank 1 of 2
        >>> stream = backward_stream(schedule, 128)  # items of 128 keys
        >>> [[(p.start, p.stop) for p in item.segments] for item in stream.receives[1]]
        [[(0, 128)], [(128, 150)]]
    """
    return make_stream(schedule, size, 2 * size, 2 * size, 2 * size)


def make_stream(schedule: Schedule, keys: int, rows: int | None, own_keys: int, own_rows: int | None) -> Stream:
    """Cut ``schedule``'s messages into items of at most ``keys`` keys and its units into calls of at
    most ``rows`` rows (None: a unit's rows at once); the rank's own pieces by ``own_keys`` and
    ``own_rows`` (see the module docstring).

    Args:
        schedule: the rank's :class:`attnkit.distributed.schedule.Schedule`.
        keys, rows: the most keys an item of another rank holds, the most query rows a call runs.
        own_keys, own_rows: the same for the rank's own pieces.

    Returns:
        A :class:`attnkit.distributed.stream.Stream`.

    Example:

        Items of 100 keys, calls of 50 rows:

        >>> from attnkit.distributed.schedule import make_schedule
        >>> from attnkit.distributed.stream import make_stream
        >>> schedule = make_schedule([300, 300], "zigzag", 1, None, causal=True)  # rank 1 of 2
        >>> stream = make_stream(schedule, 100, 50, 100, 50)
        >>> [[(p.start, p.stop) for p in item.segments] for item in stream.receives[1]]
        [[(0, 100)], [(100, 150)]]
        >>> [(call.rows.start, call.rows.stop) for call in stream.receives[1][0].calls[0]]
        [(0, 50), (50, 100), (100, 150), (150, 200), (200, 250), (250, 300)]
    """
    world, rank = schedule.world, schedule.rank
    longest = max((sum(c.length for c in own) for own in schedule.chunks), default=0)
    count = max(1, -(-longest // keys))  # a message is part of its owner's shard: at most this many items
    units: dict[int, dict[int, list[Unit]]] = {}
    for unit in schedule.units:
        units.setdefault(unit.owner, {}).setdefault(unit.index, []).append(unit)
    device = schedule.device
    own = _items(schedule.receives.get(rank, []), units.get(rank, {}), own_keys, own_rows, device)
    sends: dict[int, list[Item]] = {}
    receives: dict[int, list[Item]] = {}
    for step in range(1, world):
        to, source = (rank + step) % world, (rank - step) % world
        if to in schedule.sends:
            sends[step] = _items(schedule.sends[to], {}, keys, rows, device)
        if source in schedule.receives:
            receives[step] = _items(schedule.receives[source], units.get(source, {}), keys, rows, device)
    labels = [(step, index) for step in range(1, world)
              for index in range(max(len(sends.get(step, [])), len(receives.get(step, []))))]
    return Stream(count, own, sends, receives, labels)


def _items(pieces: list[Piece], units: dict[int, list[Unit]], keys: int, rows: int | None,
           device: torch.device) -> list[Item]:
    """``pieces`` (one message) cut every ``keys`` keys; each segment with the calls of ``units``
    (by piece index) on it, ``rows`` rows a call."""
    items: list[Item] = []
    segments: list[Piece] = []
    calls: list[list[Call]] = []
    room = keys
    for index, piece in enumerate(pieces):
        start = piece.start
        while start < piece.stop:
            take = min(room, piece.stop - start)
            segment = Piece(piece.chunk, start, start + take)
            segments.append(segment)
            calls.append([call for unit in units.get(index, [])
                          for call in _calls(unit, segment, rows or unit.query.length, device)])
            start, room = start + take, room - take
            if room == 0:
                items.append(Item(segments, calls))
                segments, calls, room = [], [], keys
    if segments:
        items.append(Item(segments, calls))
    return items


def _calls(unit: Unit, segment: Piece, block: int, device: torch.device) -> list[Call]:
    """``unit``'s query rows in blocks of at most ``block`` against ``segment`` (a part of its piece);
    blocks with no key in the segment are left out. Planned on the CPU, ranges placed on ``device``."""
    shift = segment.start - unit.piece.start
    calls = []
    for first in range(0, unit.query.length, max(block, 1)):
        last = min(first + block, unit.query.length)
        lo = (unit.lo[..., first:last] - shift).clamp(0, segment.length)
        hi = (unit.hi[..., first:last] - shift).clamp(0, segment.length)
        live = hi > lo
        if not bool(live.any()):
            continue
        rows = slice(unit.query.local + first, unit.query.local + last)
        calls.append(Call(rows, unit.query.start + first, torch.where(live, lo, 0).to(device),
                          torch.where(live, hi, 0).to(device)))
    return calls
