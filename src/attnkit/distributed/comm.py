"""The point-to-point exchange of key/value pieces over ``torch.distributed``, and its traffic.

One message per (sender, receiver) and label (an item of :mod:`.stream`): its segments' keys and
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
    """What this rank's sequence-parallel calls moved and waited for, while :func:`traffic` records.

    ``bytes_received`` / ``bytes_sent``: payload of the point-to-point messages and all-to-alls
    (keys and values forward, again in the backward, plus the key/value gradients going home);
    ``units``: kernel calls run (query rows against one segment of keys); ``messages``: sends
    (a label's keys and values, or its key/value gradients going home); ``wait_seconds``: time
    spent blocked on communication, i.e. not hidden behind compute."""

    bytes_received: int = 0
    bytes_sent: int = 0
    messages: int = 0
    units: int = 0
    wait_seconds: float = 0.0


_recording: list[Traffic] = []


@contextlib.contextmanager
def traffic() -> Iterator[Traffic]:
    """Record this rank's sequence-parallel traffic (``with attnkit.distributed.traffic() as t:``)."""
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
    """Sends and receives of one label: post now, :meth:`wait` later. A message is a list of tensors,
    each sent on its own (tag ``256 * tag + index``), so a segment that is already contiguous
    (any run of keys of a ``[1, H, n, D]`` shard) travels without a packing copy."""

    def __init__(self, group: dist.ProcessGroup | None, tag: int) -> None:
        self.group, self.tag = group, tag
        self.works: list = []
        self.received: dict[int, list[Tensor]] = {}
        self.sent: list[Tensor] = []

    def _peer(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def send(self, to: int, tensors: list[Tensor]) -> None:
        for index, tensor in enumerate(tensors):
            tensor = tensor.contiguous()
            self.sent.append(tensor)  # alive until the send completes
            self.works.append(dist.isend(tensor, self._peer(to), group=self.group, tag=256 * self.tag + index))
            count(bytes_sent=tensor.numel() * tensor.element_size())
        count(messages=1)

    def receive(self, source: int, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> None:
        buffers = []
        for index, shape in enumerate(shapes):
            buffer = torch.empty(shape, dtype=dtype, device=device)
            self.works.append(dist.irecv(buffer, self._peer(source), group=self.group, tag=256 * self.tag + index))
            buffers.append(buffer)
            count(bytes_received=buffer.numel() * buffer.element_size())
        self.received[source] = buffers

    def wait(self) -> dict[int, list[Tensor]]:
        wait(self.works)
        self.works, self.sent = [], []
        return self.received


def views(pieces: list[Piece], *tensors: Tensor) -> list[Tensor]:
    """The pieces of each of ``tensors`` (``[B, H, L, D]``, positions along dim 2): per tensor, per piece."""
    return [t[:, :, p.local:p.local + p.length] for t in tensors for p in pieces]


def shapes(pieces: list[Piece], *tensors: Tensor) -> list[tuple[int, ...]]:
    """The shapes :func:`views` gives for tensors shaped like ``tensors``."""
    return [(t.shape[0], t.shape[1], p.length, t.shape[3]) for t in tensors for p in pieces]
