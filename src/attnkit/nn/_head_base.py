"""What :class:`SelfAttention` and :class:`StackedHeads` share: head sizes, how a head attends."""

from __future__ import annotations

from torch import Tensor, nn

from ..core import attention
from . import _checks
from ._settings import AttentionSettings


class HeadLayer(AttentionSettings, nn.Module):
    """Checked head sizes (``d_in``, ``d_qk``, ``d_v``, ``d_context``) and attention settings
    (``causal``, ``dropout``, ``backend``, checked on every assignment) of a layer whose heads
    each have their own projections."""

    def __init__(self, d_in: int, d_qk: int, d_v: int | None, d_context: int | None, *,
                 causal: bool, dropout: float, backend: str) -> None:
        super().__init__()
        self.d_in = _checks.positive_int("d_in", d_in)
        self.d_qk = _checks.positive_int("d_qk", d_qk)
        self.d_v = _checks.optional_positive_int("d_v", d_v, self.d_qk)
        self.d_context = _checks.optional_positive_int("d_context", d_context, self.d_in)
        self.causal = causal
        self.dropout = dropout
        self.backend = backend

    def attend(self, queries: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None,
               need_weights: bool) -> Tensor | tuple[Tensor, Tensor]:
        """:func:`attnkit.attention` with this layer's settings (``causal``, ``dropout``,
        ``backend``); dropout only in training mode.

        Args:
            queries: ``[..., Lq, d_qk]``, already projected.
            keys: ``[..., Lk, d_qk]``.
            values: ``[..., Lk, d_v]``.
            mask: as ``attnkit.attention(mask=)``, or ``None``.
            need_weights: also return the weights ``[..., Lq, Lk]``.

        Returns:
            ``output [..., Lq, d_v]``, or ``(output, weights)`` with ``need_weights``.

        Example:

            >>> import torch
            >>> import attnkit
            >>> head = attnkit.nn.SelfAttention(d_in=3, d_qk=2, causal=True)
            >>> g = torch.Generator().manual_seed(0)
            >>> q, k, v = (torch.randn(4, 2, generator=g) for _ in range(3))
            >>> torch.allclose(head.attend(q, k, v, None, False), attnkit.attention(q, k, v, causal=True))
            True
        """
        return attention(
            queries, keys, values,
            mask=mask, causal=self.causal, dropout=self.dropout if self.training else 0.0,
            return_weights=need_weights, backend=self.backend,
        )

    def extra_repr(self) -> str:
        extras = [f"d_in={self.d_in}", f"d_qk={self.d_qk}", f"d_v={self.d_v}"]
        if self.d_context != self.d_in:
            extras.append(f"d_context={self.d_context}")
        extras += [f"causal={self.causal}", f"dropout={self.dropout}", f"backend={self.backend!r}"]
        return ", ".join(extras)
