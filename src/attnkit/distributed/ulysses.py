"""Ulysses (DeepSpeed-Ulysses) attention: an all-to-all turns sequence shards into head shards, any
attnkit backend that returns the lse runs each rank's heads over the whole sequence, and a second
all-to-all turns the result back into sequence shards.

``torch.distributed.all_to_all_single`` carries the exchanges (gloo implements it on the CPU, NCCL
on GPUs), over one flat buffer with split sizes, so shards of different lengths are fine (gloo's list
form ``all_to_all`` wants tensors of one size). Each rank holds ``H / P`` query heads and
``Hkv / P`` key/value heads of the whole sequence, so both must divide by the number of ranks.

**By groups of heads** (``_Ulysses``): a rank's heads are cut into ``head_groups`` groups of
whole key/value heads (each with its ``H / Hkv`` query heads), and only one group's whole-sequence
tensors exist at a time. The forward exchanges a group's q, k, v, runs it and sends its output
back; it saves the rank's own q, k, v and output shards and the lse (in head layout: as many
numbers as the shard's, and no exchange unless ``return_lse`` asks for it). The backward, group
by group, exchanges q, k, v, output and dO to head layout again, runs the backend's backward
from the output and lse (:func:`attnkit.core.piece_gradients`: nothing is recomputed) and sends
dq, dk, dv back. Besides the rank's own shards, the backward then holds one group's q, k, v,
output, dO and gradients over the whole sequence (``8 / G`` shards' worth) instead of every head's
(``8``): 0.50-0.52 of one process's memory at P = 2 instead of 0.68 (docs/performance.md), at the
price of exchanging q, k, v and the output once more.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import _backends
from .. import masks as _masks
from .._autocast import follows_autocast
from .._call import make_call
from ..core import attention_piece, piece_gradients
from . import comm
from .layout import check_layout, chunks
from .agreement import agree
from .ring import _check_mask, _device, _ShardFunction, shard_facts, shared_seed

__all__ = ["ulysses_attention"]

#: The default ``head_groups`` gives each group's kernel calls at least this many query-key pairs
#: (batch x the group's query heads x L x L): a group has fixed costs (five all-to-alls, each a
#: synchronisation of the ranks, and the kernel calls' set-up). 2 ranks on this 2-core machine,
#: 8 heads, D = 64, fp32, forward + backward, min of 9 interleaved: groups of one head took 1.41x
#: the time of one group at L = 1024 (58 against 41 ms), 1.08x at 2048, 1.00x at 4096 (one head
#: there is 2**24 pairs).
MIN_GROUP_PAIRS = 1 << 24


@follows_autocast
def ulysses_attention(query: Tensor, key: Tensor, value: Tensor, *, mask: _masks.StructuredMask | None = None,
                      causal: bool = False, scale: float | None = None, dropout: float = 0.0,
                      generator: torch.Generator | None = None, group: dist.ProcessGroup | None = None,
                      layout: str = "contiguous", backend: str = "auto", return_lse: bool = False,
                      head_groups: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
    r"""Attention over a sequence split across the ranks of ``group``, by head: every rank calls it
    with its shard and gets its shard of :func:`attnkit.attention` on the whole sequence.

    Args are :func:`attnkit.distributed.ring_attention`'s (``query [B, H, n, Dk]``, ``key [B, Hkv, n, Dk]``, ``value
    [B, Hkv, n, Dv]``), plus:

    Args:
        backend: a backend of :func:`attnkit.backends` that returns the lse (``"auto"`` or
            ``"tiled"``), run on each group of the rank's heads over the whole sequence, with the
            structured ``mask`` as it is; its backward runs from the saved output and lse.
        head_groups: the rank's ``Hkv / P`` key/value heads (each with its ``H / Hkv`` query
            heads) are run in this many groups, one after another, forward and backward, so that
            only one group's heads over the whole sequence are held at a time: at the backward's
            peak a rank holds its own shards (q, k, v, output; dq, dk, dv as the groups fill
            them) and one group's q, k, v, output, dO and their gradients over the whole
            sequence, ``8 / head_groups`` shards' worth (docs/performance.md). From 1 to
            ``Hkv / P``; groups differ by at most one key/value head. Default: the most groups (up to ``Hkv / P``) whose
            kernel calls each cover at least ``2**24`` query-key pairs (``B * heads of the group
            * L * L``; one head at ``L = 4096``): 1 for short sequences, where a group's fixed
            costs would dominate. The same on every rank (checked).

    ``H`` and ``Hkv`` must divide by the number of ranks. Dropout: the whole call's pattern, each
    group drawing it at its heads' global indices. Traffic: the forward exchanges q, k, v and the
    output once (and the lse with ``return_lse``); the backward q, k, v, output and dO to head
    layout and dq, dk, dv back (with ``return_lse``, the lse's gradient too).

    The ranks must agree on the call as in :func:`attnkit.distributed.ring_attention` (checked before any exchange),
    with ``head_groups`` and ``return_lse`` (it adds an exchange) instead of ``block_size``.

    Returns:
        ``output [B, H, n, Dv]`` (and ``lse [B, H, n]`` with ``return_lse``, differentiable), this
        rank's shard.

    Raises:
        ValueError: on every rank, when the ranks disagree on the call or a rank's own arguments
            are refused (heads that do not divide by the number of ranks, ``head_groups`` above
            ``Hkv / P``, a backend without the lse or its backward, ``key``/``value`` of another
            ``n`` than ``query``, an unknown ``layout``, ...; that rank raises its own error).
        TypeError: on the refusing rank (the others: ``ValueError``), for a dense tensor ``mask``
            or a ``head_groups`` that is not an int.

    Example:

        One rank in a single-process gloo group (with ``P`` ranks, each passes its own shard and
        ``H``, ``Hkv`` must divide by ``P``):

        >>> import os, torch, torch.distributed as dist
        >>> import attnkit
        >>> from attnkit import masks
        >>> from attnkit.distributed import shard, ulysses_attention
        >>> dist.init_process_group("gloo", init_method="file://" + os.path.abspath("ulysses_pg"),
        ...                         rank=0, world_size=1)
        >>> rank, world = dist.get_rank(), dist.get_world_size()
        >>> g = torch.Generator().manual_seed(0)
        >>> q = torch.randn(1, 4, 16, 8, generator=g)
        >>> k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(2))  # grouped-query: Hkv = 2
        >>> window = masks.sliding_window(4)
        >>> out = ulysses_attention(*(shard(x, rank, world) for x in (q, k, v)), mask=window, head_groups=2)
        >>> out.shape
        torch.Size([1, 4, 16, 8])
        >>> torch.allclose(out, shard(attnkit.attention(q, k, v, mask=window), rank, world), atol=1e-5)
        True
        >>> dist.destroy_process_group()
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    try:  # this rank's own checks; a refusal is heard by every rank (agreement.agree)
        call = make_call(query, key, value, mask=None, causal=causal, scale=scale, dropout=dropout,
                         generator=generator, return_weights=False, return_lse=True)
        if query.dim() != 4 or key.shape[2] != query.shape[2]:
            raise ValueError(f"ulysses_attention takes [B, H, n, D] shards of one sequence (the same n), got "
                             f"query {tuple(query.shape)}, key {tuple(key.shape)}")
        _check_mask(mask, query)
        check_layout(layout)
        _check_head_groups(head_groups)
        _check_backend(backend, call)
        heads, kv_heads = query.shape[1], key.shape[1]
        if heads % world or kv_heads % world:
            raise ValueError(f"ulysses_attention splits heads over the {world} ranks: query heads ({heads}) and "
                             f"key/value heads ({kv_heads}) must divide by {world}; got query "
                             f"{tuple(query.shape)}, key {tuple(key.shape)}")
        units = kv_heads // world
        if head_groups is not None and head_groups > units:
            raise ValueError(f"head_groups must be at most the key/value heads per rank, {kv_heads} // {world} = "
                             f"{units} (a group holds whole key/value heads), got {head_groups}")
        facts = shard_facts("ulysses_attention", query, key, value, mask, causal, layout, call)
        facts += [("head_groups", head_groups, None), ("return_lse", bool(return_lse), None)]
    except Exception as error:  # noqa: BLE001 - raised by agree on this rank, after the others heard of it
        facts = error
    shards = agree("ulysses_attention", facts, [query.shape[2]] if isinstance(facts, list) else [],
                   _device(query), group)
    lengths = [values[0] for values in shards]
    count = head_groups or default_groups(query.shape[0], heads // world, units, sum(lengths))
    exchange = _Exchange(group, world, rank, chunks(lengths, layout), lengths)
    seed = shared_seed(generator, query.device, group) if call.dropout > 0 else None
    settings = _Settings(exchange, _split(heads // world, units, count), rank * (heads // world), mask, causal,
                         call.scale, call.dropout, backend)
    out, lse = _Ulysses.apply(query, key, value, seed, settings)
    if not return_lse:
        return out
    return out, exchange.to_sequence(lse[..., None])[..., 0]


def default_groups(batch: int, heads: int, kv_heads: int, length: int) -> int:
    """The default ``head_groups`` for ``heads`` query and ``kv_heads`` key/value heads per rank and
    a whole sequence of ``length``: the most groups (at most ``kv_heads``) of at least
    :data:`MIN_GROUP_PAIRS` query-key pairs each, at least 1."""
    return max(1, min(kv_heads, batch * heads * length * length // MIN_GROUP_PAIRS))


def _check_backend(backend: str, call) -> None:
    """Before any message, so that a refused backend fails every rank alike: each group's backward
    runs from its output and lse, so the backend must return the lse and have that backward."""
    chosen = _backends.get_backend(_backends.choose(call).backend if backend == "auto" else backend)
    if not (chosen.returns_lse and chosen.gradients is not None):
        capable = [name for name in _backends.backends()[1:]
                   if _backends.get_backend(name).returns_lse and _backends.get_backend(name).gradients is not None]
        raise ValueError(f"ulysses_attention runs each group's backward from its output and lse: backend "
                         f"{backend!r} returns no lse or has no such backward; use 'auto' or one of {capable}")
    _backends.resolve(backend, call)  # the device


def _check_head_groups(head_groups: object) -> None:
    if head_groups is None:
        return
    if isinstance(head_groups, bool) or not isinstance(head_groups, int):
        raise TypeError(f"head_groups must be a positive int or None, got {type(head_groups).__name__} "
                        f"{head_groups!r}")
    if head_groups < 1:
        raise ValueError(f"head_groups must be a positive number of groups (or None), got {head_groups}")


def _split(heads: int, kv_heads: int, count: int) -> tuple[tuple[int, int, int, int], ...]:
    """``count`` groups of a rank's ``kv_heads`` key/value heads (sizes differing by at most one),
    each with its query heads: ``(first query head, query heads, first kv head, kv heads)``, local."""
    ratio = heads // kv_heads
    sizes = [kv_heads // count + (g < kv_heads % count) for g in range(count)]
    starts = [sum(sizes[:g]) for g in range(count)]
    return tuple((start * ratio, size * ratio, start, size) for start, size in zip(starts, sizes))


@dataclass(frozen=True)
class _Exchange:
    """The all-to-alls between sequence shards ``[B, H, n, D]`` (this rank's ``n`` positions, every
    head) and head shards ``[B, h, L, D]`` (some of this rank's ``H / P`` heads, every position).
    Several tensors travel in one ``all_to_all_single``: each call is a synchronisation of every
    rank, and gloo's cost a call (about a millisecond here) adds up over groups."""

    group: dist.ProcessGroup | None
    world: int
    rank: int
    chunks: list
    lengths: list[int]

    def to_heads(self, items: list[tuple[Tensor, int, int]]) -> list[Tensor]:
        """Each ``(x, start, count)``: the sequence shard ``x [B, H, n, D]`` -> ``[B, count, L, D]``,
        heads ``start .. start + count`` of this rank's ``H / P`` over the whole sequence. Not
        differentiable."""
        sends = [[[x.narrow(1, r * (x.shape[1] // self.world) + start, count)] for x, start, count in items]
                 for r in range(self.world)]
        shapes = [[(x.shape[0], count, n, x.shape[3]) for x, _, count in items] for n in self.lengths]
        received = self.exchange(pack(sends), shapes)
        wholes = []
        for index, (x, _, count) in enumerate(items):
            whole = x.new_empty(x.shape[0], count, sum(self.lengths), x.shape[3])
            for parts, own in zip(received, self.chunks):
                for c in own:
                    whole[:, :, c.start:c.start + c.length] = parts[index][:, :, c.local:c.local + c.length]
            wholes.append(whole)
        return wholes

    def sequence_message(self, xs: list[Tensor]) -> tuple[tuple[Tensor, list[int]], list[tuple[int, ...]]]:
        """The packed message that sends ``xs`` (``[B, h, L, D]`` each) to sequence layout, and the
        shapes each rank sends back; the caller may free ``xs`` before :meth:`to_sequence_into`."""
        sends = [[[x[:, :, c.start:c.start + c.length] for c in own] for x in xs] for own in self.chunks]
        return pack(sends), [(x.shape[0], x.shape[1], self.lengths[self.rank], x.shape[3]) for x in xs]

    def to_sequence_into(self, message: tuple[tuple[Tensor, list[int]], list[tuple[int, ...]]],
                         targets: list[tuple[Tensor, int]]) -> None:
        """Exchange a :meth:`sequence_message` and write each of its tensors, heads ``start ..`` of
        every rank's ``H / P``, into ``(target [B, H, n, D], start)``: this rank's shard."""
        packed, shapes = message
        for r, parts in enumerate(self.exchange(packed, [shapes] * self.world)):
            for part, (target, start) in zip(parts, targets):
                first = r * (target.shape[1] // self.world) + start
                target[:, first:first + part.shape[1]] = part

    def to_sequence(self, x: Tensor) -> Tensor:
        """``[B, H/P, L, D]`` -> ``[B, H, n, D]``: every rank's heads, this rank's shard. Differentiable."""
        sends = [torch.cat([x.narrow(2, c.start, c.length) for c in own], dim=2) for own in self.chunks]
        shapes = [(x.shape[0], x.shape[1], self.lengths[self.rank], x.shape[3])] * self.world
        return torch.cat(_AllToAll.apply(self, shapes, *sends), dim=1)

    def exchange(self, packed: tuple[Tensor, list[int]], shapes: list[list[tuple[int, ...]]]) -> list[list[Tensor]]:
        """One ``all_to_all_single`` of a message from :func:`pack` (flat buffers with split sizes:
        gloo's list form wants tensors of one size, shards of different lengths need the splits);
        returns, per source rank, the tensors it sent here (``shapes[s]``), views of one buffer."""
        flat, send_counts = packed
        counts = [[math.prod(shape) for shape in own] for own in shapes]
        totals = [sum(own) for own in counts]
        received = torch.empty(sum(totals), dtype=flat.dtype, device=flat.device)
        start = time.perf_counter()
        dist.all_to_all_single(received, flat, totals, send_counts, group=self.group)
        size = flat.element_size()
        comm.count(bytes_received=(sum(totals) - totals[self.rank]) * size,
                   bytes_sent=(flat.numel() - send_counts[self.rank]) * size, wait_seconds=time.perf_counter() - start)
        return [[part.view(shape) for part, shape in zip(block.split(own), shapes[s])]
                for s, (block, own) in enumerate(zip(received.split(totals), counts))]


def pack(sends: list[list[list[Tensor]]]) -> tuple[Tensor, list[int]]:
    """``sends[d]``: the tensors for rank ``d``, each given as ``[B, h, m, D]`` pieces to join along
    dim 2, copied straight into one flat buffer (the pieces are views of shards: one copy, not
    one per piece and another for the buffer); returns it and each rank's element count."""
    shapes = [[(*pieces[0].shape[:2], sum(p.shape[2] for p in pieces), *pieces[0].shape[3:]) for pieces in tensors]
              for tensors in sends]
    like = sends[0][0][0]
    flat = torch.empty(sum(math.prod(shape) for own in shapes for shape in own), dtype=like.dtype, device=like.device)
    places = iter(flat.split([math.prod(shape) for own in shapes for shape in own]))
    for tensors, own in zip(sends, shapes):
        for pieces, shape in zip(tensors, own):
            place, row = next(places).view(shape), 0
            for piece in pieces:
                place[:, :, row:row + piece.shape[2]] = piece
                row += piece.shape[2]
    return flat, [sum(math.prod(shape) for shape in own) for own in shapes]


class _AllToAll(torch.autograd.Function):
    """``sends[d]`` goes to rank ``d``; returns what each rank sent here (``shapes[s]``). Backward:
    the gradients travel the other way."""

    @staticmethod
    def forward(exchange: _Exchange, shapes: list[tuple[int, ...]], *sends: Tensor) -> tuple[Tensor, ...]:
        return tuple(parts[0] for parts in exchange.exchange(pack([[[t]] for t in sends]), [[s] for s in shapes]))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        exchange, shapes, *sends = inputs
        ctx.exchange, ctx.send_shapes = exchange, [tuple(t.shape) for t in sends]

    @staticmethod
    def backward(ctx, *grads: Tensor):
        back = ctx.exchange.exchange(pack([[[g]] for g in grads]), [[s] for s in ctx.send_shapes])
        return (None, None, *(parts[0] for parts in back))


@dataclass(frozen=True)
class _Settings:
    exchange: _Exchange
    groups: tuple[tuple[int, int, int, int], ...]  # (query head, query heads, kv head, kv heads), local
    heads: int  # the global index of this rank's first query head
    mask: _masks.StructuredMask | None
    causal: bool
    scale: float
    dropout: float
    backend: str

    def arguments(self, first: int) -> dict:
        """:func:`attention_piece`'s arguments for the group whose first local query head is ``first``."""
        return dict(heads=self.heads + first, mask=self.mask, causal=self.causal, scale=self.scale,
                    dropout=self.dropout, backend=self.backend)


class _Ulysses(_ShardFunction):
    """Forward and backward by groups of heads (the output saved as sequence shards, the lse in
    head layout)."""

    @staticmethod
    def forward(query: Tensor, key: Tensor, value: Tensor, seed: Tensor | None,
                settings: _Settings) -> tuple[Tensor, Tensor]:
        exchange = settings.exchange
        batch, heads, n, _ = query.shape
        out = query.new_empty(batch, heads, n, value.shape[3])
        lse = None
        for first, count, kv_first, kv_count in settings.groups:
            whole = exchange.to_heads([(query, first, count), (key, kv_first, kv_count), (value, kv_first, kv_count)])
            part, part_lse = attention_piece(*whole, seed=seed, return_lse=True, **settings.arguments(first))
            del whole
            if lse is None:
                lse = part_lse.new_empty(batch, heads // exchange.world, part_lse.shape[2])
            lse[:, first:first + count] = part_lse
            exchange.to_sequence_into(exchange.sequence_message([part]), [(out, first)])
            del part, part_lse
        return out, lse

    @staticmethod
    @once_differentiable  # the groups' gradients come from the kernels, not from a graph: no second order
    def backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
        query, key, value, out, lse, seed = ctx.saved_tensors
        settings = ctx.settings
        exchange = settings.exchange
        if grad_out is None:  # every rank still exchanges it: the others' all-to-alls wait for this one's
            grad_out = out.new_zeros(()).expand(out.shape)
        dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        for first, count, kv_first, kv_count in settings.groups:
            # two exchanges, not one: the received buffer and the tensors placed from it coexist for
            # a moment, and five tensors' worth of both would outgrow the kernel call's peak below
            query_heads, key_heads, value_heads = exchange.to_heads(
                [(query, first, count), (key, kv_first, kv_count), (value, kv_first, kv_count)])
            out_heads, grad_heads = exchange.to_heads([(out, first, count), (grad_out, first, count)])
            grads = piece_gradients(query_heads, key_heads, value_heads, out_heads, lse[:, first:first + count],
                                    grad_heads, None if grad_lse is None else grad_lse[:, first:first + count],
                                    seed=seed, **settings.arguments(first))
            del query_heads, key_heads, value_heads, out_heads, grad_heads  # the peak: these and the grads
            message = exchange.sequence_message(list(grads))
            del grads
            exchange.to_sequence_into(message, [(dq, first), (dk, kv_first), (dv, kv_first)])
            del message
        return dq, dk, dv, None, None
