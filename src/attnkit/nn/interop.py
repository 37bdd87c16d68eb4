"""Weights both ways between attnkit's :class:`~attnkit.nn.MultiHeadAttention` and
``torch.nn.MultiheadAttention``.

PyTorch packs the three input projections in ``in_proj_weight [3E, E]`` (or keeps them
separate, ``q/k/v_proj_weight``, when ``kdim``/``vdim`` differ from ``E``), rows in the
order query, key, value, each split into heads exactly as attnkit splits them. The
conversion is a copy; the two layers then compute the same outputs when given the same
masks in their own conventions::

    torch_mha(q, k, v, key_padding_mask=kpm, attn_mask=am, average_attn_weights=False)
    ours(q, k, v, mask=masks.combine(masks.from_torch_key_padding_mask(kpm),
                                      masks.from_torch_attn_mask(am, num_heads=H)))

except on query rows with no key to attend (PyTorch: NaN, attnkit: zeros).

:class:`~attnkit.nn.interop.TorchConversions` is mixed into :class:`~attnkit.nn.MultiHeadAttention`; it reads
the layer's sizes and projections through ``self`` and builds ``cls``, so this module never
imports the fused layer (no import cycle).
"""

from __future__ import annotations

from typing import Self

import torch
from torch import Tensor, nn

from .. import _torch_private


