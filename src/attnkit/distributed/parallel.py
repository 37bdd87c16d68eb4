"""Running layers and models sequence-parallel: :func:`attnkit.distributed.sequence_parallel` for ``attnkit.nn`` layers,
:func:`attnkit.distributed.attention_fn` for a model's pluggable attention call (``GPT.set_attention_fn``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from ..nn import _routing
from .layout import check_layout
from .agreement import agree
from .ring import _device, ring_attention
from .ulysses import ulysses_attention

__all__ = ["sequence_parallel", "attention_fn"]

METHODS = ("ring", "ulysses")


def attention_fn(method: str = "ring", *, group: dist.ProcessGroup | None = None,
                 layout: str = "contiguous") -> Callable[..., Tensor]:
    """A function with :func:`attnkit.attention`'s signature that runs across the ranks of ``group``
    (``method``: ``"ring"`` or ``"ulysses"``, ``layout`` as in :func:`attnkit.distributed.shard`):
    each rank passes its shard ``[B, H, n, D]`` and gets its shard of the output. For models with a
    pluggable attention call: ``gpt.set_attention_fn(attnkit.distributed.attention_fn("ring"))``.
    Weights, soft-capping, ALiBi and sinks are refused (ValueError, on every rank: the others raise
    naming the refusing rank); ``backend`` is used by Ulysses. The ranks must agree on the call (see
    :func:`attnkit.distributed.ring_attention`).

    Returns:
        ``parallel(query, key, value, *, mask=None, causal=False, scale=None, dropout=0.0,
        generator=None, return_weights=False, backend="auto", softcap=None, alibi_slopes=None,
        sinks=None)``, taking shards ``[B, H, n, D]``, ``[B, Hkv, n, D]`` and returning this rank's
        output shard ``[B, H, n, Dv]``.

    Raises:
        ValueError: for an unknown ``method`` or ``layout`` (here); the returned function raises as
            :func:`attnkit.distributed.ring_attention` or
            :func:`attnkit.distributed.ulysses_attention` do, and for the refused arguments.

    Example:

        >>> import os, torch, torch.distributed as dist
        >>> import attnkit
        >>> from attnkit.distributed import attention_fn
        >>> dist.init_process_group("gloo", init_method="file://" + os.path.abspath("fn_pg"),
        ...                         rank=0, world_size=1)
        >>> parallel = attention_fn("ulysses")  # one rank: its shard is the whole sequence
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
        >>> torch.allclose(parallel(q, k, v, causal=True), attnkit.attention(q, k, v, causal=True), atol=1e-6)
        True
        >>> parallel(q, k, v, softcap=30.0)
        Traceback (most recent call last):
            ...
        ValueError: sequence-parallel attention (ulysses) does not take softcap
        >>> dist.destroy_process_group()
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_layout(layout)

    def parallel(query: Tensor, key: Tensor, value: Tensor, *, mask: object = None, causal: bool = False,
                 scale: float | None = None, dropout: float = 0.0, generator: torch.Generator | None = None,
                 return_weights: bool = False, backend: str = "auto", softcap: float | None = None,
                 alibi_slopes: Tensor | None = None, sinks: Tensor | None = None) -> Tensor:
        unsupported = [name for name, given in (("return_weights", return_weights), ("softcap", softcap),
                                                ("alibi_slopes", alibi_slopes), ("sinks", sinks))
                       if given is not None and given is not False]
        if unsupported:  # refused on every rank, not only on this one (agreement.agree)
            agree(f"{method}_attention", ValueError(f"sequence-parallel attention ({method}) does not take "
                                                    f"{', '.join(unsupported)}"), [], _device(query), group)
        common = dict(mask=mask, causal=causal, scale=scale, dropout=dropout, generator=generator, group=group,
                      layout=layout)
        if method == "ring":
            return ring_attention(query, key, value, **common)
        return ulysses_attention(query, key, value, backend=backend, **common)

    return parallel


@contextlib.contextmanager
def sequence_parallel(method: str = "ring", *, group: dist.ProcessGroup | None = None,
                      layout: str = "contiguous") -> Iterator[None]:
    """Within the block, :class:`attnkit.nn.MultiHeadAttention` layers run their self-attention across
    the ranks of ``group`` (:func:`attnkit.distributed.attention_fn`): each rank passes its shard of the sequence
    (``[B, n, E]``, positions laid out by ``layout``, see :func:`attnkit.distributed.shard`) and gets
    its shard of the output. Masks must be structured, over global positions; ``causal`` is global.
    Everything else in a model (projections, MLPs, norms) is per token and needs no change; the
    position ids must be the shard's global ones, and the loss and parameter gradients are summed
    over ranks by the caller (``all_reduce``). Cross-attention (``key`` given) runs locally.
    Dropout uses the global RNG (every rank draws, rank 0's seed is broadcast). Eager only.

    Args:
        method: ``"ring"`` (:func:`attnkit.distributed.ring_attention`) or ``"ulysses"``
            (:func:`attnkit.distributed.ulysses_attention`).
        group: the process group (default: the whole world).
        layout: ``"contiguous"`` or ``"zigzag"``, as the shards were cut.

    Raises:
        ValueError: for an unknown ``method`` or ``layout`` (on entering the block); the layers'
            calls inside raise as :func:`attnkit.distributed.attention_fn`'s function does.

    Example:

        >>> import os, torch, torch.distributed as dist
        >>> from attnkit.distributed import sequence_parallel, shard
        >>> from attnkit.nn import MultiHeadAttention
        >>> dist.init_process_group("gloo", init_method="file://" + os.path.abspath("sp_pg"),
        ...                         rank=0, world_size=1)
        >>> rank, world = dist.get_rank(), dist.get_world_size()
        >>> layer = MultiHeadAttention(16, 4, causal=True)
        >>> x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(0))  # [B, L, E]
        >>> with sequence_parallel("ring", layout="zigzag"):
        ...     y = layer(shard(x, rank, world, layout="zigzag", dim=1))  # this rank's [B, n, E]
        >>> y.shape
        torch.Size([2, 12, 16])
        >>> torch.allclose(y, shard(layer(x), rank, world, layout="zigzag", dim=1), atol=1e-5)
        True
        >>> dist.destroy_process_group()
    """
    with _routing.routed(attention_fn(method, group=group, layout=layout)):
        yield
