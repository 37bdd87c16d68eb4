"""Attention masks: dense tensors and structured rules.

One convention everywhere in attnkit: a **boolean mask is True where a query may attend a
key** (``F.scaled_dot_product_attention``'s and FlexAttention's convention); a floating mask
is an additive bias (``0`` keeps, ``-inf`` removes). ``causal`` is aligned **bottom-right**.

- :mod:`attnkit.masks.dense`: tensor builders and converters (``causal_mask``, ``padding_mask``,
  PyTorch's True = ignore convention, bool <-> additive, ``combine``, ``to_string``).
- :mod:`attnkit.masks.structured`: ``causal()``, ``sliding_window()``, ``document()``,
  ``prefix_lm()``, ``padding()`` and their intersection ``&``: O(L) descriptions that any
  backend accepts as ``mask=`` and that the ``"tiled"`` backend uses to skip masked blocks.
"""

from .dense import (
    causal_mask,
    combine,
    from_torch_attn_mask,
    from_torch_key_padding_mask,
    lengths_to_keep,
    padding_mask,
    to_additive,
    to_bool,
    to_string,
)
from .structured import (
    KeyRange,
    StructuredMask,
    causal,
    document,
    padding,
    plan_blocks,
    prefix_lm,
    sliding_window,
)

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
    "StructuredMask",
    "KeyRange",
    "causal",
    "sliding_window",
    "document",
    "prefix_lm",
    "padding",
    "plan_blocks",
]
