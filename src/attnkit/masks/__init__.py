"""Attention masks: dense tensors and structured rules.

One convention everywhere in attnkit: a **boolean mask is True where a query may attend a
key** (``F.scaled_dot_product_attention``'s and FlexAttention's convention); a floating mask
is an additive bias (``0`` keeps, ``-inf`` removes). ``causal`` is aligned **bottom-right**.

- :mod:`attnkit.masks.dense`: tensor builders and converters (``causal_mask``, ``padding_mask``,
  PyTorch's True = ignore convention, bool <-> additive, ``combine``, ``to_string``).
- :mod:`attnkit.masks.structured`: :class:`attnkit.masks.StructuredMask`, the rules (one or two key
  intervals per query row) and their algebra (``&``, ``|``): O(L) descriptions that any backend
  accepts as ``mask=`` and that the ``"tiled"`` backend uses to skip masked blocks.
- :mod:`attnkit.masks.constructors`: the masks by name, ``causal()``, ``sliding_window()``,
  ``document()``, ``prefix_lm()``, ``padding()``, ``first_keys()``, ``key_ranges()``, ``varlen()``.
"""

from . import constructors, dense, structured
from .dense import *  # noqa: F403  (the names listed in dense.__all__)
from .structured import *  # noqa: F403  (the names listed in structured.__all__)
from .constructors import *  # noqa: F403  (the names listed in constructors.__all__)

__all__ = [*dense.__all__, *structured.__all__, *constructors.__all__]
