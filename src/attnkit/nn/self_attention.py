"""One attention head with its own query, key and value projections (seeds 001, 002, 004)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import _checks
from ._head_base import HeadLayer
from ._traced import traced_call


class SelfAttention(HeadLayer):
    r"""A single attention head: project, attend, return the context vectors.

    ``queries = x @ Wq^T``, ``keys = context @ Wk^T``, ``values = context @ Wv^T``, then
    ``attnkit.attention(queries, keys, values)`` with scale ``1/sqrt(d_qk)``. Self-attention
    when ``context`` is omitted (``context = x``), cross-attention otherwise (seed 001's
    8-key example, seed 004's separate inputs).

    Args:
        d_in: features of each input token ``x``.
        d_qk: size of queries and keys (seed 001: 24; seed 002: 2).
        d_v: size of values and of the output, default ``d_qk`` (seed 001: 28).
        qkv_bias: give the projections a bias (seed 004 does, seeds 001 and 002 do not).
        causal: query ``i`` sees only keys ``j <= i + Lk - Lq`` (bottom-right aligned).
        dropout: dropout on the attention weights, in training mode only.
        d_context: features of the ``context`` tokens, default ``d_in``.
        backend: the :func:`attnkit.attention` backend.

    The projections are ``nn.Linear`` modules ``q_proj``, ``k_proj``, ``v_proj`` created in that
    order, so ``torch.manual_seed(123); SelfAttention(3, 2)`` starts from the same weights as
    seed 002's ``SelfAttention_v2(3, 2)``.

    Raises:
        ValueError: a size that is not a positive int, a ``dropout`` outside ``[0, 1)`` or an unknown
            ``backend``.
        TypeError: a ``causal`` or ``qkv_bias`` that is not a bool.

    Example:

        Seed 002's six tokens of three features ("Your journey starts with one step"):

        >>> import torch
        >>> import attnkit
        >>> inputs = torch.tensor([[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],
        ...                        [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]])
        >>> head = attnkit.nn.SelfAttention(d_in=3, d_qk=2, causal=True)
        >>> head
        SelfAttention(
          d_in=3, d_qk=2, d_v=2, causal=True, dropout=0.0, backend='auto'
          (q_proj): Linear(in_features=3, out_features=2, bias=False)
          (k_proj): Linear(in_features=3, out_features=2, bias=False)
          (v_proj): Linear(in_features=3, out_features=2, bias=False)
        )
        >>> head(inputs).shape
        torch.Size([6, 2])
    """

    def __init__(
        self,
        d_in: int,
        d_qk: int,
        d_v: int | None = None,
        *,
        qkv_bias: bool = False,
        causal: bool = False,
        dropout: float = 0.0,
        d_context: int | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(d_in, d_qk, d_v, d_context, causal=causal, dropout=dropout, backend=backend)
        factory = dict(device=device, dtype=dtype)
        qkv_bias = _checks.boolean("qkv_bias", qkv_bias)
        self.q_proj = nn.Linear(self.d_in, self.d_qk, bias=qkv_bias, **factory)
        self.k_proj = nn.Linear(self.d_context, self.d_qk, bias=qkv_bias, **factory)
        self.v_proj = nn.Linear(self.d_context, self.d_v, bias=qkv_bias, **factory)

    @classmethod
    def from_weights(cls, w_query: Tensor, w_key: Tensor, w_value: Tensor, **kwargs: object) -> SelfAttention:
        """A head (without biases) whose projections are the given matrices.

        The matrices are in ``nn.Linear`` layout ``[d_out, d_in]``, applied as ``W @ x`` (seed 001).
        Seed 002 writes ``x @ W`` with ``W [d_in, d_out]``: pass ``W.T``. ``kwargs`` go to the
        constructor (``causal``, ``dropout``, ``backend``).

        Args:
            w_query: ``[d_qk, d_in]``.
            w_key: ``[d_qk, d_context]``.
            w_value: ``[d_v, d_context]``.

        Returns:
            A :class:`attnkit.nn.SelfAttention` on the weights' dtype and device.

        Raises:
            TypeError: a weight that is not a tensor.
            ValueError: weights that are not 2-D or whose sizes do not fit together.

        Example:

            >>> import torch
            >>> import attnkit
            >>> g = torch.Generator().manual_seed(0)
            >>> w_query, w_key, w_value = (torch.randn(2, 3, generator=g) for _ in range(3))
            >>> head = attnkit.nn.SelfAttention.from_weights(w_query, w_key, w_value)
            >>> head.d_in, head.d_qk, head.d_v
            (3, 2, 2)
            >>> x = torch.randn(6, 3, generator=g)
            >>> queries, keys, values = x @ w_query.T, x @ w_key.T, x @ w_value.T
            >>> expected = torch.softmax(queries @ keys.T / 2 ** 0.5, dim=-1) @ values
            >>> torch.allclose(head(x), expected, atol=1e-6)
            True
        """
        _checks.weight_tensors(w_query=w_query, w_key=w_key, w_value=w_value)
        if not (w_query.dim() == w_key.dim() == w_value.dim() == 2):
            raise ValueError(
                "w_query, w_key, w_value must be 2-D [d_out, d_in], got shapes "
                f"{tuple(w_query.shape)}, {tuple(w_key.shape)}, {tuple(w_value.shape)}"
            )
        if w_key.shape[0] != w_query.shape[0] or w_value.shape[1] != w_key.shape[1]:
            raise ValueError(
                f"w_key must be [d_qk={w_query.shape[0]}, d_context] and w_value [d_v, d_context] "
                f"with the same d_context, got w_query {tuple(w_query.shape)}, w_key {tuple(w_key.shape)}, "
                f"w_value {tuple(w_value.shape)}"
            )
        head = cls(w_query.shape[1], w_query.shape[0], w_value.shape[0], d_context=w_key.shape[1],
                   device=w_query.device, dtype=w_query.dtype, **kwargs)  # type: ignore[arg-type]
        with torch.no_grad():
            for linear, weight in ((head.q_proj, w_query), (head.k_proj, w_key), (head.v_proj, w_value)):
                linear.weight.copy_(weight)
        return head

    @traced_call
    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x`` to ``context`` (or to ``x`` itself).

        Args:
            x: ``[B, Lq, d_in]`` or ``[Lq, d_in]``.
            context: ``[B, Lk, d_context]`` or ``[Lk, d_context]``, batched like ``x``; default ``x``.
            mask: boolean (**True = may attend**) or additive float, broadcastable to
                ``[B, Lq, Lk]`` (``[Lq, Lk]`` unbatched).
            need_weights: also return the attention weights.

        Returns:
            ``output [B, Lq, d_v]``, or ``(output, weights [B, Lq, Lk])`` with ``need_weights``.
            A query with no key to attend gets zeros.

        Raises:
            TypeError or ValueError: ``x`` or ``context`` not a floating tensor of the sizes above,
                batched unlike each other, or a mask that does not broadcast (from
                :func:`attnkit.attention`).

        Example:

            Cross-attention from 5 tokens to 7 of another kind, with their weights:

            >>> import torch
            >>> import attnkit
            >>> g = torch.Generator().manual_seed(0)
            >>> x, context = torch.randn(2, 5, 3, generator=g), torch.randn(2, 7, 4, generator=g)
            >>> cross = attnkit.nn.SelfAttention(3, 2, d_v=5, d_context=4)
            >>> output, weights = cross(x, context, need_weights=True)
            >>> output.shape, weights.shape
            (torch.Size([2, 5, 5]), torch.Size([2, 5, 7]))
            >>> torch.allclose(weights.sum(-1), torch.ones(2, 5))
            True
        """
        context = _checks.inputs_with_context(x, context, self.d_in, self.d_context)
        queries, keys, values = self.q_proj(x), self.k_proj(context), self.v_proj(context)
        return self.attend(queries, keys, values, mask, need_weights)
