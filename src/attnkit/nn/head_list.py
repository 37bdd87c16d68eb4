"""Multi-head attention as a list of independent heads, concatenated (seeds 000 and 002)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..masks import StructuredMask
from . import _checks
from .self_attention import SelfAttention


def check_head_mask(mask: object, num_heads: int, batched: bool) -> None:
    """A tensor mask must fit ``[B, H, Lq, Lk]`` (``[H, Lq, Lk]`` unbatched): its heads dim 1 or ``H``.

    Args:
        mask: the mask a multi-head layer was given; anything but a tensor passes (``None``, a
            structured mask, which is the same for every head, or a type the core will name).
        num_heads: ``H``.
        batched: whether the layer's input is batched (``[B, L, features]``).

    Raises:
        ValueError: a tensor mask with too many dims, or a heads dim other than 1 or ``H``.

    Example:

        >>> import torch
        >>> from attnkit.nn.head_list import check_head_mask
        >>> check_head_mask(torch.ones(2, 4, 5, 5, dtype=torch.bool), num_heads=4, batched=True)
        >>> check_head_mask(torch.ones(2, 3, 5, 5, dtype=torch.bool), num_heads=4, batched=True)
        Traceback (most recent call last):
            ...
        ValueError: mask's heads dim (dim -3 of [B, H, Lq, Lk]) must be 1 or num_heads = 4, got shape (2, 3, 5, 5)
    """
    if not isinstance(mask, Tensor):
        return  # None, a structured mask (the same for every head), or a type the core names
    expected = "[B, H, Lq, Lk]" if batched else "[H, Lq, Lk] (unbatched x)"
    if mask.dim() > (4 if batched else 3):
        raise ValueError(f"mask must broadcast to {expected} with H = num_heads = {num_heads}, "
                         f"got shape {tuple(mask.shape)}")
    if mask.dim() >= 3 and mask.shape[-3] not in (1, num_heads):
        raise ValueError(f"mask's heads dim (dim -3 of {expected}) must be 1 or num_heads = {num_heads}, "
                         f"got shape {tuple(mask.shape)}")


def head_mask(mask: Tensor | StructuredMask | None, head: int) -> Tensor | StructuredMask | None:
    """The part of a ``[B, H, Lq, Lk]``-broadcastable mask that applies to one head (a structured
    mask applies to every head as it is).

    Args:
        mask: a tensor broadcastable to ``[B, H, Lq, Lk]`` (its heads dim 1 or ``H``), a
            structured mask, or ``None``.
        head: the head's index.

    Returns:
        The mask without its heads dim (dim -3) for a tensor of 3 dims or more, which then
        broadcasts to one head's ``[B, Lq, Lk]``; any other mask as it is.

    Example:

        >>> import torch
        >>> from attnkit import masks
        >>> from attnkit.nn.head_list import head_mask
        >>> per_head = torch.ones(2, 4, 5, 5, dtype=torch.bool)  # [B, H, Lq, Lk]
        >>> head_mask(per_head, 1).shape
        torch.Size([2, 5, 5])
        >>> head_mask(masks.causal(), 1)
        causal()
    """
    if not isinstance(mask, Tensor) or mask.dim() < 3:
        return mask
    return mask.select(-3, head if mask.shape[-3] > 1 else 0)


class HeadList(nn.Module):
    r"""``num_heads`` independent :class:`~attnkit.nn.SelfAttention` heads run one after another.

    Each head has its own projections; their outputs are concatenated along the features
    (``[B, L, num_heads * d_v]``) and, if ``out_dim`` is given, projected by ``out_proj``
    (seed 000's ``linear``). This is the most literal form of multi-head attention (and in
    :mod:`attnkit.trace` each head is a call of its own);
    :meth:`MultiHeadAttention.from_heads <attnkit.nn.convert.HeadConversions.from_heads>` turns it
    into the fused layer that computes the same.

    Args:
        d_in, d_qk, d_v, qkv_bias, causal, dropout, d_context, backend: as
            :class:`attnkit.nn.SelfAttention`, for every head.
        num_heads: how many heads.
        out_dim: features of the output projection; ``None`` (default) for no projection.
        device, dtype: where and in which dtype to create the parameters.

    Raises:
        TypeError or ValueError: as :class:`attnkit.nn.SelfAttention`, and a ``num_heads`` or
            ``out_dim`` that is not a positive int (ValueError).

    Example:

        >>> import torch
        >>> import attnkit
        >>> heads = attnkit.nn.HeadList(d_in=3, d_qk=2, num_heads=4, out_dim=3)
        >>> len(heads.heads), heads.out_proj
        (4, Linear(in_features=8, out_features=3, bias=True))
        >>> x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(0))
        >>> heads(x).shape
        torch.Size([2, 5, 3])
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
        if out_dim is not None:
            out_dim = _checks.positive_int("out_dim", out_dim)
        factory = dict(device=device, dtype=dtype)
        self.heads = nn.ModuleList(
            SelfAttention(d_in, d_qk, d_v, qkv_bias=qkv_bias, causal=causal, dropout=dropout,
                          d_context=d_context, backend=backend, **factory)
            for _ in range(self.num_heads)
        )
        concatenated = self.num_heads * self.heads[0].d_v
        self.out_proj = None if out_dim is None else nn.Linear(concatenated, out_dim, **factory)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | StructuredMask | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Run every head on ``x`` (and ``context``) and concatenate their outputs.

        Args:
            x: ``[B, Lq, d_in]`` or ``[Lq, d_in]``.
            context: ``[B, Lk, d_context]`` or ``[Lk, d_context]``; default ``x``.
            mask: boolean (**True = may attend**) or additive float, broadcastable to
                ``[B, H, Lq, Lk]`` (``[H, Lq, Lk]`` unbatched), as for
                :class:`attnkit.nn.MultiHeadAttention`;
                or a structured mask from :mod:`attnkit.masks` (every head gets it).
            need_weights: also return every head's weights.

        Returns:
            ``output [B, Lq, out_dim or num_heads * d_v]``, or ``(output, weights [B, H, Lq, Lk])``.

        Raises:
            ValueError: a tensor mask whose heads dim is neither 1 nor ``num_heads``; and the errors of
                :meth:`attnkit.nn.SelfAttention.forward`.

        Example:

            >>> import torch
            >>> import attnkit
            >>> heads = attnkit.nn.HeadList(d_in=3, d_qk=2, num_heads=4)  # no output projection
            >>> x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(0))
            >>> output, weights = heads(x, mask=attnkit.masks.causal(), need_weights=True)
            >>> output.shape, weights.shape
            (torch.Size([2, 5, 8]), torch.Size([2, 4, 5, 5]))
            >>> head_1 = heads.heads[1](x, mask=attnkit.masks.causal())
            >>> torch.allclose(output[..., 2:4], head_1, atol=1e-6)  # head 1's 2 features
            True
        """
        check_head_mask(mask, self.num_heads, batched=isinstance(x, Tensor) and x.dim() != 2)
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
