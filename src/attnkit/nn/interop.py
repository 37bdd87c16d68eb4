"""Weights both ways between attnkit's :class:`MultiHeadAttention` and ``torch.nn.MultiheadAttention``.

PyTorch packs the three input projections in ``in_proj_weight [3E, E]`` (or keeps them
separate, ``q/k/v_proj_weight``, when ``kdim``/``vdim`` differ from ``E``), rows in the
order query, key, value, each split into heads exactly as attnkit splits them. The
conversion is a copy; the two layers then compute the same outputs when given the same
masks in their own conventions::

    torch_mha(q, k, v, key_padding_mask=kpm, attn_mask=am, average_attn_weights=False)
    ours(q, k, v, mask=masks.combine(masks.from_torch_key_padding_mask(kpm),
                                      masks.from_torch_attn_mask(am, num_heads=H)))

except on query rows with no key to attend (PyTorch: NaN, attnkit: zeros).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from .multi_head import MultiHeadAttention


def from_torch(cls: type[MultiHeadAttention], module: nn.MultiheadAttention, **kwargs: object) -> MultiHeadAttention:
    """attnkit's layer with ``module``'s weights, dtype, device and training mode.

    Ours is always batch-first, whatever ``module.batch_first`` says. ``bias_k``/``bias_v``
    (``add_bias_kv``) and ``add_zero_attn`` have no counterpart and are refused. ``kwargs``
    go to the constructor (``causal``, ``backend``, ...).
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"module must be a torch.nn.MultiheadAttention, got {type(module).__name__}")
    if module.bias_k is not None or module.bias_v is not None or module.add_zero_attn:
        raise ValueError("add_bias_kv=True and add_zero_attn=True have no attnkit counterpart")
    if module._qkv_same_embed_dim:
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


def to_torch(layer: MultiHeadAttention) -> nn.MultiheadAttention:
    """A ``torch.nn.MultiheadAttention(batch_first=True)`` computing what ``layer`` computes.

    Grouped-query and multi-query layers convert exactly: each key/value head's weights are
    repeated for every query head that reads it. Layers PyTorch cannot express are refused:
    ``head_dim != embed_dim // num_heads``, ``value_head_dim != head_dim``, no output
    projection or ``out_dim != embed_dim``. ``causal`` is not a module setting in PyTorch: pass
    ``is_causal``/``attn_mask`` to its forward (PyTorch's causal is top-left aligned).
    """
    if (layer.head_dim * layer.num_heads != layer.embed_dim or layer.value_head_dim != layer.head_dim
            or not isinstance(layer.out_proj, nn.Linear) or layer.out_dim != layer.embed_dim):
        raise ValueError(
            "torch.nn.MultiheadAttention needs head_dim = value_head_dim = embed_dim // num_heads and an "
            f"output projection to embed_dim, got {layer.extra_repr()}, out_dim={layer.out_dim}, "
            f"out_proj={type(layer.out_proj).__name__}"
        )
    weight = layer.q_proj.weight
    module = nn.MultiheadAttention(
        layer.embed_dim, layer.num_heads, dropout=layer.dropout, bias=layer.q_proj.bias is not None,
        kdim=layer.kdim, vdim=layer.vdim, batch_first=True, device=weight.device, dtype=weight.dtype,
    )
    group = layer.num_heads // layer.num_kv_heads

    def every_query_head(t: Tensor) -> Tensor:
        """Repeat each key/value head's rows for the ``group`` query heads that read it."""
        return t.unflatten(0, (layer.num_kv_heads, -1)).repeat_interleave(group, dim=0).flatten(0, 1)

    weights = (layer.q_proj.weight, every_query_head(layer.k_proj.weight), every_query_head(layer.v_proj.weight))
    with torch.no_grad():
        if module._qkv_same_embed_dim:
            module.in_proj_weight.copy_(torch.cat(weights))
        else:
            for target, source in zip((module.q_proj_weight, module.k_proj_weight, module.v_proj_weight), weights):
                target.copy_(source)
        if module.in_proj_bias is not None:
            module.in_proj_bias.copy_(torch.cat((layer.q_proj.bias, every_query_head(layer.k_proj.bias),
                                                 every_query_head(layer.v_proj.bias))))
            module.out_proj.bias.copy_(layer.out_proj.bias)
        module.out_proj.weight.copy_(layer.out_proj.weight)
    return module.train(layer.training)
