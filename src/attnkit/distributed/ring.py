"""Ring attention: each rank holds its shard of the sequence; key/value pieces travel to the ranks
whose queries attend them, partial results merge exactly through the lse.

At step ``s`` (1 .. P-1) rank ``r`` sends its pieces to rank ``r + s`` and receives rank ``r - s``'s
(mod P), point to point: the ring's pattern (every rank sends one message and receives one per
step), but straight from the owner, so a rank that needs no key of another rank neither receives
its shard nor relays it (:mod:`.schedule`: the mask decides). Step ``s + 1``'s messages are posted
before step ``s`` is computed, so they travel while the kernels run.

Forward: each unit (a query chunk against a received piece) is :func:`attnkit.attention` on the
piece with the chunk's ranges as ``masks.key_ranges`` and ``return_lse=True``, merged into the
chunk's output by lse. Backward (:class:`_Ring`): the pieces travel again; each unit's gradients
come from the op's split-key backward (``attnkit::interval_attention_backward``) given the
*merged* output and lse, so nothing is recomputed twice and no partial output is stored; the key
and value gradients of a received piece go back to its owner, who adds them to its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .. import masks as _masks
from .._backends import dropout as _dropout
from .._backends.blockwise import _merge_into
from .._backends.numerics import work_dtype
from .._call import make_call
from ..core import attention_piece
from . import comm
from .layout import check_layout
from .schedule import Schedule, Unit, make_schedule

__all__ = ["ring_attention"]


def ring_attention(query: Tensor, key: Tensor, value: Tensor, *, mask: _masks.StructuredMask | None = None,
                   causal: bool = False, scale: float | None = None, dropout: float = 0.0,
                   generator: torch.Generator | None = None, group: dist.ProcessGroup | None = None,
                   layout: str = "contiguous", return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
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
            (chunks ``r`` and ``2P-1-r`` of ``2P``: balanced causal work); see :func:`shard`.
        return_lse: also return the lse ``[B, H, n]`` (float32 for half inputs, ``-inf`` on
            rows with no key), differentiable.

    Returns:
        ``output [B, H, n, Dv]`` (and ``lse`` with ``return_lse``).
    """
    call = make_call(query, key, value, mask=None, causal=causal, scale=scale, dropout=dropout,
                     generator=generator, return_weights=False)
    if query.dim() != 4:
        raise ValueError(f"ring_attention takes [B, H, n, D] shards, got query {tuple(query.shape)}")
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"query and key/value must be shards of one sequence (the same n): got query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}")
    _check_mask(mask, query)
    check_layout(layout)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    lengths = _lengths(query.shape[2], query.device, group, world)
    schedule = make_schedule(lengths, layout, rank, mask, causal)
    seed = shared_seed(generator, query.device, group) if call.dropout > 0 else None
    settings = _Settings(schedule, call.scale, call.dropout, group)
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


def _lengths(n: int, device: torch.device, group, world: int) -> list[int]:
    """Every rank's shard length (one small all-gather)."""
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    return [int(t) for t in every]


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
    scale: float
    dropout: float
    group: dist.ProcessGroup | None


def _ranges_mask(unit: Unit, device: torch.device) -> _masks.StructuredMask:
    lo, hi = unit.lo.to(device), unit.hi.to(device)
    if lo.shape[0] == 1:
        lo, hi = lo[0], hi[0]
        return _masks.key_ranges([lo[r] for r in range(lo.shape[0])], [hi[r] for r in range(hi.shape[0])])
    return _masks.key_ranges([lo[:, r] for r in range(lo.shape[1])], [hi[:, r] for r in range(hi.shape[1])])


def _rows(unit: Unit) -> slice:
    return slice(unit.query.local, unit.query.local + unit.query.length)


def _piece_seed(seed: Tensor | None, unit: Unit) -> Tensor | None:
    return None if seed is None else _dropout.at_positions(seed, 0, unit.query.start, unit.piece.start)


def _steps(settings: _Settings, key: Tensor, value: Tensor, tag: int):
    """Yield ``(step, owner, keys, values)`` for steps 0 .. P-1 (step 0: the rank's own pieces; step
    ``s``: those of rank ``r - s``): the pieces' keys and values (lists, one per piece of the owner's
    message; None when nothing came), the next step's messages already posted."""
    schedule, group = settings.schedule, settings.group
    world, rank = schedule.world, schedule.rank

    def post(step: int) -> comm.Exchange:
        exchange = comm.Exchange(group, tag + step)
        if step < world:
            to, source = (rank + step) % world, (rank - step) % world
            if to in schedule.sends:
                exchange.send(to, comm.views(schedule.sends[to], key, value))
            if source in schedule.receives:
                exchange.receive(source, comm.shapes(schedule.receives[source], key, value), key.dtype, key.device)
        return exchange

    pending = post(1)
    pieces = schedule.receives.get(rank)
    if pieces:
        yield 0, rank, [key[:, :, p.local:p.local + p.length] for p in pieces], \
            [value[:, :, p.local:p.local + p.length] for p in pieces]
    else:
        yield 0, rank, None, None
    for step in range(1, world):
        received = pending.wait()
        pending = post(step + 1)
        source = (rank - step) % world
        if source in received:
            count = len(schedule.receives[source])
            yield step, source, received[source][:count], received[source][count:]
        else:
            yield step, source, None, None