class TorchConversions:
    """Weights to and from ``torch.nn.MultiheadAttention`` (``from_torch``, ``to_torch``).

    A mixin of :class:`attnkit.nn.MultiHeadAttention` (not made on its own): call
    ``MultiHeadAttention.from_torch(module)`` and ``layer.to_torch()``.

    Example:

        >>> import torch
        >>> import attnkit
        >>> from attnkit.nn.interop import TorchConversions
        >>> issubclass(attnkit.nn.MultiHeadAttention, TorchConversions)
        True
        >>> layer = attnkit.nn.MultiHeadAttention(embed_dim=16, num_heads=4)
        >>> back = attnkit.nn.MultiHeadAttention.from_torch(layer.to_torch())
        >>> all(torch.equal(a, b) for a, b in zip(layer.parameters(), back.parameters()))
        True
    """

    # The fused layer's attributes that to_torch reads.
    embed_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    kdim: int
    vdim: int
    out_dim: int
    dropout: float
    training: bool
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    out_proj: nn.Module

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention, **kwargs: object) -> Self:
        """attnkit's layer with ``module``'s weights, dtype, device and training mode.

        Ours is always batch-first, whatever ``module.batch_first`` says. ``bias_k``/``bias_v``
        (``add_bias_kv``) and ``add_zero_attn`` have no counterpart and are refused. ``kwargs``
        go to the constructor (``causal``, ``backend``, ...).

        Args:
            module: the ``torch.nn.MultiheadAttention`` to copy.

        Returns:
            A new :class:`attnkit.nn.MultiHeadAttention` with the module's weights.

        Raises:
            TypeError: ``module`` is not a ``torch.nn.MultiheadAttention``.
            ValueError: it has ``add_bias_kv=True`` or ``add_zero_attn=True``.

        Example:

            >>> import torch
            >>> import attnkit
            >>> theirs = torch.nn.MultiheadAttention(16, 4, batch_first=True)
            >>> ours = attnkit.nn.MultiHeadAttention.from_torch(theirs)
            >>> x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
            >>> expected, _ = theirs(x, x, x)
            >>> torch.allclose(ours(x), expected, atol=1e-6)
            True
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"module must be a torch.nn.MultiheadAttention, got {type(module).__name__}")
        if module.bias_k is not None or module.bias_v is not None or module.add_zero_attn:
            raise ValueError("add_bias_kv=True and add_zero_attn=True have no attnkit counterpart")
        if _torch_private.packs_in_projections(module):
            w_query, w_key, w_value = module.in_proj_weight.chunk(3)
        else:
            w_query, w_key, w_value = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
        biases: tuple[Tensor | None, ...] = (None,) * 3
        if module.in_proj_bias is not None:
            biases = module.in_proj_bias.chunk(3)
        options: dict = dict(kdim=module.kdim, vdim=module.vdim, bias=module.in_proj_bias is not None,
                             dropout=module.dropout, device=w_query.device, dtype=w_query.dtype)
        options.update(kwargs)
        ours = cls(module.embed_dim, module.num_heads, **options)
        with torch.no_grad():
            for linear, weight, bias in zip((ours.q_proj, ours.k_proj, ours.v_proj), (w_query, w_key, w_value), biases):
                linear.weight.copy_(weight)
                if bias is not None:
                    linear.bias.copy_(bias)
            ours.out_proj.weight.copy_(module.out_proj.weight)
            if module.out_proj.bias is not None:
                ours.out_proj.bias.copy_(module.out_proj.bias)
        return ours.train(module.training)

    def to_torch(self) -> nn.MultiheadAttention:
        """A ``torch.nn.MultiheadAttention(batch_first=True)`` computing what this layer computes.

        Grouped-query and multi-query layers convert exactly: each key/value head's weights are
        repeated for every query head that reads it. Layers PyTorch cannot express are refused:
        ``head_dim != embed_dim // num_heads``, ``value_head_dim != head_dim``, no output
        projection or ``out_dim != embed_dim``. ``causal`` is not a module setting in PyTorch: pass
        ``is_causal``/``attn_mask`` to its forward (PyTorch's causal is top-left aligned).

        Returns:
            A new ``torch.nn.MultiheadAttention`` with this layer's weights, dtype, device and
            training mode.

        Raises:
            ValueError: a layer PyTorch cannot express (see above), or one with ``softcap``,
                ``alibi_slopes`` or ``sinks``.

        Example:

            A grouped-query layer (2 key/value heads for 4 query heads) converts exactly:

            >>> import torch
            >>> import attnkit
            >>> layer = attnkit.nn.MultiHeadAttention(embed_dim=16, num_heads=4, num_kv_heads=2)
            >>> theirs = layer.to_torch()
            >>> theirs.batch_first, theirs.num_heads
            (True, 4)
            >>> x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
            >>> expected, _ = theirs(x, x, x)
            >>> torch.allclose(layer(x), expected, atol=1e-6)
            True
        """
        if (self.head_dim * self.num_heads != self.embed_dim or self.value_head_dim != self.head_dim
                or not isinstance(self.out_proj, nn.Linear) or self.out_dim != self.embed_dim):
            raise ValueError(
                "torch.nn.MultiheadAttention needs head_dim = value_head_dim = embed_dim // num_heads and an "
                f"output projection to embed_dim, got embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"head_dim={self.head_dim}, value_head_dim={self.value_head_dim}, out_dim={self.out_dim}, "
                f"out_proj={type(self.out_proj).__name__}"
            )
        modifiers = [name for name in ("softcap", "alibi_slopes", "sinks") if getattr(self, name, None) is not None]
        if modifiers:
            raise ValueError(f"torch.nn.MultiheadAttention has no {', '.join(modifiers)}: this layer cannot convert")
        weight = self.q_proj.weight
        module = nn.MultiheadAttention(
            self.embed_dim, self.num_heads, dropout=self.dropout, bias=self.q_proj.bias is not None,
            kdim=self.kdim, vdim=self.vdim, batch_first=True, device=weight.device, dtype=weight.dtype,
        )
        group = self.num_heads // self.num_kv_heads

        def every_query_head(t: Tensor) -> Tensor:
            """Repeat each key/value head's rows for the ``group`` query heads that read it."""
            return t.unflatten(0, (self.num_kv_heads, -1)).repeat_interleave(group, dim=0).flatten(0, 1)

        weights = (self.q_proj.weight, every_query_head(self.k_proj.weight), every_query_head(self.v_proj.weight))
        with torch.no_grad():
            if _torch_private.packs_in_projections(module):
                module.in_proj_weight.copy_(torch.cat(weights))
            else:
                for target, source in zip((module.q_proj_weight, module.k_proj_weight, module.v_proj_weight), weights):
                    target.copy_(source)
            if module.in_proj_bias is not None:
                module.in_proj_bias.copy_(torch.cat((self.q_proj.bias, every_query_head(self.k_proj.bias),
                                                     every_query_head(self.v_proj.bias))))
                module.out_proj.bias.copy_(self.out_proj.bias)
            module.out_proj.weight.copy_(self.out_proj.weight)
        return module.train(self.training)
