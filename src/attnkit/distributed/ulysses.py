"""Ulysses (DeepSpeed-Ulysses) attention: an all-to-all turns sequence shards into head shards, any
attnkit backend runs each rank's heads over the whole sequence, and a second all-to-all turns the
result back into sequence shards.

``torch.distributed.all_to_all_single`` carries both exchanges (gloo implements it on the CPU, NCCL
on GPUs), over one flat buffer with split sizes, so shards of different lengths are fine (gloo's list
form ``all_to_all`` wants tensors of one size). Each rank
holds ``H / P`` query heads and ``Hkv / P`` key/value heads of the whole sequence in between, so
both must divide by the number of ranks. The exchanges are differentiable (:class:`_AllToAll`: the
backward is the reverse exchange).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .. import masks as _masks
from .._call import make_call
from ..core import attention_piece
from . import comm
from .layout import check_layout, chunks
from .ring import _check_mask, _lengths, shared_seed

__all__ = ["ulysses_attention"]


def ulysses_attention(query: Tensor, key: Tensor, value: Tensor, *, mask: _masks.StructuredMask | None = None,
                      causal: bool = False, scale: float | None = None, dropout: float = 0.0,
                      generator: torch.Generator | None = None, group: dist.ProcessGroup | None = None,
                      layout: str = "contiguous", backend: str = "auto",
                      return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    r"""Attention over a sequence split across the ranks of ``group``, by head: every rank calls it
    with its shard and gets its shard of :func:`attnkit.attention` on the whole sequence.

    Args are :func:`ring_attention`'s, plus ``backend`` (any of :func:`attnkit.backends`, run on
    each rank's heads over the whole sequence, with the structured ``mask`` as it is). ``H`` and
    ``Hkv`` must divide by the number of ranks. Dropout: the whole call's pattern, each rank
    drawing it at its heads' global indices.

    Returns:
        ``output [B, H, n, Dv]`` (and ``lse [B, H, n]`` with ``return_lse``).
    """
    call = make_call(query, key, value, mask=None, causal=causal, scale=scale, dropout=dropout,
                     generator=generator, return_weights=False)
    if query.dim() != 4 or key.shape[2] != query.shape[2]:
        raise ValueError(f"ulysses_attention takes [B, H, n, D] shards of one sequence (the same n), got query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}")
    _check_mask(mask, query)
    check_layout(layout)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % world or kv_heads % world:
        raise ValueError(f"ulysses_attention splits heads over the {world} ranks: query heads ({heads}) and "
                         f"key/value heads ({kv_heads}) must divide by {world}; got query {tuple(query.shape)}, "
                         f"key {tuple(key.shape)}")
    lengths = _lengths(query.shape[2], query.device, group, world)
    exchange = _Exchange(group, world, chunks(lengths, layout), lengths)
    seed = shared_seed(generator, query.device, group) if call.dropout > 0 else None
    whole = [exchange.to_heads(t) for t in (query, key, value)]  # [B, H/P, L, D] each
    out, lse = attention_piece(*whole, seed=seed, heads=rank * (heads // world), mask=mask, causal=causal,
                               scale=call.scale, dropout=call.dropout, backend=backend, return_lse=True)
    out = exchange.to_sequence(out)
    return (out, exchange.to_sequence(lse[..., None])[..., 0]) if return_lse else out


@dataclass(frozen=True)
class _Exchange:
    group: dist.ProcessGroup | None
    world: int
    chunks: list
    lengths: list[int]

    def to_heads(self, x: Tensor) -> Tensor:
        """``[B, H, n, D]`` sequence shards -> ``[B, H/P, L, D]``: this rank's heads, whole sequence."""
        sends = list(x.chunk(self.world, dim=1))
        shapes = [(x.shape[0], x.shape[1] // self.world, n, x.shape[3]) for n in self.lengths]
        received = _AllToAll.apply(self, shapes, *sends)
        placed = sorted(((c.start, received[r].narrow(2, c.local, c.length))
                         for r, own in enumerate(self.chunks) for c in own), key=lambda pair: pair[0])
        return torch.cat([t for _, t in placed], dim=2)

    def to_sequence(self, x: Tensor) -> Tensor:
        """``[B, H/P, L, D]`` -> ``[B, H, n, D]``: every rank's heads, this rank's shard."""
        sends = [torch.cat([x.narrow(2, c.start, c.length) for c in own], dim=2) for own in self.chunks]
        rank = dist.get_rank(self.group)
        shapes = [(x.shape[0], x.shape[1], self.lengths[rank], x.shape[3])] * self.world
        return torch.cat(_AllToAll.apply(self, shapes, *sends), dim=1)


def _all_to_all(exchange: _Exchange, shapes: list[tuple[int, ...]], sends: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """One ``all_to_all_single`` over flat buffers with split sizes (gloo's list form wants tensors of
    one size; shards of different lengths need the splits)."""
    like = sends[0]
    counts = [math.prod(shape) for shape in shapes]
    received = torch.empty(sum(counts), dtype=like.dtype, device=like.device)
    flat = torch.cat([t.reshape(-1) for t in sends])
    start = time.perf_counter()
    dist.all_to_all_single(received, flat, counts, [t.numel() for t in sends], group=exchange.group)
    rank = dist.get_rank(exchange.group)
    size = like.element_size()
    comm.count(bytes_received=(sum(counts) - counts[rank]) * size,
               bytes_sent=(flat.numel() - sends[rank].numel()) * size, wait_seconds=time.perf_counter() - start)
    return tuple(part.view(shape) for part, shape in zip(received.split(counts), shapes))


class _AllToAll(torch.autograd.Function):
    """``sends[d]`` goes to rank ``d``; returns what each rank sent here (``shapes[s]``). Backward:
    the gradients travel the other way."""

    @staticmethod
    def forward(exchange: _Exchange, shapes: list[tuple[int, ...]], *sends: Tensor) -> tuple[Tensor, ...]:
        return _all_to_all(exchange, shapes, sends)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        exchange, shapes, *sends = inputs
        ctx.exchange, ctx.send_shapes = exchange, [tuple(t.shape) for t in sends]

    @staticmethod
    def backward(ctx, *grads: Tensor):
        back = _all_to_all(ctx.exchange, ctx.send_shapes, grads)
        return (None, None, *back)
