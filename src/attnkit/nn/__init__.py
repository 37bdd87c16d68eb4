"""Attention layers (``nn.Module`` subclasses), every one computing through :func:`attnkit.attention`.

The seed notebooks' formulations, each a real layer, and proofs that they agree:

- :class:`~attnkit.nn.SelfAttention`: one head with its own projections (seeds 001, 002, 004).
- :class:`~attnkit.nn.HeadList`: independent heads run one by one and concatenated (seeds 000, 002).
- :class:`~attnkit.nn.StackedHeads`: per-head weights stacked ``[H, d_out, d_in]`` (seed 001).
- :class:`~attnkit.nn.MultiHeadAttention`: one matrix per projection split into heads (seeds 002,
  003), batch-first, with GQA/MQA, PyTorch interop (``from_torch``/``to_torch``), conversions
  from the two forms above (``from_heads``/``from_stacked``) and a :class:`~attnkit.nn.KVCache`
  for decoding.

Masks follow attnkit's convention everywhere: boolean **True = may attend**, or an additive
float bias; ``causal`` is bottom-right aligned; a query with no key to attend gives zeros.
"""

from .head_list import HeadList
from .kv_cache import KVCache
from .multi_head import MultiHeadAttention
from .self_attention import SelfAttention
from .stacked_heads import StackedHeads

__all__ = ["SelfAttention", "HeadList", "StackedHeads", "MultiHeadAttention", "KVCache"]
