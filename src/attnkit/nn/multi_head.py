"""Production multi-head attention: one matrix per projection, split into heads (seeds 002, 003)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import _steps
from ..core import attention
from . import _checks, _routing
from ._settings import AttentionSettings
from ._traced import traced_call
from .convert import HeadConversions
from .interop import TorchConversions
from .kv_cache import KVCache


class MultiHeadAttention(HeadConversions, TorchConversions, AttentionSettings, nn.Module):
    r"""Batch-first multi-head attention over :func:`attnkit.attention`; GQA and MQA included.

    ::

        query [B, Lq, E] --q_proj--> [B, Lq, H * D]    --split--> queries [B, H,   Lq, D]
        key   [B, Lk, kdim] --k_proj--> [B, Lk, Hkv * D]  --split--> keys  [B, Hkv, Lk, D]
        value [B, Lk, vdim] --v_proj--> [B, Lk, Hkv * Dv] --split--> values [B, Hkv, Lk, Dv]
        attention(queries, keys, values) -> heads [B, H, Lq, Dv]
        --concatenate--> [B, Lq, H * Dv] --out_proj--> output [B, Lq, out_dim]

    Query head ``h`` reads key/value head ``h // (H // Hkv)``: ``num_kv_heads=H`` is classic
    multi-head attention, ``1 < num_kv_heads < H`` grouped-query, ``num_kv_heads=1`` multi-query.

    Args:
        embed_dim: features of ``query`` (``E``); also of the output unless ``out_dim`` is set.
        num_heads: query heads ``H``.
        kdim, vdim: features of ``key`` and ``value``; default ``embed_dim``.
        num_kv_heads: key/value heads ``Hkv`` (dividing ``H``); default ``num_heads``.
        bias: give all four projections a bias.
        dropout: dropout on the attention weights, in training mode only.
        causal: default for ``forward(causal=...)``; bottom-right aligned (see
            :class:`~attnkit.nn.KVCache`).
        backend: the :func:`attnkit.attention` backend.
        head_dim: ``D``, the size of each head's queries and keys; default ``embed_dim // num_heads``.
        value_head_dim: ``Dv``; default ``head_dim``.
        out_dim: features of the output; default ``embed_dim``.
        output_projection: ``False`` drops ``out_proj`` (it becomes ``nn.Identity``): the output
            is the concatenated heads, as in seeds 001 and 002's list of heads.
        softcap: Gemma 2's attention-logit soft-capping ``softcap * tanh(score / softcap)``
            (``attnkit.attention(softcap=)``); default none.
        alibi_slopes: ALiBi's per-head slopes ``[num_heads]`` (FlashAttention's ``-slope * |p - j|``,
            bottom-right), kept as a buffer; default none.
        sinks: give each query head a learned sink logit (GPT-OSS): the parameter ``sinks``
            ``[num_heads]``, zeros at first, takes probability mass without a value.

    Projections are ``nn.Linear`` modules named ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``
    with PyTorch's default ``nn.Linear`` initialisation (``nn.MultiheadAttention`` uses
    Xavier-uniform weights and zero biases;
    :meth:`from_torch <attnkit.nn.interop.TorchConversions.from_torch>` copies its values).

    Conversions: :meth:`from_heads <attnkit.nn.convert.HeadConversions.from_heads>` and
    :meth:`from_stacked <attnkit.nn.convert.HeadConversions.from_stacked>` (the seeds' other
    formulations, :mod:`attnkit.nn.convert`),
    :meth:`from_torch <attnkit.nn.interop.TorchConversions.from_torch>` and
    :meth:`to_torch <attnkit.nn.interop.TorchConversions.to_torch>` (:mod:`attnkit.nn.interop`).
    ``causal``, ``dropout`` and ``backend`` may be reassigned; a bad value is refused on assignment.

    Differences from ``torch.nn.MultiheadAttention`` (see
    :meth:`~attnkit.nn.MultiHeadAttention.forward`): one ``mask`` with **True = may attend**
    instead of ``key_padding_mask``/``attn_mask`` with True = ignore; weights per head
    ``[B, H, Lq, Lk]``, never averaged; a query with no key to attend gives zeros where PyTorch
    gives NaN; ``causal`` is bottom-right aligned when ``Lq != Lk``.

    Raises:
        ValueError: a size that is not a positive int, ``num_heads`` not a multiple of ``num_kv_heads``,
            ``embed_dim`` not divisible by ``num_heads`` without ``head_dim``, an ``out_dim`` without
            the output projection that does not equal ``num_heads * value_head_dim``, a ``dropout``
            outside ``[0, 1)``, an unknown ``backend``, a bad ``softcap`` or ``alibi_slopes`` of another
            shape.
        TypeError: a flag that is not a bool, or ``alibi_slopes`` that are not a floating tensor.

    Example:

        >>> import torch
        >>> import attnkit
        >>> layer = attnkit.nn.MultiHeadAttention(embed_dim=16, num_heads=4, num_kv_heads=2, causal=True)
        >>> layer
        MultiHeadAttention(
          embed_dim=16, num_heads=4, num_kv_heads=2, head_dim=4, dropout=0.0, causal=True, backend='auto'
          (q_proj): Linear(in_features=16, out_features=16, bias=True)
          (k_proj): Linear(in_features=16, out_features=8, bias=True)
          (v_proj): Linear(in_features=16, out_features=8, bias=True)
          (out_proj): Linear(in_features=16, out_features=16, bias=True)
        )
        >>> x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0))  # [B, L, E]
        >>> layer(x).shape
        torch.Size([2, 6, 16])
        >>> attnkit.nn.MultiHeadAttention(embed_dim=16, num_heads=3)
        Traceback (most recent call last):
            ...
        ValueError: embed_dim (16) must be divisible by num_heads (3), or give head_dim explicitly
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kdim: int | None = None,
        vdim: int | None = None,
        num_kv_heads: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        causal: bool = False,
        backend: str = "auto",
        head_dim: int | None = None,
        value_head_dim: int | None = None,
        out_dim: int | None = None,
        output_projection: bool = True,
        softcap: float | None = None,
        alibi_slopes: Tensor | None = None,
        sinks: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.embed_dim = _checks.positive_int("embed_dim", embed_dim)
        self.num_heads = _checks.positive_int("num_heads", num_heads)
        self.kdim = _checks.optional_positive_int("kdim", kdim, self.embed_dim)
        self.vdim = _checks.optional_positive_int("vdim", vdim, self.embed_dim)
        self.num_kv_heads = _checks.optional_positive_int("num_kv_heads", num_kv_heads, self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if head_dim is None and self.embed_dim % self.num_heads:
            raise ValueError(
                f"embed_dim ({self.embed_dim}) must be divisible by num_heads ({self.num_heads}), "
                "or give head_dim explicitly"
            )
        self.head_dim = _checks.optional_positive_int("head_dim", head_dim, self.embed_dim // self.num_heads)
        self.value_head_dim = _checks.optional_positive_int("value_head_dim", value_head_dim, self.head_dim)
        concatenated = self.num_heads * self.value_head_dim
        output_projection = _checks.boolean("output_projection", output_projection)
        if not output_projection and out_dim not in (None, concatenated):
            raise ValueError(
                f"without an output projection the output has num_heads * value_head_dim = {concatenated} "
                f"features, got out_dim={out_dim}"
            )
        self.out_dim = concatenated if not output_projection else _checks.optional_positive_int(
            "out_dim", out_dim, self.embed_dim)
        self.dropout = dropout
        self.causal = causal
        self.backend = backend
        bias = _checks.boolean("bias", bias)

        factory = dict(device=device, dtype=dtype)
        self.q_proj = nn.Linear(self.embed_dim, self.num_heads * self.head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(self.kdim, self.num_kv_heads * self.head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, self.num_kv_heads * self.value_head_dim, bias=bias, **factory)
        self.out_proj: nn.Module = (nn.Linear(concatenated, self.out_dim, bias=bias, **factory)
                                    if output_projection else nn.Identity())
        self.softcap = _checks.optional_softcap(softcap)
        self.register_buffer("alibi_slopes", _checks.optional_head_vector("alibi_slopes", alibi_slopes,
                                                                           self.num_heads, device))
        self.sinks = (nn.Parameter(torch.zeros(self.num_heads, **factory))
                      if _checks.boolean("sinks", sinks) else None)

    @traced_call
    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        causal: bool | None = None,
        need_weights: bool = False,
        cache: KVCache | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Multi-head attention from ``query`` to ``key``/``value`` (self-attention when omitted).

        Args:
            query: ``[B, Lq, embed_dim]`` (or unbatched ``[Lq, embed_dim]``).
            key: ``[B, Lk, kdim]``; default ``query`` (self-attention).
            value: ``[B, Lk, vdim]``; default ``key``.
            mask: boolean (**True = may attend**) or additive float (``-inf`` removes a key),
                broadcastable to ``[B, H, Lq, Lk]``. A 2-D mask is ``[Lq, Lk]``. For key
                padding use ``attnkit.masks.padding_mask(lengths_or_keep)`` (``[B, 1, 1, Lk]``);
                PyTorch's masks (True = ignore) convert with
                ``attnkit.masks.from_torch_key_padding_mask`` and ``from_torch_attn_mask``.
                With a cache, ``Lk`` counts every cached key plus the new ones.
            causal: query ``i`` sees only keys ``j <= i + Lk - Lq`` (bottom-right aligned, as
                decoding with a cache needs); intersected with ``mask``. Default: the layer's.
            need_weights: also return the weights. They come from a materialised ``[B, H, Lq, Lk]``
                path; without them the fused kernel runs and never stores that matrix.
            cache: a :class:`~attnkit.nn.KVCache` from :meth:`~attnkit.nn.MultiHeadAttention.new_cache`
                (self-attention only): the new tokens' keys and values are appended to it and
                attention runs over all of them. They are counted as stored only once the call
                succeeds: a call that fails (a bad mask, say) leaves the cache as it was.

        Returns:
            ``output [B, Lq, out_dim]`` when ``need_weights=False``, else
            ``(output, weights [B, H, Lq, Lk])``: per head, after masking and dropout.
            A query row with no key it may attend gives zero heads (the output is then
            ``out_proj``'s bias) and zero weights, never NaN; ``nn.MultiheadAttention`` returns
            NaN there whenever it materialises the weights.

        Raises:
            TypeError or ValueError: inputs that are not floating tensors of the sizes above or batched
                unlike each other, ``value`` without ``key``, a ``cache`` that is not a
                :class:`~attnkit.nn.KVCache` or is given with ``key`` (or overflows), a mask that does
                not broadcast (from :func:`attnkit.attention`).

        Example:

            Cross-attention to 4 tokens of another size, the second sequence's last two padded:

            >>> import torch
            >>> import attnkit
            >>> g = torch.Generator().manual_seed(0)
            >>> x, memory = torch.randn(2, 6, 16, generator=g), torch.randn(2, 4, 8, generator=g)
            >>> layer = attnkit.nn.MultiHeadAttention(16, num_heads=4, kdim=8, vdim=8)
            >>> mask = attnkit.masks.padding_mask(torch.tensor([4, 2]), 4)  # [B, 1, 1, Lk]
            >>> output, weights = layer(x, memory, memory, mask=mask, need_weights=True)
            >>> output.shape, weights.shape
            (torch.Size([2, 6, 16]), torch.Size([2, 4, 6, 4]))
            >>> bool((weights[1, ..., 2:] == 0).all())
            True
        """
        key, value = self._key_and_value(query, key, value)
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache (from new_cache) or None, got {type(cache).__name__}")
        if cache is not None and key is not query:
            raise ValueError("a KVCache serves self-attention decoding: call forward(query, cache=cache) without key")

        _steps.record("inputs", query)
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        batch, q_len, k_len = query.shape[0], query.shape[1], key.shape[1]
        queries = self.q_proj(query).view(batch, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        keys = self.k_proj(key).view(batch, k_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        values = self.v_proj(value).view(batch, k_len, self.num_kv_heads, self.value_head_dim).transpose(1, 2)
        if cache is not None:
            keys, values = cache.stage(keys, values)
        _steps.record("queries", queries)
        _steps.record("keys", keys)
        _steps.record("values", values)

        settings = dict(mask=mask, causal=self.causal if causal is None else causal,
                        dropout=self.dropout if self.training else 0.0, backend=self.backend,
                        softcap=self.softcap, alibi_slopes=self.alibi_slopes, sinks=self.sinks)
        route = _routing.current() if key is query else None
        if route is not None:  # sequence parallel (attnkit.distributed.sequence_parallel): x is this rank's shard
            if need_weights or cache is not None:
                raise ValueError("under attnkit.distributed.sequence_parallel a layer's self-attention runs over the "
                                 "whole sequence across ranks: need_weights and cache are not available there")
            result = route(queries, keys, values, **settings)
        else:
            result = attention(queries, keys, values, return_weights=need_weights, **settings)
        heads = result[0] if need_weights else result
        _steps.record("heads", heads)
        concatenated = heads.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.value_head_dim)
        _steps.record("concatenated", concatenated)
        output = self.out_proj(concatenated)
        _steps.record("projected", output)

        if cache is not None:
            cache.commit()
        if unbatched:
            output = output.squeeze(0)
        if not need_weights:
            return output
        weights = result[1]
        return output, (weights.squeeze(0) if unbatched else weights)

    def _key_and_value(self, query: Tensor, key: Tensor | None, value: Tensor | None) -> tuple[Tensor, Tensor]:
        """Check the inputs' shapes; fill in the defaults (key = query, value = key)."""
        _checks.features("query", query, self.embed_dim)
        if key is None and value is not None:
            raise ValueError("value was given without key; pass key too (value defaults to key)")
        key_name = "key" if key is not None else "key (defaulting to query)"
        key = query if key is None else key
        _checks.features(key_name, key, self.kdim)
        _checks.same_batch(query, "key", key)
        value_name = "value" if value is not None else "value (defaulting to key)"
        value = key if value is None else value
        _checks.features(value_name, value, self.vdim)
        _checks.same_sequences(key, value)
        return key, value

    def new_cache(
        self,
        batch_size: int,
        max_length: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """An empty :class:`~attnkit.nn.KVCache` for this layer (its ``num_kv_heads`` heads only), on
        the layer's dtype and device unless told otherwise.

        Args:
            batch_size: ``B``, the sequences decoded together.
            max_length: the most tokens the cache holds.
            dtype, device: of the cache; default the layer's.

        Raises:
            ValueError: a size that is not a positive int.

        Example:

            >>> import torch
            >>> import attnkit
            >>> layer = attnkit.nn.MultiHeadAttention(embed_dim=16, num_heads=4, num_kv_heads=1, causal=True)
            >>> cache = layer.new_cache(batch_size=2, max_length=32)
            >>> cache.keys.shape  # [B, Hkv, max_length, head_dim]: one head (multi-query)
            torch.Size([2, 1, 32, 4])
            >>> g = torch.Generator().manual_seed(0)
            >>> prompt, token = torch.randn(2, 5, 16, generator=g), torch.randn(2, 1, 16, generator=g)
            >>> with torch.no_grad():
            ...     _ = layer(prompt, cache=cache)  # the 5 prompt tokens' keys and values are stored
            ...     out = layer(token, cache=cache)  # one new token attends all 6
            >>> out.shape, len(cache)
            (torch.Size([2, 1, 16]), 6)
        """
        weight = self.k_proj.weight
        return KVCache(batch_size, max_length, self.num_kv_heads, self.head_dim, self.value_head_dim,
                       dtype=dtype or weight.dtype, device=device or weight.device)

    def extra_repr(self) -> str:
        extras = [f"embed_dim={self.embed_dim}", f"num_heads={self.num_heads}"]
        if self.num_kv_heads != self.num_heads:
            extras.append(f"num_kv_heads={self.num_kv_heads}")
        extras.append(f"head_dim={self.head_dim}")
        if self.value_head_dim != self.head_dim:
            extras.append(f"value_head_dim={self.value_head_dim}")
        if (self.kdim, self.vdim) != (self.embed_dim, self.embed_dim):
            extras += [f"kdim={self.kdim}", f"vdim={self.vdim}"]
        if not isinstance(self.out_proj, nn.Linear):
            extras.append("output_projection=False")
        elif self.out_dim != self.embed_dim:
            extras.append(f"out_dim={self.out_dim}")
        extras += [f"dropout={self.dropout}", f"causal={self.causal}", f"backend={self.backend!r}"]
        return ", ".join(extras)
