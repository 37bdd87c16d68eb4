"""Decoding with a KVCache, token by token or in chunks, equals one causal pass."""

from __future__ import annotations

import pytest
import torch

from attnkit import masks
from attnkit.nn import KVCache, MultiHeadAttention

# fp32, O(1) inputs, embed 32: the cached pass attends over the same keys as the full pass, in
# smaller matmuls; differences are a few ulp, well inside the 1e-5.
CLOSE = dict(atol=1e-5, rtol=1e-5)
LENGTH = 11


def _decode(layer, sequence, chunks, **forward_kwargs):
    cache = layer.new_cache(sequence.shape[0], max_length=LENGTH + 3)
    outputs, start = [], 0
    with torch.no_grad():
        for size in chunks:
            outputs.append(layer(sequence[:, start:start + size], cache=cache, causal=True, **forward_kwargs))
            start += size
    assert start == sequence.shape[1] == len(cache)
    return outputs, cache


CHUNKINGS = {"single tokens": [1] * LENGTH, "chunks": [3, 1, 4, 2, 1], "prompt then tokens": [6, 1, 1, 1, 1, 1]}


@pytest.mark.parametrize("num_kv_heads", [8, 2, 1], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("chunking", list(CHUNKINGS))
def test_cached_decoding_equals_one_causal_pass(num_kv_heads, chunking):
    torch.manual_seed(num_kv_heads)
    layer = MultiHeadAttention(32, 8, num_kv_heads=num_kv_heads).eval()
    sequence = torch.randn(2, LENGTH, 32)
    with torch.no_grad():
        full = layer(sequence, causal=True)
    outputs, cache = _decode(layer, sequence, CHUNKINGS[chunking])
    torch.testing.assert_close(torch.cat(outputs, dim=1), full, **CLOSE)
    # Only the key/value heads are stored.
    assert cache.keys.shape == (2, num_kv_heads, LENGTH + 3, 4)
    with torch.no_grad():
        keys = layer.k_proj(sequence).view(2, LENGTH, num_kv_heads, 4).transpose(1, 2)
    torch.testing.assert_close(cache.keys[:, :, :LENGTH], keys)


def test_cached_decoding_with_weights_and_padding():
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4, num_kv_heads=2).eval()
    sequence = torch.randn(2, LENGTH, 16)
    keep = masks.lengths_to_keep(torch.tensor([LENGTH, 7]), LENGTH)  # second row: last 4 are padding
    with torch.no_grad():
        full, full_weights = layer(sequence, causal=True, mask=masks.padding_mask(keep), need_weights=True)
    cache = layer.new_cache(2, LENGTH)
    start = 0
    for size in CHUNKINGS["chunks"]:
        with torch.no_grad():
            output, weights = layer(sequence[:, start:start + size], cache=cache, causal=True, need_weights=True,
                                    mask=masks.padding_mask(keep[:, :start + size]))
        torch.testing.assert_close(output, full[:, start:start + size], **CLOSE)
        torch.testing.assert_close(weights, full_weights[:, :, start:start + size, :start + size], **CLOSE)
        start += size


def test_reset_overflow_and_mismatches_are_clear():
    layer = MultiHeadAttention(16, 4, num_kv_heads=2)
    cache = layer.new_cache(1, max_length=4)
    assert cache.max_length == 4 and len(cache) == 0 and "num_kv_heads=2" in repr(cache)
    x = torch.randn(1, 3, 16)
    with torch.no_grad():
        layer(x, cache=cache)
        with pytest.raises(ValueError, match=r"cache overflow: it holds 3 of max_length=4 tokens, cannot add 3 more"):
            layer(x, cache=cache)
        cache.reset()
        layer(x, cache=cache)
        assert len(cache) == 3
        with pytest.raises(ValueError, match=r"cache expects keys \[1, 2, 3, 4\].*got keys \(2, 2, 3, 4\)"):
            layer(torch.randn(2, 3, 16), cache=cache)
        with pytest.raises(ValueError, match="serves self-attention decoding"):
            layer(x, torch.randn(1, 2, 16), cache=cache)
    wrong = KVCache(1, 4, 2, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match="cache holds torch.float64"):
        wrong.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))


def test_a_cache_the_machine_cannot_hold_is_a_memoryerror_naming_its_shape():
    """torch's allocator refuses with a RuntimeError that names no argument; the cache names its
    buffers, their size and max_length (2**40 rows of 64 floats, keys and values: 512 TiB)."""
    with pytest.raises(MemoryError, match=r"KVCache: keys \[1, 1, 1099511627776, 64\] and values "
                                          r"\[1, 1, 1099511627776, 64\] need 524,288\.0 GiB.*max_length 1099511627776"):
        KVCache(batch_size=1, max_length=2**40, num_kv_heads=1, head_dim=64)
