"""The point-to-point exchange of key/value pieces over ``torch.distributed``, and its traffic.

One message per (sender, receiver) and label (an item of :mod:`attnkit.distributed.stream`): its segments' keys and
values, each tensor sent with ``isend`` and received with ``irecv`` (asynchronous on every
backend: gloo runs them on its own threads, NCCL on its streams) so the caller computes while
they travel. Device-agnostic: the
buffers live on the inputs' device.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from .schedule import Piece

__all__ = ["Traffic", "traffic", "Exchange"]


@dataclass
class Traffic:
    """What this rank's sequence-parallel calls moved and waited for, while :func:`attnkit.distributed.traffic` records.

    ``bytes_received`` / ``bytes_sent``: payload of the point-to-point messages and all-to-alls
    (keys and values forward, again in the backward, plus the key/value gradients going home);
    ``units``: kernel calls run (query rows against one segment of keys); ``messages``: sends
    (a label's keys and values, or its key/value gradients going home); ``wait_seconds``: time
    spent blocked on communication, i.e. not hidden behind compute.

    Example:

        >>> from attnkit.distributed import Traffic
        >>> Traffic()  # what a record starts from
        Traffic(bytes_received=0, bytes_sent=0, messages=0, units=0, wait_seconds=0.0)

        :func:`attnkit.distributed.traffic` fills one in.
    """

    bytes_received: int = 0
    bytes_sent: int = 0
    messages: int = 0
    units: int = 0
    wait_seconds: float = 0.0


_recording: list[Traffic] = []


@contextlib.contextmanager
def traffic() -> Iterator[Traffic]:
    """Record this rank's sequence-parallel traffic (``with attnkit.distributed.traffic() as t:``).

    Yields:
        A fresh :class:`attnkit.distributed.Traffic`, counting the calls made inside the block (by
        this thread or another; nested records each count them).

    Example:

        One rank (a single-process gloo group): nothing travels, one kernel call runs.

        >>> import os, torch, torch.distributed as dist
        >>> from attnkit.distributed import ring_attention, traffic
        >>> dist.init_process_group("gloo", init_method="file://" + os.path.abspath("traffic_pg"),
        ...                         rank=0, world_size=1)
        >>> q = k = v = torch.ones(1, 2, 8, 4)
        >>> with traffic() as t:
        ...     out = ring_attention(q, k, v, causal=True)
        >>> t.bytes_sent, t.bytes_received, t.messages, t.units
        (0, 0, 0, 1)
        >>> dist.destroy_process_group()
    """
    record = Traffic()
    _recording.append(record)
    try:
        yield record
    finally:
        _recording.remove(record)


def count(**amounts: float) -> None:
    for record in _recording:
        for name, amount in amounts.items():
            setattr(record, name, getattr(record, name) + amount)


def wait(works: list) -> None:
    """Wait for ``works``, counting the time blocked."""
    if not works:
        return
    start = time.perf_counter()
    for work in works:
        work.wait()
    count(wait_seconds=time.perf_counter() - start)


class Exchange:
    """Sends and receives of one label: post now, :meth:`attnkit.distributed.comm.Exchange.wait` later. A
    message is a list of tensors, each sent on its own (tag ``256 * tag + index``), so a segment
    that is already contiguous (any run of keys of a ``[1, H, n, D]`` shard) travels without a
    packing copy.

    ``group``: the process group (None: the whole world), ranks counted in it; ``tag``: the label's
    number, distinct among the exchanges in flight between two ranks. Both ends of a message must
    post it (one :meth:`attnkit.distributed.comm.Exchange.send`, the other
    :meth:`attnkit.distributed.comm.Exchange.receive`) with the same ``tag``.

    Example:

        The exchange of ring attention's step 1: send this rank's keys to the next rank, receive
        the previous one's. One rank (a single-process gloo group) has no peer, so nothing is
        posted and nothing arrives:

        >>> import os, torch, torch.distributed as dist
        >>> from attnkit.distributed.comm import Exchange
        >>> dist.init_process_group("gloo", init_method="file://" + os.path.abspath("exchange_pg"),
        ...                         rank=0, world_size=1)
        >>> rank, world = dist.get_rank(), dist.get_world_size()
        >>> keys = torch.randn(1, 2, 4, 8)  # [B, H, n, D]
        >>> exchange = Exchange(None, tag=1)
        >>> if world > 1:
        ...     exchange.send((rank + 1) % world, [keys])
        ...     exchange.receive((rank - 1) % world, [tuple(keys.shape)], keys.dtype, keys.device)
        >>> exchange.wait()  # {source: [tensor, ...]}
        {}
        >>> dist.destroy_process_group()
    """

    def __init__(self, group: dist.ProcessGroup | None, tag: int) -> None:
        self.group, self.tag = group, tag
        self.works: list = []
        self.received: dict[int, list[Tensor]] = {}
        self.sent: list[Tensor] = []

    def _peer(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def send(self, to: int, tensors: list[Tensor]) -> None:
        """Post ``tensors`` (any shapes; made contiguous, kept alive until
        :meth:`attnkit.distributed.comm.Exchange.wait`) to rank ``to`` of the group: one ``isend``
        each, tag ``256 * tag + index``. Returns at once; counted by
        :func:`attnkit.distributed.traffic` (bytes, one message). ``to`` must not be this rank (the
        backend refuses a message to itself).

        Example:

            >>> import os, torch, torch.distributed as dist
            >>> from attnkit.distributed.comm import Exchange
            >>> dist.init_process_group("gloo", init_method="file://" + os.path.abspath("send_pg"),
            ...                         rank=0, world_size=1)
            >>> rank, world = dist.get_rank(), dist.get_world_size()
            >>> exchange = Exchange(None, tag=2)
            >>> for peer in range(world):  # the keys and values to every other rank
            ...     if peer != rank:
            ...         exchange.send(peer, [torch.zeros(1, 2, 4, 8), torch.ones(1, 2, 4, 8)])
            >>> len(exchange.sent) == 2 * (world - 1)
            True
            >>> exchange.wait()
            {}
            >>> dist.destroy_process_group()
        """
        for index, tensor in enumerate(tensors):
            tensor = tensor.contiguous()
            self.sent.append(tensor)  # alive until the send completes
            self.works.append(dist.isend(tensor, self._peer(to), group=self.group, tag=256 * self.tag + index))
            count(bytes_sent=tensor.numel() * tensor.element_size())
        count(messages=1)

    def receive(self, source: int, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> None:
        """Post receives of the message ``source`` sends (one ``irecv`` a tensor of ``shapes``, of
        ``dtype`` on ``device``, into fresh buffers): :meth:`attnkit.distributed.comm.Exchange.wait`
        returns them under ``source``.
        Returns at once; counted by :func:`attnkit.distributed.traffic` (bytes). The shapes,
        dtype and number of tensors must be those the sender sends.

        Example:

            >>> import os, torch, torch.distributed as dist
            >>> from attnkit.distributed.comm import Exchange
            >>> dist.init_process_group("gloo", init_method="file://" + os.path.abspath("receive_pg"),
            ...                         rank=0, world_size=1)
            >>> rank, world = dist.get_rank(), dist.get_world_size()
            >>> exchange = Exchange(None, tag=3)
            >>> for peer in range(world):  # keys and values [1, 2, 4, 8] from every other rank
            ...     if peer != rank:
            ...         exchange.receive(peer, [(1, 2, 4, 8)] * 2, torch.float32, torch.device("cpu"))
            >>> received = exchange.wait()
            >>> sorted(received) == [peer for peer in range(world) if peer != rank]
            True
            >>> dist.destroy_process_group()
        """
        buffers = []
        for index, shape in enumerate(shapes):
            buffer = torch.empty(shape, dtype=dtype, device=device)
            self.works.append(dist.irecv(buffer, self._peer(source), group=self.group, tag=256 * self.tag + index))
            buffers.append(buffer)
            count(bytes_received=buffer.numel() * buffer.element_size())
        self.received[source] = buffers

    def wait(self) -> dict[int, list[Tensor]]:
        """Block until every posted send and receive completes (the time counted as
        ``wait_seconds`` by :func:`attnkit.distributed.traffic`); forget them and the sent tensors.

        Returns:
            ``{source: [tensor, ...]}``: each received message, in the order of its shapes.

        Example:

            >>> from attnkit.distributed.comm import Exchange
            >>> Exchange(None, tag=4).wait()  # nothing posted: returns at once
            {}
        """
        wait(self.works)
        self.works, self.sent = [], []
        return self.received


def views(pieces: list[Piece], *tensors: Tensor) -> list[Tensor]:
    """The pieces of each of ``tensors`` (``[B, H, L, D]``, positions along dim 2): per tensor, per piece."""
    return [t[:, :, p.local:p.local + p.length] for t in tensors for p in pieces]


def shapes(pieces: list[Piece], *tensors: Tensor) -> list[tuple[int, ...]]:
    """The shapes :func:`views` gives for tensors shaped like ``tensors``."""
    return [(t.shape[0], t.shape[1], p.length, t.shape[3]) for t in tensors for p in pieces]
