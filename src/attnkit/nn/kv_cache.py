"""A key/value cache for incremental decoding: one per layer, preallocated, only the kv heads."""

from __future__ import annotations

import torch
from torch import Tensor

from . import _checks


class KVCache:
    r"""The projected keys and values of every token a layer has seen, in preallocated buffers.

    Decoding feeds a few new tokens at a time; their keys and values are written after the
    ones already stored and attention runs over everything so far. With ``causal=True`` the
    new queries are the *last* rows of the causal mask, which is exactly attnkit's
    bottom-right alignment (query ``i`` of ``Lq`` new ones sees keys ``j <= i + Lk - Lq``), so
    decoding in any chunks gives the outputs of one causal pass over the whole sequence::

        step 1 (3 tokens)      step 2 (1 token)      step 3 (2 tokens)
        # . .                  # # # #               # # # # # .
        # # .                                        # # # # # #
        # # #

    Only ``num_kv_heads`` heads are stored (grouped-query / multi-query attention shrinks the
    cache by ``num_heads / num_kv_heads``). Make one per layer with
    :meth:`~attnkit.nn.MultiHeadAttention.new_cache`; use it under ``torch.no_grad()`` (it is
    written in place), and :meth:`~attnkit.nn.KVCache.reset` it before a new sequence.

    A layer call that fails (a bad mask, say) leaves the cache as it was: the layer
    :meth:`~attnkit.nn.KVCache.stage`\ s the new tokens, attends, and only then
    :meth:`~attnkit.nn.KVCache.commit`\ s them, so a retry does not see the failed call's tokens
    twice.

    Args:
        batch_size: ``B``.
        max_length: the most tokens it holds.
        num_kv_heads: ``Hkv``, the layer's key/value heads.
        head_dim: the size of each key.
        value_head_dim: the size of each value; default ``head_dim``.
        dtype, device: of the buffers (the layer's).

    Attributes:
        keys: ``[B, num_kv_heads, max_length, head_dim]`` buffer; rows ``< len(cache)`` are valid.
        values: ``[B, num_kv_heads, max_length, value_head_dim]`` buffer.

    Raises:
        ValueError: a size that is not a positive int.
        MemoryError: the buffers cannot be allocated (the message gives their shape and size).

    Example:

        Decoding in chunks gives the outputs of one causal pass over the whole sequence:

        >>> import torch
        >>> import attnkit
        >>> layer = attnkit.nn.MultiHeadAttention(embed_dim=16, num_heads=4, num_kv_heads=2, causal=True)
        >>> cache = layer.new_cache(batch_size=2, max_length=8)
        >>> cache
        KVCache(length=0, max_length=8, batch_size=2, num_kv_heads=2, head_dim=4, value_head_dim=4,
                dtype=torch.float32, device=cpu)
        >>> x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0))
        >>> with torch.no_grad():
        ...     steps = [layer(x[:, :4], cache=cache), layer(x[:, 4:5], cache=cache), layer(x[:, 5:], cache=cache)]
        ...     whole = layer(x)
        >>> len(cache)
        6
        >>> torch.allclose(torch.cat(steps, dim=1), whole, atol=1e-5)
        True
    """

    def __init__(
        self,
        batch_size: int,
        max_length: int,
        num_kv_heads: int,
        head_dim: int,
        value_head_dim: int | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        batch_size = _checks.positive_int("batch_size", batch_size)
        max_length = _checks.positive_int("max_length", max_length)
        num_kv_heads = _checks.positive_int("num_kv_heads", num_kv_heads)
        head_dim = _checks.positive_int("head_dim", head_dim)
        value_head_dim = _checks.optional_positive_int("value_head_dim", value_head_dim, head_dim)
        rows = (batch_size, num_kv_heads, max_length)
        try:
            self.keys = torch.zeros(*rows, head_dim, dtype=dtype, device=device)
            self.values = torch.zeros(*rows, value_head_dim, dtype=dtype, device=device)
        except RuntimeError as error:
            # The allocator's refusal (a max_length far beyond the machine: `attnkit generate
            # --max-new-tokens 10**9` asked for 64 GB) names no argument; anything else is not ours to rename.
            refused = isinstance(error, getattr(torch, "OutOfMemoryError", ())) or "can't allocate memory" in str(error)
            if not refused:
                raise
            size = torch.empty((), dtype=dtype).element_size() * batch_size * num_kv_heads * max_length * (
                head_dim + value_head_dim)
            raise MemoryError(f"KVCache: keys {list(rows) + [head_dim]} and values {list(rows) + [value_head_dim]} "
                              f"need {size / 2**30:,.1f} GiB, more than {torch.device(device or 'cpu')} could "
                              f"allocate (max_length {max_length})") from error
        self.length = 0
        self._staged: int | None = None  # the length after the staged tokens, until commit()

    @property
    def max_length(self) -> int:
        """The most tokens the cache holds (its buffers' length).

        Example:

            >>> import attnkit
            >>> attnkit.nn.KVCache(batch_size=1, max_length=8, num_kv_heads=2, head_dim=4).max_length
            8
        """
        return self.keys.shape[2]

    def __len__(self) -> int:
        return self.length

    def reset(self) -> None:
        """Forget every stored token (the buffers are kept).

        Example:

            >>> import torch
            >>> import attnkit
            >>> cache = attnkit.nn.KVCache(batch_size=1, max_length=8, num_kv_heads=2, head_dim=4)
            >>> _ = cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
            >>> len(cache)
            3
            >>> cache.reset()
            >>> len(cache), cache.keys.shape
            (0, torch.Size([1, 2, 8, 4]))
        """
        self.length = 0
        self._staged = None

    def update(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Append new ``keys [B, Hkv, n, head_dim]`` and ``values [B, Hkv, n, value_head_dim]``:
        :meth:`~attnkit.nn.KVCache.stage` then :meth:`~attnkit.nn.KVCache.commit`.

        Returns every key and value stored so far, ``[B, Hkv, len(cache), *]`` views of the buffers.

        Raises:
            TypeError: keys or values that are not tensors, or not of the cache's dtype and device.
            ValueError: other shapes than the ones above, or more tokens than ``max_length`` holds.

        Example:

            >>> import torch
            >>> import attnkit
            >>> cache = attnkit.nn.KVCache(batch_size=1, max_length=8, num_kv_heads=2, head_dim=4)
            >>> g = torch.Generator().manual_seed(0)
            >>> new_keys, new_values = torch.randn(1, 2, 3, 4, generator=g), torch.randn(1, 2, 3, 4, generator=g)
            >>> keys, values = cache.update(new_keys, new_values)
            >>> keys.shape, len(cache)
            (torch.Size([1, 2, 3, 4]), 3)
            >>> keys, values = cache.update(new_keys[:, :, :1], new_values[:, :, :1])
            >>> keys.shape, len(cache)
            (torch.Size([1, 2, 4, 4]), 4)
            >>> cache.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4))
            Traceback (most recent call last):
                ...
            ValueError: cache overflow: it holds 4 of max_length=8 tokens, cannot add 5 more;
            make a larger cache or reset() it
        """
        stored = self.stage(keys, values)
        self.commit()
        return stored

    def stage(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Write new ``keys [B, Hkv, n, head_dim]`` and ``values [B, Hkv, n, value_head_dim]`` after
        the stored ones without counting them yet (``len(cache)`` is unchanged until
        :meth:`~attnkit.nn.KVCache.commit`; staging again replaces them).

        Returns the stored keys and values followed by the new ones, ``[B, Hkv, len(cache) + n, *]``
        views of the buffers.

        Raises:
            TypeError: keys or values that are not tensors, or not of the cache's dtype and device.
            ValueError: other shapes than the ones above, or more tokens than ``max_length`` holds.

        Example:

            >>> import torch
            >>> import attnkit
            >>> cache = attnkit.nn.KVCache(batch_size=1, max_length=8, num_kv_heads=2, head_dim=4)
            >>> keys, values = cache.stage(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
            >>> keys.shape, len(cache)  # staged, not yet stored
            (torch.Size([1, 2, 3, 4]), 0)
            >>> cache.commit()
            >>> len(cache)
            3
        """
        new = keys.shape[2] if isinstance(keys, Tensor) and keys.dim() == 4 else "n"
        expected_keys = (*self.keys.shape[:2], new, self.keys.shape[3])
        expected_values = (*self.values.shape[:2], new, self.values.shape[3])
        shown_keys, shown_values = (f"[{', '.join(map(str, dims))}]" for dims in (expected_keys, expected_values))
        if not (isinstance(keys, Tensor) and isinstance(values, Tensor)):
            raise TypeError(f"cache expects tensors keys {shown_keys} and values {shown_values}, "
                            f"got {type(keys).__name__} and {type(values).__name__}")
        if tuple(keys.shape) != expected_keys or tuple(values.shape) != expected_values:
            raise ValueError(
                f"cache expects keys {shown_keys} and values {shown_values} "
                f"([B, Hkv, n, D]), got keys {tuple(keys.shape)} and values {tuple(values.shape)}"
            )
        if {keys.dtype, values.dtype} != {self.keys.dtype} or {keys.device, values.device} != {self.keys.device}:
            raise TypeError(
                f"cache holds {self.keys.dtype} on {self.keys.device}, got keys {keys.dtype} on {keys.device} "
                f"and values {values.dtype} on {values.device}; make the cache with the layer's dtype and device"
            )
        end = self.length + keys.shape[2]
        if end > self.max_length:
            raise ValueError(
                f"cache overflow: it holds {self.length} of max_length={self.max_length} tokens, "
                f"cannot add {keys.shape[2]} more; make a larger cache or reset() it"
            )
        # Rows from self.length on hold no stored token: writing there changes nothing visible.
        self.keys[:, :, self.length:end] = keys
        self.values[:, :, self.length:end] = values
        self._staged = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def commit(self) -> None:
        """Count the tokens of the last :meth:`~attnkit.nn.KVCache.stage` as stored.

        Raises:
            RuntimeError: nothing is staged.

        Example:

            >>> import torch
            >>> import attnkit
            >>> cache = attnkit.nn.KVCache(batch_size=1, max_length=8, num_kv_heads=2, head_dim=4)
            >>> _ = cache.stage(torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4))
            >>> cache.commit()
            >>> len(cache)
            2
            >>> cache.commit()
            Traceback (most recent call last):
                ...
            RuntimeError: KVCache.commit: nothing is staged (call stage() first)
        """
        if self._staged is None:
            raise RuntimeError("KVCache.commit: nothing is staged (call stage() first)")
        self.length, self._staged = self._staged, None

    def __repr__(self) -> str:
        batch, heads, max_length, head_dim = self.keys.shape
        return (f"KVCache(length={self.length}, max_length={max_length}, batch_size={batch}, "
                f"num_kv_heads={heads}, head_dim={head_dim}, value_head_dim={self.values.shape[3]}, "
                f"dtype={self.keys.dtype}, device={self.keys.device})")
