"""Dropout on the attention weights: reproducible, unbiased, applied to what is returned."""

from __future__ import annotations

import pytest
import torch

import attnkit

BACKENDS = ["reference", "torch", "tiled"]


def _qkv(seed=0, lq=16, lk=24):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 4, lq, 8, generator=g), torch.randn(2, 4, lk, 8, generator=g),
            torch.randn(2, 4, lk, 8, generator=g))


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_generator_seed_same_result_and_global_rng_untouched(backend):
    q, k, v = _qkv()
    torch.manual_seed(0)
    expected_next = torch.rand(3)
    torch.manual_seed(0)
    a = attnkit.attention(q, k, v, dropout=0.4, generator=torch.Generator().manual_seed(1), backend=backend)
    assert torch.equal(torch.rand(3), expected_next), "dropout with a generator must not consume the global RNG"
    b = attnkit.attention(q, k, v, dropout=0.4, generator=torch.Generator().manual_seed(1), backend=backend)
    c = attnkit.attention(q, k, v, dropout=0.4, generator=torch.Generator().manual_seed(2), backend=backend)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("backend", BACKENDS)
def test_global_rng_drives_dropout_without_generator(backend):
    q, k, v = _qkv()
    torch.manual_seed(5)
    a = attnkit.attention(q, k, v, dropout=0.4, backend=backend)
    torch.manual_seed(5)
    b = attnkit.attention(q, k, v, dropout=0.4, backend=backend)
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_dropout_is_deterministic_and_exact(backend):
    q, k, v = _qkv()
    plain = attnkit.attention(q, k, v, backend="reference")
    torch.testing.assert_close(attnkit.attention(q, k, v, dropout=0.0, backend=backend), plain)


def test_returned_weights_are_the_dropped_weights_applied_to_value():
    q, k, v = _qkv()
    g = torch.Generator().manual_seed(3)
    out, weights = attnkit.attention(q, k, v, dropout=0.5, generator=g, return_weights=True)
    torch.testing.assert_close(out, weights @ v)
    _, clean = attnkit.attention(q, k, v, return_weights=True)
    kept = weights != 0
    zero_fraction = 1 - kept.float().mean().item()
    assert 0.45 < zero_fraction < 0.55  # ~ 2 * 4 * 16 * 24 = 3072 Bernoulli(0.5) draws
    torch.testing.assert_close(weights[kept], clean[kept] / 0.5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_is_unbiased(backend):
    """The mean over many dropout draws approaches the output without dropout."""
    q, k, v = _qkv(lq=4, lk=6)
    g = torch.Generator().manual_seed(11)
    draws = torch.stack([attnkit.attention(q, k, v, dropout=0.3, generator=g, backend=backend) for _ in range(800)])
    clean = attnkit.attention(q, k, v, backend="reference")
    # Each output is a sum of ~6 terms with per-term std <= |v| * sqrt(p/(1-p)); over 800 draws
    # the mean's standard error is about 0.047 here, so 0.24 is a 5-sigma band.
    assert (draws.mean(0) - clean).abs().max() < 0.24
    assert (draws.std(0).mean() > 0.05)
