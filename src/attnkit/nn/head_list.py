"""Multi-head attention as a list of independent heads, concatenated (seeds 000 and 002)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import _checks
from .self_attention import SelfAttention


def head_mask(mask: Tensor | None, head: int) -> Tensor | None:
    """The part of a ``[B, H, Lq, Lk]``-broadcastable mask that applies to one head."""
    if mask is None or mask.dim() < 3:
        return mask
    return mask.select(-3, head if mask.shape[-3] > 1 else 0)


class HeadList(nn.Module):
    r"""``num_heads`` independent :class:`SelfAttention` heads run one after another.

    Each head has its own projections; their outputs are concatenated along the features
    (``[B, L, num_heads * d_v]``) and, if ``out_dim`` is given, projected by ``out_proj``
    (seed 000's ``linear``). This is the most literal form of multi-head attention (and in
    :mod:`attnkit.trace` each head is a call of its own);
    :meth:`MultiHeadAttention.from_heads` turns it into the fused layer that computes the same.

    Args:
        d_in, d_qk, d_v, qkv_bias, causal, dropout, d_context, backend: as :class:`SelfAttention`,
            for every head.
        num_heads: how many heads.
        out_dim: features of the output projection; ``None`` (default) for no projection.
    """

    def __init__(
        self,
        d_in: int,
        d_qk: int,
        num_heads: int,
        d_v: int | None = None,
        *,
        qkv_bias: bool = False,
        causal: bool = False,
        dropout: float = 0.0,
        d_context: int | None = None,
        out_dim: int | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = _checks.positive_int("num_heads", num_heads)
        factory = dict(device=device, dtype=dtype)
        self.heads = nn.ModuleList(
            SelfAttention(d_in, d_qk, d_v, qkv_bias=qkv_bias, causal=causal, dropout=dropout,
                          d_context=d_context, backend=backend, **factory)
            for _ in range(self.num_heads)
        )
        concatenated = self.num_heads * self.heads[0].d_v
        self.out_proj = None if out_dim is None else nn.Linear(
            concatenated, _checks.positive_int("out_dim", out_dim), **factory)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Run every head on ``x`` (and ``context``) and concatenate their outputs.

        Args:
            x: ``[B, Lq, d_in]`` or ``[Lq, d_in]``.
            context: ``[B, Lk, d_context]`` or ``[Lk, d_context]``; default ``x``.
            mask: boolean (**True = may attend**) or additive float, broadcastable to
                ``[B, H, Lq, Lk]`` (``[H, Lq, Lk]`` unbatched), as for :class:`MultiHeadAttention`.
            need_weights: also return every head's weights.

        Returns:
            ``output [B, Lq, out_dim or num_heads * d_v]``, or ``(output, weights [B, H, Lq, Lk])``.
        """
        results = [head(x, context, mask=head_mask(mask, h), need_weights=need_weights)
                   for h, head in enumerate(self.heads)]
        outputs = [r[0] for r in results] if need_weights else results
        output = torch.cat(outputs, dim=-1)
        if self.out_proj is not None:
            output = self.out_proj(output)
        if need_weights:
            return output, torch.stack([r[1] for r in results], dim=-3)
        return output

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"
