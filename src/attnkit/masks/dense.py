"""Build and convert attention masks.

One convention everywhere in attnkit: a **boolean mask is True where a query may attend a
key**, the convention of ``F.scaled_dot_product_attention`` and FlexAttention. A floating
mask is an additive bias on the scores (``0`` keeps, ``-inf`` removes). PyTorch's
``nn.MultiheadAttention`` uses the opposite boolean convention (True = ignore); the
``from_torch_*`` helpers convert at that edge.

Causal masks are aligned **bottom-right**: query ``i`` may attend key ``j`` when
``j <= i + Lk - Lq``, so the last query always sees the last key. That is what decoding
with a KV cache needs (the new queries are the last rows)::

    Lq = 2, Lk = 5            Lq = 5, Lk = 2
    # # # # .                 . .    <- no key: output row is zeros
    # # # # #                 . .
                              . .
                              # .
                              # #

Every function here returns tensors that broadcast to the scores' shape ``[..., Lq, Lk]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _integers

__all__ = [
    "causal_mask",
    "padding_mask",
    "lengths_to_keep",
    "from_torch_key_padding_mask",
    "from_torch_attn_mask",
    "to_additive",
    "to_bool",
    "combine",
    "to_string",
]


def causal_mask(q_len: int, k_len: int | None = None, *, device: torch.device | str | None = None) -> Tensor:
    """Boolean causal mask ``[Lq, Lk]``, True where query ``i`` may see key ``j <= i + Lk - Lq``.

    Aligned bottom-right (see the module docstring's picture); with ``Lq == Lk`` it is the
    usual lower triangle. ``k_len`` defaults to ``q_len``.

    Args:
        q_len: ``Lq``, the number of queries.
        k_len: ``Lk``, the number of keys; default ``q_len``.
        device: where to create the mask.

    Returns:
        A boolean tensor ``[Lq, Lk]``.

    Raises:
        TypeError: a length that is not an int.
        ValueError: a negative length.

    Example:

        >>> from attnkit import masks
        >>> print(masks.to_string(masks.causal_mask(3)))
        # . .
        # # .
        # # #
        >>> mask = masks.causal_mask(2, 4)  # two new queries after two cached keys
        >>> mask.shape, mask.dtype
        (torch.Size([2, 4]), torch.bool)
        >>> print(masks.to_string(mask))
        # # # .
        # # # #
    """
    q_len = _integers.integer("q_len", q_len)
    k_len = q_len if k_len is None else _integers.integer("k_len", k_len)
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)


def lengths_to_keep(lengths: Tensor, max_length: int | None = None) -> Tensor:
    """``[B]`` integer lengths -> ``[B, max_length]`` boolean keep-mask (True on real positions).

    Args:
        lengths: ``[B]`` ints (an integer tensor, which keeps its device, or a sequence of ints).
        max_length: the number of positions; default the longest length.

    Returns:
        A boolean tensor ``[B, max_length]``: ``keep[b, t]`` is ``t < lengths[b]``.

    Raises:
        TypeError: ``lengths`` not 1-D integers.
        ValueError: a negative length, or one beyond ``max_length``.

    Example:

        >>> import torch
        >>> from attnkit import masks
        >>> masks.lengths_to_keep(torch.tensor([3, 1]))
        tensor([[ True,  True,  True],
                [ True, False, False]])
        >>> masks.lengths_to_keep([2, 0], max_length=4)
        tensor([[ True,  True, False, False],
                [False, False, False, False]])
    """
    max_length = _integers.optional_integer("max_length", max_length)
    lengths = _integers.integers("lengths", lengths)
    if max_length is not None and lengths.numel() and int(lengths.max()) > max_length:
        raise ValueError(f"lengths must lie in [0, {max_length}] (max_length), got {lengths.tolist()}")
    if max_length is None:
        max_length = int(lengths.max()) if lengths.numel() else 0
    positions = torch.arange(max_length, device=lengths.device)
    return positions < lengths[:, None]


def padding_mask(lengths_or_keep: Tensor, key_length: int | None = None, *, ndim: int = 4) -> Tensor:
    """Key-padding mask shaped ``[B, 1, ..., 1, Lk]`` (``ndim`` dims), True on real keys.

    Give either integer ``lengths [B]`` (with ``key_length``, defaulting to the longest) or a
    boolean keep-mask ``[B, Lk]``. ``ndim=4`` broadcasts against ``[B, H, Lq, Lk]`` scores,
    ``ndim=3`` against ``[B, Lq, Lk]``.

    Args:
        lengths_or_keep: integer ``lengths [B]`` (tensor or sequence of ints), or a boolean
            keep-mask ``[B, Lk]`` (True on real keys).
        key_length: ``Lk``; default the longest length (or the keep-mask's ``Lk``, which it
            must then equal).
        ndim: the number of dims of the result (at least 2).

    Returns:
        A new boolean tensor ``[B, 1, ..., 1, Lk]`` (``ndim`` dims), True on real keys.

    Raises:
        TypeError: lengths that are not ints.
        ValueError: a keep-mask that is not ``[B, Lk]`` or has another ``Lk`` than ``key_length``, a
            length beyond ``key_length``, or ``ndim < 2``.

    Example:

        >>> import torch
        >>> import attnkit
        >>> mask = attnkit.masks.padding_mask(torch.tensor([3, 1]), 4)  # 2 sequences of 4 keys
        >>> mask.shape
        torch.Size([2, 1, 1, 4])
        >>> mask[:, 0, 0]
        tensor([[ True,  True,  True, False],
                [ True, False, False, False]])
        >>> q = torch.randn(2, 8, 5, 16, generator=torch.Generator().manual_seed(0))  # [B, H, Lq, D]
        >>> k = v = torch.randn(2, 8, 4, 16, generator=torch.Generator().manual_seed(1))
        >>> _, weights = attnkit.attention(q, k, v, mask=mask, return_weights=True)
        >>> bool((weights[1, :, :, 1:] == 0).all())  # sequence 1 attends its one real key only
        True
    """
    ndim = _integers.integer("ndim", ndim, minimum=2)
    key_length = _integers.optional_integer("key_length", key_length)
    keep = lengths_or_keep
    if not (isinstance(keep, Tensor) and keep.dtype == torch.bool):
        keep = lengths_to_keep(keep, key_length)
    elif keep.dim() != 2:
        raise ValueError(f"a boolean keep-mask must be [B, Lk], got shape {tuple(keep.shape)}")
    elif key_length is not None and keep.shape[1] != key_length:
        raise ValueError(f"keep-mask has {keep.shape[1]} keys, expected key_length={key_length}")
    batch, keys = keep.shape
    # A copy: a later in-place edit of the caller's keep-mask must not change this mask.
    return keep.clone().reshape(batch, *([1] * (ndim - 2)), keys)


def from_torch_key_padding_mask(key_padding_mask: Tensor, *, ndim: int = 4) -> Tensor:
    """Convert ``nn.MultiheadAttention``'s ``key_padding_mask [B, Lk]`` to attnkit's convention.

    PyTorch's boolean mask is True where a key is **ignored**; the result is True where a key
    may be attended, shaped ``[B, 1, ..., 1, Lk]`` (``ndim`` dims). A floating mask is an
    additive bias in both conventions and is only reshaped.

    Args:
        key_padding_mask: ``[B, Lk]``, boolean (True = ignore) or floating (additive).
        ndim: the number of dims of the result (at least 2).

    Returns:
        ``[B, 1, ..., 1, Lk]`` (``ndim`` dims): boolean with True = may attend, or the floating
        bias reshaped.

    Raises:
        ValueError: a mask that is not 2-D, or ``ndim < 2``.

    Example:

        >>> import torch
        >>> from attnkit import masks
        >>> ignore = torch.tensor([[False, False, True]])  # PyTorch: the last key is padding
        >>> masks.from_torch_key_padding_mask(ignore)
        tensor([[[[ True,  True, False]]]])
    """
    ndim = _integers.integer("ndim", ndim, minimum=2)
    if key_padding_mask.dim() != 2:
        raise ValueError(f"key_padding_mask must be [B, Lk], got shape {tuple(key_padding_mask.shape)}")
    mask = ~key_padding_mask if key_padding_mask.dtype == torch.bool else key_padding_mask
    batch, keys = mask.shape
    return mask.reshape(batch, *([1] * (ndim - 2)), keys)


def from_torch_attn_mask(attn_mask: Tensor, *, num_heads: int | None = None) -> Tensor:
    """Convert ``nn.MultiheadAttention``'s ``attn_mask`` to attnkit's convention.

    ``[Lq, Lk]`` stays 2-D; ``[B * num_heads, Lq, Lk]`` becomes ``[B, num_heads, Lq, Lk]``.
    A boolean mask is inverted (PyTorch: True = not allowed); a floating one is unchanged.

    Args:
        attn_mask: ``[Lq, Lk]`` or ``[B * num_heads, Lq, Lk]``, boolean (True = not allowed) or
            floating (additive).
        num_heads: the heads of a 3-D mask (PyTorch's rows are batch-major: ``b * num_heads + h``).

    Returns:
        ``[Lq, Lk]`` or ``[B, num_heads, Lq, Lk]``: boolean with True = may attend, or the
        floating bias.

    Raises:
        ValueError: a 3-D mask without a ``num_heads`` dividing its first dim, or a mask of another
            rank.

    Example:

        >>> import torch
        >>> from attnkit import masks
        >>> not_allowed = torch.ones(3, 3, dtype=torch.bool).triu(1)  # PyTorch's causal
        >>> masks.from_torch_attn_mask(not_allowed)
        tensor([[ True, False, False],
                [ True,  True, False],
                [ True,  True,  True]])
        >>> masks.from_torch_attn_mask(torch.zeros(4, 3, 3, dtype=torch.bool), num_heads=2).shape
        torch.Size([2, 2, 3, 3])
    """
    num_heads = _integers.optional_integer("num_heads", num_heads, minimum=1)
    mask = ~attn_mask if attn_mask.dtype == torch.bool else attn_mask
    if mask.dim() == 2:
        return mask
    if mask.dim() == 3:
        if num_heads is None or mask.shape[0] % num_heads:
            raise ValueError(
                f"a 3-D attn_mask [B * num_heads, Lq, Lk] needs num_heads dividing {mask.shape[0]}, "
                f"got num_heads={num_heads}"
            )
        return mask.reshape(mask.shape[0] // num_heads, num_heads, *mask.shape[1:])
    raise ValueError(f"attn_mask must be [Lq, Lk] or [B * num_heads, Lq, Lk], got shape {tuple(mask.shape)}")


def to_additive(mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Boolean (True = may attend) -> additive bias: ``0`` where allowed, ``-inf`` elsewhere.

    Args:
        mask: a boolean mask of any shape; a floating one is only converted to ``dtype``.
        dtype: the floating dtype of the result.

    Returns:
        A ``dtype`` tensor shaped like ``mask``.

    Example:

        >>> from attnkit import masks
        >>> masks.to_additive(masks.causal_mask(2))
        tensor([[0., -inf],
                [0., 0.]])
    """
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill_(~mask, float("-inf"))


def to_bool(mask: Tensor) -> Tensor:
    """Additive bias -> boolean: a position may be attended unless its bias is ``-inf``.

    Args:
        mask: a floating additive bias of any shape; a boolean mask is returned as it is.

    Returns:
        A boolean tensor shaped like ``mask`` (True = may attend).

    Example:

        >>> import torch
        >>> from attnkit import masks
        >>> masks.to_bool(torch.tensor([[0.0, float("-inf")], [-1.5, 0.0]]))
        tensor([[ True, False],
                [ True,  True]])
    """
    if mask.dtype == torch.bool:
        return mask
    return mask != float("-inf")


def combine(*masks: Tensor | None, dtype: torch.dtype | None = None) -> Tensor | None:
    """Intersect masks: a position is allowed only if every mask allows it.

    ``None`` entries are skipped (``None`` when all are). Boolean masks are AND-ed; if any
    mask is floating, the result is the sum of additive biases, in ``dtype`` (default: the
    first floating mask's dtype). Shapes broadcast.

    Args:
        masks: boolean (True = may attend) or floating (additive) masks, or ``None``.
        dtype: the dtype of an additive result.

    Returns:
        The intersection, shaped as the masks broadcast together, or ``None``.

    Example:

        >>> import torch
        >>> from attnkit import masks
        >>> keep = masks.combine(masks.causal_mask(3), None, torch.tensor([True, True, False]))
        >>> print(masks.to_string(keep))  # causal, and the last key is padding
        # . .
        # # .
        # # .
        >>> masks.combine(masks.causal_mask(2), torch.tensor([[0.0, -1.0], [0.5, 0.0]]))
        tensor([[0.0000,   -inf],
                [0.5000, 0.0000]])
    """
    present = [m for m in masks if m is not None]
    if not present:
        return None
    floating = [m for m in present if m.dtype != torch.bool]
    if not floating:
        result = present[0]
        for m in present[1:]:
            result = result & m
        return result
    dtype = dtype or floating[0].dtype
    result = to_additive(present[0], dtype)
    for m in present[1:]:
        result = result + to_additive(m, dtype)
    return result


def to_string(mask: Tensor, *, allowed: str = "#", masked: str = ".") -> str:
    """Draw a 2-D mask as text, one row per query: ``#`` may attend, ``.`` may not.

    Args:
        mask: ``[Lq, Lk]``, boolean (True = may attend) or additive (``-inf`` removes).
        allowed, masked: the characters drawn for allowed and removed positions.

    Returns:
        ``Lq`` lines of ``Lk`` characters separated by spaces.

    Raises:
        ValueError: a mask that is not 2-D.

    Example:

        >>> from attnkit import masks
        >>> print(masks.to_string(masks.causal_mask(2, 3)))
        # # .
        # # #
        >>> print(masks.to_string(masks.causal_mask(2, 3), allowed="x", masked="-"))
        x x -
        x x x
    """
    if mask.dim() != 2:
        raise ValueError(f"to_string draws a 2-D [Lq, Lk] mask, got shape {tuple(mask.shape)}")
    keep = to_bool(mask).cpu()
    return "\n".join(" ".join(allowed if k else masked for k in row.tolist()) for row in keep)
