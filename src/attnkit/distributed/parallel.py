"""Running ``attnkit.nn`` layers sequence-parallel: :func:`sequence_parallel`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from ..nn import _routing
from .layout import check_layout
from .ring import ring_attention
from .ulysses import ulysses_attention

__all__ = ["sequence_parallel"]

METHODS = ("ring", "ulysses")


@contextlib.contextmanager
def sequence_parallel(method: str = "ring", *, group: dist.ProcessGroup | None = None,
                      layout: str = "contiguous") -> Iterator[None]:
    """Within the block, :class:`attnkit.nn.MultiHeadAttention` layers run their self-attention across
    the ranks of ``group``: each rank passes its shard of the sequence (``[B, n, E]``, positions
    laid out by ``layout``, see :func:`attnkit.distributed.shard`) and gets its shard of the output.
    ``method``: ``"ring"`` (:func:`ring_attention`) or ``"ulysses"`` (:func:`ulysses_attention`, with
    the layer's backend). Masks must be structured, over global positions; ``causal`` is global.
    Everything else in a model (projections, MLPs, norms) is per token and needs no change; the
    position ids must be the shard's global ones, and the loss and parameter gradients are summed
    over ranks by the caller (``all_reduce``). Cross-attention (``key`` given) runs locally.
    Dropout uses the global RNG (rank 0's seed, broadcast)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_layout(layout)

    def route(queries, keys, values, *, mask, causal, dropout, backend):
        if method == "ring":
            return ring_attention(queries, keys, values, mask=mask, causal=causal, dropout=dropout, group=group,
                                  layout=layout)
        return ulysses_attention(queries, keys, values, mask=mask, causal=causal, dropout=dropout, group=group,
                                 layout=layout, backend=backend)

    with _routing.routed(route):
        yield
