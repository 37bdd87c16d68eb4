"""Ring attention: each rank holds its shard of the sequence; key/value pieces travel to the ranks
whose queries attend them, partial results merge exactly through the lse.

At step ``s`` (1 .. P-1) rank ``r`` sends its pieces to rank ``r + s`` and receives rank ``r - s``'s
(mod P), point to point: the ring's pattern (every rank sends one message and receives one per
step), but straight from the owner, so a rank that needs no key of another rank neither receives its
shard nor relays it (:mod:`attnkit.distributed.schedule`: the mask decides). The pieces travel in
**items** of at most ``block_size`` keys (:mod:`attnkit.distributed.stream`), one label
``(step, index)`` after another; the next label's messages are posted before this one is computed,
so they travel while the kernels run, and a rank holds two items of other ranks' keys at a time,
never a whole shard.

Forward: each call (a unit's query rows against one item's keys) is the tiled backend's op,
``attnkit::interval_attention`` (what :func:`attnkit.attention` runs with ``return_lse=True``),
with the call's ranges and the whole call's dropout seed at its positions, merged into the rows'
output by lse. Backward (``_Ring``): the items travel again; each call's gradients (at most
``2 * block_size`` rows) come from the op's split-key backward (``attnkit::interval_attention_backward``)
given the *merged* output and lse, so nothing is recomputed twice and no partial output is stored;
the key and value gradients of a received item go back to its owner, who adds them to its own.

Why no deadlock: every wait at label ``x`` (an item's keys, a send) needs only messages that the
peers post at label ``x``, and a rank posts label ``x`` once it is done with the labels before
(its labels ascend; all ranks number them alike); the gradients of label ``x`` are received once
``x`` is computed and waited at this rank's next label.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import masks as _masks
from .._backends import dropout as _dropout
from .._backends import interval_op
from .._backends.blockwise import _merge_into
from .._backends.interval_inputs import IntervalInputs
from .._backends.numerics import work_dtype
from .._autocast import follows_autocast
from .._call import make_call
from . import comm
from .agreement import agree, mask_fact
from .layout import check_layout
from .schedule import Piece, Schedule, make_schedule
from .stream import Call, Item, Stream, backward_stream, default_size, forward_stream

__all__ = ["ring_attention"]


@follows_autocast
def ring_attention(query: Tensor, key: Tensor, value: Tensor, *, mask: _masks.StructuredMask | None = None,
                   causal: bool = False, scale: float | None = None, dropout: float = 0.0,
                   generator: torch.Generator | None = None, group: dist.ProcessGroup | None = None,
                   layout: str = "contiguous", return_lse: bool = False,
                   block_size: int | None = None) -> Tensor | tuple[Tensor, Tensor]:
    r"""Attention over a sequence split across the ranks of ``group``; every rank calls it with its shard.

    The result on each rank is its shard of ``attnkit.attention`` on the whole sequence: the same
    output (and lse, and gradients to query, key and value) to rounding.

    Args:
        query: this rank's queries ``[B, H, n, Dk]`` (``n`` may differ from rank to rank).
        key, value: this rank's keys and values ``[B, Hkv, n, Dk]``, ``[B, Hkv, n, Dv]``
            (``H % Hkv == 0``: grouped-query attention; the same ``n`` as the query).
        mask: a structured mask over **global** positions (:mod:`attnkit.masks`: causal, sliding
            windows, documents, padding, ...), or None. It decides what is sent: a key no local
            query attends is neither received nor computed. Dense tensor masks are refused
            (an ``L x L`` tensor is what sequence parallelism avoids).
        causal: bottom-right aligned over the whole sequence (``Lq = Lk`` there, so ``j <= i``).
        scale, dropout, generator: as in :func:`attnkit.attention`. The dropout pattern is the
            whole call's, on global positions: the same generator state gives the same result as
            one process. Every rank draws the seed from its ``generator`` (so each generator
            advances as in one process) and rank 0's is broadcast, so ranks agree even if their
            generators do not.
        group: the process group (default: the whole world).
        layout: ``"contiguous"`` (rank ``r`` holds the ``r``-th run of positions) or ``"zigzag"``
            (chunks ``r`` and ``2P-1-r`` of ``2P``: balanced causal work); see
            :func:`attnkit.distributed.shard`.
        return_lse: also return the lse ``[B, H, n]`` (float32 for half inputs, ``-inf`` on
            rows with no key), differentiable.
        block_size: other ranks' keys and values travel in messages of at most this many keys
            (the forward's: four times as many), and each kernel call of the backward runs at
            most twice as many query rows against one message's keys: a rank holds about 16
            such blocks of key rows beyond its own shard, never a whole other shard
            (:mod:`attnkit.distributed.stream`). Default: ``L / (2P + 14)`` of the whole
            sequence's ``L`` keys, at least 128 (228 at L = 4096 over 2 ranks). Smaller saves
            memory and costs time. The same on every rank (checked).

    Before any exchange the ranks check that they agree on the call
    (:mod:`attnkit.distributed.agreement`: one
    ``all_gather`` of 32 int64 numbers a rank): the dtype, batch, query and key/value heads, head
    sizes, mask (kind, parameters and the tensors it holds), ``causal``, layout, scale, dropout
    and ``block_size``. Ranks that disagree, or a rank whose own arguments are refused, make every
    rank raise (``ValueError``: "ring_attention: the ranks disagree on dtype: rank 0
    torch.float32, rank 1 torch.bfloat16; ...") instead of exchanging mismatched messages.

    Returns:
        ``output [B, H, n, Dv]`` (and ``lse [B, H, n]`` with ``return_lse``), this rank's shard.
        Under ``torch.autocast``, as :func:`attnkit.attention`: float32 shards run in the autocast
        dtype, and the output comes back in it.

    Raises:
        ValueError: on every rank, when the ranks disagree on the call, or when a rank's own
            arguments are refused (``query`` not 4-D, ``key``/``value`` of another ``n``, an unknown
            ``layout``, ``block_size < 1``, a mask for another batch, ...; that rank raises its own
            error); also when ``block_size`` cuts the shards into more messages than the message
            tags can number.
        TypeError: on the refusing rank (the others: ``ValueError``), for a dense tensor ``mask``
            or a ``block_size`` that is not an int.

    Example:

        Every rank passes its shard of the whole sequence (here one rank, a single-process gloo
        group: its shard is the whole sequence) and gets its shard of the output:

        >>> import os, torch, torch.distributed as dist
        >>> import attnkit
        >>> from attnkit.distributed import ring_attention, shard
        >>> dist.init_process_group("gloo", init_method="file://" + os.path.abspath("ring_pg"),
        ...                         rank=0, world_size=1)
        >>> rank, world = dist.get_rank(), dist.get_world_size()
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v = (torch.randn(1, 4, 16, 8, generator=g) for _ in range(3))  # the whole sequence
        >>> mine = [shard(x, rank, world, layout="zigzag") for x in (q, k, v)]
        >>> out, lse = ring_attention(*mine, causal=True, layout="zigzag", return_lse=True)
        >>> out.shape, lse.shape
        (torch.Size([1, 4, 16, 8]), torch.Size([1, 4, 16]))
        >>> whole = attnkit.attention(q, k, v, causal=True)
        >>> torch.allclose(out, shard(whole, rank, world, layout="zigzag"), atol=1e-5)
        True
        >>> dist.destroy_process_group()
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    try:  # this rank's own checks; a refusal is heard by every rank (agreement.agree)
        call = make_call(query, key, value, mask=None, causal=causal, scale=scale, dropout=dropout,
                         generator=generator, return_weights=False)
        if query.dim() != 4:
            raise ValueError(f"ring_attention takes [B, H, n, D] shards, got query {tuple(query.shape)}")
        if key.shape[2] != query.shape[2]:
            raise ValueError(f"query and key/value must be shards of one sequence (the same n): got query "
                             f"{tuple(query.shape)}, key {tuple(key.shape)}")
        _check_mask(mask, query)
        check_layout(layout)
        _check_block_size(block_size)
        facts = shard_facts("ring_attention", query, key, value, mask, causal, layout, call)
        facts.append(("block_size", block_size, None))
    except Exception as error:  # noqa: BLE001 - raised by agree on this rank, after the others heard of it
        facts = error
    shards = agree("ring_attention", facts, [query.shape[2]] if isinstance(facts, list) else [],
                   _device(query), group)
    lengths = [values[0] for values in shards]
    size = block_size or default_size(lengths)
    schedule = make_schedule(lengths, layout, rank, mask, causal, query.device)
    streams = forward_stream(schedule, size), backward_stream(schedule, size)
    if KINDS * streams[1].label(world, 0) * 256 >= 2 ** 31:  # message tags are int32 (comm.Exchange)
        raise ValueError(f"block_size {size} cuts shards of up to {max(lengths)} keys into {streams[1].count} "
                         f"messages each: too many for {world} ranks' message tags; use a larger block_size")
    seed = shared_seed(generator, query.device, group) if call.dropout > 0 else None
    settings = _Settings(schedule, *streams, call.scale, call.dropout, group)
    out, lse = _Ring.apply(query, key, value, seed, settings)
    return (out, lse) if return_lse else out


def _check_mask(mask: object, query: Tensor) -> None:
    if mask is None:
        return
    if isinstance(mask, Tensor):
        raise TypeError("mask must be a structured mask over global positions (attnkit.masks) or None: a dense "
                        f"tensor mask {tuple(mask.shape)} is L x L over the whole sequence, which sequence "
                        "parallelism avoids")
    if not isinstance(mask, _masks.StructuredMask):
        raise TypeError(f"mask must be a structured mask from attnkit.masks or None, got {type(mask).__name__}")
    if mask.batch_size not in (None, 1, query.shape[0]):
        raise ValueError(f"mask {mask!r} describes {mask.batch_size} sequences but the query {tuple(query.shape)} "
                         f"has batch {query.shape[0]}")


def _check_block_size(block_size: object) -> None:
    if block_size is None:
        return
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be a positive int or None, got {type(block_size).__name__} {block_size!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be a positive number of keys (or None), got {block_size}")


def shard_facts(function: str, query: Tensor, key: Tensor, value: Tensor, mask: object, causal: bool, layout: str,
                call) -> list[tuple[str, object, str | None]]:
    """What every rank of a sequence-parallel call must share (:func:`agreement.agree`), in the order
    the first difference is reported: the shards' dtype and shapes beyond the sequence, the mask,
    ``causal``, the layout, the scale and the dropout probability (``call``: the checked call)."""
    return [("method", function, None), ("dtype", query.dtype, None), ("batch size", query.shape[0], None),
            ("query heads", query.shape[1], None), ("key/value heads", key.shape[1], None),
            ("query/key head size", query.shape[3], None), ("value head size", value.shape[3], None),
            mask_fact(mask), ("causal", causal, None), ("layout", repr(layout), None), ("scale", call.scale, None),
            ("dropout", call.dropout, None)]


def _device(query: object) -> torch.device:
    return query.device if isinstance(query, Tensor) else torch.device("cpu")


def shared_seed(generator: torch.Generator | None, device: torch.device, group) -> Tensor:
    """The call's dropout seed, drawn on every rank (each generator advances as in one process) and
    rank 0's broadcast (so the ranks agree whatever their generators' states)."""
    seed = _dropout.draw_seed(generator, device).to(device).reshape(1)
    source = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast(seed, source, group=group)
    return seed[0]


@dataclass(frozen=True)
class _Settings:
    schedule: Schedule
    forward: Stream
    backward: Stream
    scale: float
    dropout: float
    group: dist.ProcessGroup | None


def _seed_at(seed: Tensor | None, call: Call, segment: Piece) -> Tensor | None:
    """The whole call's dropout seed placed at the call's first row and the segment's first key."""
    return None if seed is None else _dropout.at_positions(seed, 0, call.row_start, segment.start)


def _post(settings: _Settings, stream: Stream, key: Tensor, value: Tensor, kind: int, index: int) -> comm.Exchange:
    """Post the ``index``-th label's keys and values: this rank's item to ``rank + s``, the item of
    ``rank - s`` into fresh buffers."""
    schedule = settings.schedule
    step, item = stream.labels[index]
    exchange = comm.Exchange(settings.group, _tag(stream, kind, step, item))
    to, source = (schedule.rank + step) % schedule.world, (schedule.rank - step) % schedule.world
    sends, receives = stream.sends.get(step, []), stream.receives.get(step, [])
    if item < len(sends):
        exchange.send(to, comm.views(sends[item].segments, key, value))
    if item < len(receives):
        exchange.receive(source, comm.shapes(receives[item].segments, key, value), key.dtype, key.device)
    return exchange


def _tag(stream: Stream, kind: int, step: int, item: int) -> int:
    """Distinct per message kind (0: forward keys/values, 1: backward keys/values, 2: gradients going
    home) and label, so that no two messages between two ranks within a call share one."""
    return KINDS * stream.label(step, item) + kind


KINDS = 3


def _stream(settings: _Settings, stream: Stream, key: Tensor, value: Tensor, kind: int):
    """Yield ``(index, item, keys, values)``: first the rank's own items (``index`` -1: keys and
    values are views of its shard), then each label's received item (``item`` None where this
    rank only sends at that label), the next label's messages already posted so that they travel
    while this one computes. Two items of received keys and values are alive at a time: the
    caller must drop ``keys`` and ``values`` before asking for the next."""
    pending = _post(settings, stream, key, value, kind, 0) if stream.labels else None
    for item in stream.own:
        yield -1, item, comm.views(item.segments, key), comm.views(item.segments, value)
    for index, (step, number) in enumerate(stream.labels):
        current = pending
        pending = _post(settings, stream, key, value, kind, index + 1) if index + 1 < len(stream.labels) else None
        received = current.wait()
        del current
        receives = stream.receives.get(step, [])
        if number < len(receives):
            buffers = received.popitem()[1]
            del received
            count = len(receives[number].segments)
            keys, values = buffers[:count], buffers[count:]
            del buffers
            yield index, receives[number], keys, values
            del keys, values
        else:
            yield index, None, None, None


def _forward(query: Tensor, key: Tensor, value: Tensor, seed: Tensor | None,
             settings: _Settings) -> tuple[Tensor, Tensor]:
    work = work_dtype(query.dtype)
    batch, heads, n, _ = query.shape
    out = torch.zeros(batch, heads, n, value.shape[-1], dtype=work, device=query.device)
    lse = torch.full((batch, heads, n), float("-inf"), dtype=work, device=query.device)
    for _, item, keys, values in _stream(settings, settings.forward, key, value, kind=0):
        if item is None:
            continue
        for segment, calls, k, v in zip(item.segments, item.calls, keys, values):
            for call in calls:
                # the tiled backend's op (what attnkit.attention(..., return_lse=True) runs), on the
                # call's rows and the segment's keys, with its ranges; no autograd inside _Ring
                part, part_lse, *_ = interval_op.forward_op(IntervalInputs(
                    query[:, :, call.rows], k, v, call.lo, call.hi, scale=settings.scale, dropout=settings.dropout,
                    seed=_seed_at(seed, call, segment)))
                _merge_into(out[:, :, call.rows], lse[:, :, call.rows], part.to(work), part_lse.to(work))
                del part, part_lse
                comm.count(units=1)
        del keys, values
    return out.to(query.dtype), lse


def _backward(grad_out: Tensor, grad_lse: Tensor | None, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
              lse: Tensor, seed: Tensor | None, settings: _Settings) -> tuple[Tensor, Tensor, Tensor]:
    stream, schedule = settings.backward, settings.schedule
    world, rank = schedule.world, schedule.rank
    work = work_dtype(query.dtype)
    dq = torch.zeros(query.shape, dtype=work, device=query.device)
    dk = torch.zeros(key.shape, dtype=work, device=key.device)
    dv = torch.zeros(value.shape, dtype=work, device=value.device)

    def gradients(item: Item, keys: list[Tensor], values: list[Tensor], own: bool) -> list[Tensor]:
        """Run the item's calls: query gradients into ``dq``; key/value gradients into ``dk``, ``dv``
        (own keys) or returned per segment, summed (in the work dtype: keys first, then values)."""
        sums: list[Tensor | None] = [None] * (2 * len(item.segments))
        for g, (segment, calls, k, v) in enumerate(zip(item.segments, item.calls, keys, values)):
            for call in calls:
                rows = call.rows
                # sparse_only (the record's default), as the forward's: no dense mask for the calls' ranges
                grads = interval_op.backward_op(
                    grad_out[:, :, rows].contiguous(),
                    None if grad_lse is None else grad_lse[:, :, rows].contiguous(), out[:, :, rows],
                    lse[:, :, rows], None, IntervalInputs(query[:, :, rows], k, v, call.lo, call.hi,
                                                          scale=settings.scale, dropout=settings.dropout,
                                                          seed=_seed_at(seed, call, segment)))
                dq[:, :, rows] += grads[0]
                if own:
                    dk[:, :, segment.local:segment.local + segment.length] += grads[1]
                    dv[:, :, segment.local:segment.local + segment.length] += grads[2]
                else:
                    for slot, grad in ((g, grads[1]), (len(item.segments) + g, grads[2])):
                        sums[slot] = grad.to(work) if sums[slot] is None else sums[slot].add_(grad)
                del grads  # before the next call allocates its own
        like = [k for k in keys] + [v for v in values]
        return [torch.zeros_like(t, dtype=work) if s is None else s for s, t in zip(sums, like)]

    def home(exchange: comm.Exchange, segments: list[Piece]) -> None:
        """Add the key/value gradients of ``segments`` (sent at one label) that came home into ``dk``, ``dv``."""
        for grads in exchange.wait().values():
            for segment, gk, gv in zip(segments, grads[:len(segments)], grads[len(segments):]):
                dk[:, :, segment.local:segment.local + segment.length] += gk
                dv[:, :, segment.local:segment.local + segment.length] += gv

    # The gradients of what this rank sent at label x are computed by `to` while this rank computes
    # x; their receive is posted once x is computed (so that one label's are in flight during the
    # compute, not two) and waited at the end of the next label. Posting it any later (at the next
    # label of this rank, which may come after `to`'s next one) would deadlock: `to` waits for it.
    returning: tuple[comm.Exchange, list[Piece]] | None = None
    for index, item, keys, values in _stream(settings, stream, key, value, kind=1):
        if index < 0:
            gradients(item, keys, values, own=True)
            del keys, values
            continue
        step, number = stream.labels[index]
        exchange = comm.Exchange(settings.group, _tag(stream, 2, step, number))
        if item is not None:
            exchange.send((rank - step) % world, gradients(item, keys, values, own=False))
        del keys, values
        sent = stream.sends.get(step, [])
        segments = sent[number].segments if number < len(sent) else []
        if segments:
            exchange.receive((rank + step) % world, comm.shapes(segments, key, value), work, key.device)
        if returning is not None:
            home(*returning)
        returning = exchange, segments
    if returning is not None:
        home(*returning)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


class _ShardFunction(torch.autograd.Function):
    """What the ring and Ulysses share as autograd functions of ``(query, key, value, seed,
    settings) -> (out, lse)``: they save the rank's query, key, value, output, lse and seed only (the
    settings on the context), and an unused output gets no zero gradient."""

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        query, key, value, seed, settings = inputs
        out, lse = output
        ctx.settings = settings
        ctx.save_for_backward(query, key, value, out, lse, seed)
        ctx.set_materialize_grads(False)


class _Ring(_ShardFunction):
    """Forward and backward rings."""

    @staticmethod
    def forward(query: Tensor, key: Tensor, value: Tensor, seed: Tensor | None,
                settings: _Settings) -> tuple[Tensor, Tensor]:
        return _forward(query, key, value, seed, settings)

    @staticmethod
    @once_differentiable  # the pieces' gradients come from the kernels and the exchanges: no second order
    def backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
        query, key, value, out, lse, seed = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv = _backward(grad_out, grad_lse, query, key, value, out, lse, seed, ctx.settings)
        return dq, dk, dv, None, None
