"""Multi-head attention with per-head weights stacked in ``[H, d_out, d_in]`` tensors (seed 001)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .. import _steps
from . import _checks
from ._head_base import HeadLayer
from ._traced import traced_call


class StackedHeads(HeadLayer):
    r"""Every head's projection matrix in one ``[num_heads, d_out, d_in]`` parameter.

    Seed 001 applies them with ``torch.bmm(W, x^T)``; here ``x @ W^T`` is broadcast over the
    head dim, which is the same product: ``queries[h] = x @ w_query[h]^T``. The heads' outputs
    are concatenated (``[B, L, num_heads * d_v]``); there is no output projection.
    :meth:`MultiHeadAttention.from_stacked <attnkit.nn.convert.HeadConversions.from_stacked>`
    turns these tensors into the fused layer.

    Args:
        d_in, d_qk, d_v, causal, dropout, d_context, backend: as :class:`attnkit.nn.SelfAttention`.
        num_heads: how many heads.
        device, dtype: where and in which dtype to create the parameters.

    Parameters ``w_query [H, d_qk, d_in]``, ``w_key [H, d_qk, d_context]``,
    ``w_value [H, d_v, d_context]`` start as ``nn.Linear`` weights do: uniform in
    ``±1/sqrt(fan_in)``.

    Raises:
        TypeError or ValueError: as :class:`attnkit.nn.SelfAttention`, and a ``num_heads`` that is not a
            positive int (ValueError).

    Example:

        >>> import torch
        >>> import attnkit
        >>> layer = attnkit.nn.StackedHeads(d_in=4, d_qk=2, num_heads=3, d_v=5)
        >>> layer
        StackedHeads(num_heads=3, d_in=4, d_qk=2, d_v=5, causal=False, dropout=0.0, backend='auto')
        >>> layer.w_query.shape, layer.w_key.shape, layer.w_value.shape
        (torch.Size([3, 2, 4]), torch.Size([3, 2, 4]), torch.Size([3, 5, 4]))
        >>> x = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(0))
        >>> layer(x).shape  # the 3 heads' 5 features, concatenated
        torch.Size([2, 6, 15])
    """

    def __init__(
        self,
        d_in: int,
        d_qk: int,
        num_heads: int,
        d_v: int | None = None,
        *,
        causal: bool = False,
        dropout: float = 0.0,
        d_context: int | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(d_in, d_qk, d_v, d_context, causal=causal, dropout=dropout, backend=backend)
        self.num_heads = _checks.positive_int("num_heads", num_heads)
        factory = dict(device=device, dtype=dtype)
        self.w_query = nn.Parameter(torch.empty(self.num_heads, self.d_qk, self.d_in, **factory))
        self.w_key = nn.Parameter(torch.empty(self.num_heads, self.d_qk, self.d_context, **factory))
        self.w_value = nn.Parameter(torch.empty(self.num_heads, self.d_v, self.d_context, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw ``w_query``, ``w_key`` and ``w_value`` anew (in place, from the global RNG) as
        ``nn.Linear`` draws its weights: uniform in ``±1/sqrt(fan_in)``, ``fan_in`` being each
        matrix's last dim (``d_in`` or ``d_context``).

        Example:

            >>> import torch
            >>> import attnkit
            >>> layer = attnkit.nn.StackedHeads(d_in=4, d_qk=2, num_heads=3)
            >>> with torch.no_grad():
            ...     _ = layer.w_query.zero_()
            >>> layer.reset_parameters()
            >>> bool((layer.w_query != 0).all()), bool(layer.w_query.abs().max() <= 1 / 4 ** 0.5)
            (True, True)
        """
        for weight in (self.w_query, self.w_key, self.w_value):
            bound = 1.0 / math.sqrt(weight.shape[-1])
            nn.init.uniform_(weight, -bound, bound)

    @traced_call
    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Project ``x`` (and ``context``) for every head at once, attend, concatenate.

        Args:
            x: ``[B, Lq, d_in]`` or ``[Lq, d_in]``.
            context: ``[B, Lk, d_context]`` or ``[Lk, d_context]``; default ``x``.
            mask: boolean (**True = may attend**) or additive float, broadcastable to
                ``[B, H, Lq, Lk]`` (``[H, Lq, Lk]`` unbatched).
            need_weights: also return every head's weights.

        Returns:
            ``output [B, Lq, num_heads * d_v]``, or ``(output, weights [B, H, Lq, Lk])``.

        Raises:
            TypeError or ValueError: ``x`` or ``context`` not a floating tensor of the sizes above,
                batched unlike each other, or a mask that does not broadcast (from
                :func:`attnkit.attention`).

        Example:

            >>> import torch
            >>> import attnkit
            >>> layer = attnkit.nn.StackedHeads(d_in=4, d_qk=2, num_heads=3, causal=True)
            >>> x = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(0))
            >>> output, weights = layer(x, need_weights=True)
            >>> output.shape, weights.shape
            (torch.Size([2, 6, 6]), torch.Size([2, 3, 6, 6]))
            >>> queries = x @ layer.w_query[1].T  # head 1's own projection
            >>> torch.allclose(queries, (x.unsqueeze(1) @ layer.w_query.transpose(-1, -2))[:, 1])
            True
        """
        context = _checks.inputs_with_context(x, context, self.d_in, self.d_context)
        unbatched = x.dim() == 2
        if unbatched:
            # A batch of one, so the heads are never taken for a batch: a per-sequence mask
            # (masks.padding([n])) must describe one sequence, not H of them.
            x, context = x.unsqueeze(0), context.unsqueeze(0)
        # [B, 1, L, d_in] @ [H, d_in, d_out] -> [B, H, L, d_out]
        queries = x.unsqueeze(-3) @ self.w_query.transpose(-1, -2)
        keys = context.unsqueeze(-3) @ self.w_key.transpose(-1, -2)
        values = context.unsqueeze(-3) @ self.w_value.transpose(-1, -2)
        result = self.attend(queries, keys, values, mask, need_weights)
        heads = result[0] if need_weights else result
        _steps.record("heads", heads)
        concatenated = heads.transpose(-3, -2).flatten(-2)  # [B, L, H, d_v] -> [B, L, H * d_v]
        _steps.record("concatenated", concatenated)
        if unbatched:
            concatenated = concatenated.squeeze(0)
        if not need_weights:
            return concatenated
        return concatenated, (result[1].squeeze(0) if unbatched else result[1])

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, {super().extra_repr()}"
