"""From per-head weights to the fused :class:`~attnkit.nn.MultiHeadAttention`: the seed formulations
are one layer.

The fused layer's ``q_proj.weight`` is ``[H * D, E]`` with head ``h`` in rows
``h * D : (h + 1) * D`` (the ``view(B, L, H, D)`` split of seeds 002 and 003). So each head's
own ``[D, E]`` matrix, from a list of heads or from a stacked ``[H, D, E]`` tensor, is one
block of rows, and concatenating the heads' outputs is what the fused layer does before
``out_proj``. Nothing is approximated: the converted layer computes the same numbers.

:class:`~attnkit.nn.convert.HeadConversions` is mixed into :class:`~attnkit.nn.MultiHeadAttention`: its
classmethods build ``cls``, so this module never imports the fused layer (no import cycle).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Self

import torch
from torch import Tensor, nn

from . import _checks
from .head_list import HeadList
from .self_attention import SelfAttention


def _copy_rows(linear: nn.Linear, weights: Sequence[Tensor], biases: Sequence[Tensor | None]) -> None:
    with torch.no_grad():
        linear.weight.copy_(torch.cat(list(weights)))
        if linear.bias is not None:
            linear.bias.copy_(torch.cat([torch.zeros(w.shape[0], dtype=w.dtype, device=w.device) if b is None else b
                                         for w, b in zip(weights, biases)]))


class HeadConversions:
    """Alternate constructors of the fused layer from the seeds' other formulations.

    A mixin of :class:`attnkit.nn.MultiHeadAttention` (not made on its own): call its classmethods
    there, ``MultiHeadAttention.from_heads(...)`` and ``MultiHeadAttention.from_stacked(...)``.

    Example:

        >>> import attnkit
        >>> from attnkit.nn.convert import HeadConversions
        >>> issubclass(attnkit.nn.MultiHeadAttention, HeadConversions)
        True
        >>> heads = [attnkit.nn.SelfAttention(d_in=8, d_qk=2) for _ in range(4)]
        >>> attnkit.nn.MultiHeadAttention.from_heads(heads).num_heads
        4
    """

    @classmethod
    def from_heads(cls, heads: Sequence[SelfAttention] | HeadList, **kwargs: object) -> Self:
        """The fused layer computing ``cat([head(x, context) for head in heads], -1)``, then
        ``heads.out_proj`` when ``heads`` is a :class:`~attnkit.nn.HeadList` that has one.

        All heads must agree on their sizes, ``causal`` and ``dropout``. The fused layer has biases
        if any head (or the output projection) has one; missing ones become zeros. ``kwargs`` go
        to the constructor (``backend``, ...).

        Args:
            heads: a :class:`attnkit.nn.HeadList`, or a non-empty sequence of
                :class:`attnkit.nn.SelfAttention` heads.

        Returns:
            The fused layer (``cls``), on the heads' dtype and device: ``num_heads = len(heads)``,
            ``head_dim = d_qk``, ``value_head_dim = d_v``, ``kdim = vdim = d_context``, and
            without an output projection unless the :class:`attnkit.nn.HeadList` has one.

        Raises:
            TypeError: ``heads`` is not a HeadList or a non-empty sequence of SelfAttention.
            ValueError: heads that differ in their sizes, ``causal`` or ``dropout``.

        Example:

            >>> import torch
            >>> import attnkit
            >>> heads = attnkit.nn.HeadList(d_in=8, d_qk=2, num_heads=4, out_dim=8, causal=True)
            >>> fused = attnkit.nn.MultiHeadAttention.from_heads(heads)
            >>> fused.num_heads, fused.head_dim, fused.causal
            (4, 2, True)
            >>> x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
            >>> torch.allclose(fused(x), heads(x), atol=1e-6)
            True
        """
        out_proj = heads.out_proj if isinstance(heads, HeadList) else None
        try:
            head_list = list(heads.heads if isinstance(heads, HeadList) else heads)
        except TypeError:  # not iterable
            head_list = []
        if not head_list or not all(isinstance(h, SelfAttention) for h in head_list):
            raise TypeError(f"heads must be a HeadList or a non-empty sequence of SelfAttention, got {heads!r}")
        first = head_list[0]

        def settings(head: SelfAttention) -> tuple:
            return head.d_in, head.d_context, head.d_qk, head.d_v, head.causal, head.dropout

        if any(settings(h) != settings(first) for h in head_list):
            raise ValueError(
                "all heads must have the same (d_in, d_context, d_qk, d_v, causal, dropout), got "
                f"{[settings(h) for h in head_list]}"
            )
        has_bias = any(h.q_proj.bias is not None for h in head_list) or getattr(out_proj, "bias", None) is not None
        options: dict = dict(kdim=first.d_context, vdim=first.d_context, head_dim=first.d_qk,
                             value_head_dim=first.d_v, bias=has_bias, dropout=first.dropout, causal=first.causal,
                             backend=first.backend, output_projection=out_proj is not None,
                             device=first.q_proj.weight.device, dtype=first.q_proj.weight.dtype)
        if out_proj is not None:
            options["out_dim"] = out_proj.out_features
        options.update(kwargs)
        fused = cls(first.d_in, len(head_list), **options)
        for name in ("q_proj", "k_proj", "v_proj"):
            projections = [getattr(h, name) for h in head_list]
            _copy_rows(getattr(fused, name), [p.weight for p in projections], [p.bias for p in projections])
        if out_proj is not None:
            _copy_rows(fused.out_proj, [out_proj.weight], [out_proj.bias])
        return fused


    @classmethod
    def from_stacked(cls, w_query: Tensor, w_key: Tensor, w_value: Tensor, **kwargs: object) -> Self:
        """The fused layer for per-head matrices stacked as ``w_query [H, D, E]``, ``w_key [H, D, kdim]``,
        ``w_value [H, Dv, vdim]`` and applied as ``W[h] @ x`` (seed 001; :class:`~attnkit.nn.StackedHeads`).

        No biases and no output projection: the output is the concatenated heads
        ``[B, L, H * Dv]``. ``kwargs`` go to the constructor (``causal``, ``dropout``, ``backend``, ...).

        Args:
            w_query: ``[H, D, E]``, each head's query projection.
            w_key: ``[H, D, kdim]``.
            w_value: ``[H, Dv, vdim]``.

        Returns:
            The fused layer (``cls``) on the weights' dtype and device.

        Raises:
            TypeError: a weight that is not a tensor.
            ValueError: weights that are not 3-D or whose heads and sizes do not match.

        Example:

            >>> import torch
            >>> import attnkit
            >>> stacked = attnkit.nn.StackedHeads(d_in=8, d_qk=2, num_heads=3, d_v=4, causal=True)
            >>> fused = attnkit.nn.MultiHeadAttention.from_stacked(
            ...     stacked.w_query, stacked.w_key, stacked.w_value, causal=True)
            >>> fused.num_heads, fused.head_dim, fused.value_head_dim, fused.out_dim
            (3, 2, 4, 12)
            >>> x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
            >>> torch.allclose(fused(x), stacked(x), atol=1e-6)
            True
        """
        _checks.weight_tensors(w_query=w_query, w_key=w_key, w_value=w_value)
        if not (w_query.dim() == w_key.dim() == w_value.dim() == 3):
            raise ValueError(
                "w_query, w_key, w_value must be stacked [H, d_out, d_in], got shapes "
                f"{tuple(w_query.shape)}, {tuple(w_key.shape)}, {tuple(w_value.shape)}"
            )
        heads, head_dim, embed_dim = w_query.shape
        if w_key.shape[:2] != (heads, head_dim) or w_value.shape[0] != heads:
            raise ValueError(
                f"w_key must be [{heads}, {head_dim}, kdim] and w_value [{heads}, Dv, vdim] to match "
                f"w_query {tuple(w_query.shape)}, got w_key {tuple(w_key.shape)}, w_value {tuple(w_value.shape)}"
            )
        options: dict = dict(kdim=w_key.shape[2], vdim=w_value.shape[2], head_dim=head_dim,
                             value_head_dim=w_value.shape[1], bias=False, output_projection=False,
                             device=w_query.device, dtype=w_query.dtype)
        options.update(kwargs)
        fused = cls(embed_dim, heads, **options)
        with torch.no_grad():
            fused.q_proj.weight.copy_(w_query.reshape(-1, embed_dim))
            fused.k_proj.weight.copy_(w_key.reshape(-1, w_key.shape[2]))
            fused.v_proj.weight.copy_(w_value.reshape(-1, w_value.shape[2]))
        return fused