def _forward(query: Tensor, key: Tensor, value: Tensor, seed: Tensor | None,
             settings: _Settings) -> tuple[Tensor, Tensor]:
    work = work_dtype(query.dtype)
    batch, heads, n, _ = query.shape
    out = torch.zeros(batch, heads, n, value.shape[-1], dtype=work, device=query.device)
    lse = torch.full((batch, heads, n), float("-inf"), dtype=work, device=query.device)
    by_owner = _by_owner(settings.schedule.units)
    for _, owner, keys, values in _steps(settings, key, value, tag=0):
        if keys is None:
            continue
        for unit in by_owner.get(owner, []):
            rows = _rows(unit)
            part, part_lse = attention_piece(
                query[:, :, rows], keys[unit.index], values[unit.index], seed=seed, rows=unit.query.start,
                keys=unit.piece.start, mask=_ranges_mask(unit, query.device), scale=settings.scale,
                dropout=settings.dropout, return_lse=True)
            _merge_into(out[:, :, rows], lse[:, :, rows], part.to(work), part_lse.to(work))
            comm.count(units=1)
    return out.to(query.dtype), lse


def _by_owner(units: list[Unit]) -> dict[int, list[Unit]]:
    result: dict[int, list[Unit]] = {}
    for unit in units:
        result.setdefault(unit.owner, []).append(unit)
    return result


def _backward(grad_out: Tensor, grad_lse: Tensor | None, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
              lse: Tensor, seed: Tensor | None, settings: _Settings) -> tuple[Tensor, Tensor, Tensor]:
    schedule, group = settings.schedule, settings.group
    world, rank = schedule.world, schedule.rank
    work = work_dtype(query.dtype)
    dq = torch.zeros(query.shape, dtype=work, device=query.device)
    dk = torch.zeros(key.shape, dtype=work, device=key.device)
    dv = torch.zeros(value.shape, dtype=work, device=value.device)
    by_owner = _by_owner(schedule.units)
    returning: list[comm.Exchange] = []

    def collect() -> None:
        """Add the key/value gradients that came home (posted a step ago) into ``dk``, ``dv``."""
        for exchange in returning:
            for source, grads in exchange.wait().items():
                pieces = schedule.sends[source]
                for p, gk, gv in zip(pieces, grads[:len(pieces)], grads[len(pieces):]):
                    dk[:, :, p.local:p.local + p.length] += gk
                    dv[:, :, p.local:p.local + p.length] += gv
        returning.clear()

    for step, owner, keys, values in _steps(settings, key, value, tag=2 * world):
        exchange = comm.Exchange(group, 4 * world + step)
        if keys is not None:
            # own pieces: gradients straight into dk, dv; received ones: summed per piece, then sent home
            own = owner == rank
            piece_dk: list[Tensor | None] = [None] * len(keys)
            piece_dv: list[Tensor | None] = [None] * len(values)
            for unit in by_owner.get(owner, []):
                rows = _rows(unit)
                lo, hi = unit.lo.to(query.device), unit.hi.to(query.device)
                grads = torch.ops.attnkit.interval_attention_backward(
                    grad_out[:, :, rows].contiguous(),
                    None if grad_lse is None else grad_lse[:, :, rows].contiguous(),
                    query[:, :, rows], keys[unit.index], values[unit.index], out[:, :, rows], lse[:, :, rows], lo, hi,
                    None, None, None, settings.scale, None, settings.dropout, _piece_seed(seed, unit), False,
                    True, False)  # sparse_only, as the forward's "tiled": no dense L x L mask for the units' ranges
                dq[:, :, rows] += grads[0]
                if own:
                    p = unit.piece
                    dk[:, :, p.local:p.local + p.length] += grads[1]
                    dv[:, :, p.local:p.local + p.length] += grads[2]
                else:
                    for sums, grad in ((piece_dk, grads[1]), (piece_dv, grads[2])):
                        sums[unit.index] = grad.to(work) if sums[unit.index] is None else sums[unit.index].add_(grad)
            if not own:  # in the work dtype: sums of partial gradients
                exchange.send(owner, [torch.zeros_like(t, dtype=work) if g is None else g
                                      for g, t in zip(piece_dk + piece_dv, keys + values)])
        collect()  # the previous step's, which travelled while this step computed
        _home(exchange, schedule, step, key, value)
        returning.append(exchange)
    collect()
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


def _home(exchange: comm.Exchange, schedule: Schedule, step: int, key: Tensor, value: Tensor) -> None:
    """Post the receive of step ``step``'s returning gradients: those of the pieces sent to ``rank + step``."""
    if step == 0:
        return
    to = (schedule.rank + step) % schedule.world
    if to in schedule.sends:
        exchange.receive(to, comm.shapes(schedule.sends[to], key, value), work_dtype(key.dtype), key.device)


class _Ring(torch.autograd.Function):
    """Forward and backward rings; saves query, key, value, output, lse and the seed only."""

    @staticmethod
    def forward(query: Tensor, key: Tensor, value: Tensor, seed: Tensor | None,
                settings: _Settings) -> tuple[Tensor, Tensor]:
        return _forward(query, key, value, seed, settings)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        query, key, value, seed, settings = inputs
        out, lse = output
        ctx.settings = settings
        ctx.save_for_backward(query, key, value, out, lse, seed)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
        query, key, value, out, lse, seed = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv = _backward(grad_out, grad_lse, query, key, value, out, lse, seed, ctx.settings)
        return dq, dk, dv, None, None
