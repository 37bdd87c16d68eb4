"""A piece of a call draws the whole call's dropout pattern at its own positions (the private
seed-with-offsets of attnkit.distributed): the same weights kept as the corresponding slice of the
whole call, on every Python path and in the native kernel (dropout_start)."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit._backends import dropout as _dropout
from attnkit._backends import policy
from attnkit._backends.interval_inputs import IntervalInputs
from attnkit.core import attention_piece

P = 0.3


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 4, 30, 8, dtype=dtype, generator=g), torch.randn(2, 2, 40, 8, dtype=dtype, generator=g),
            torch.randn(2, 2, 40, 6, dtype=dtype, generator=g))


def _seed() -> torch.Tensor:
    return _dropout.draw_seed(torch.Generator().manual_seed(9))


@pytest.mark.parametrize("backend", ["reference", "torch", "tiled"])
def test_a_piece_keeps_the_slice_of_the_whole_pattern(backend):
    q, k, v = _inputs()
    _, whole = attnkit.attention(q, k, v, dropout=P, generator=torch.Generator().manual_seed(9),
                                 return_weights=True, backend=backend)
    # query heads 2-3 (kv head 1), rows 5..20, keys 10..30
    _, piece = attention_piece(q[:, 2:4, 5:20], k[:, 1:2, 10:30], v[:, 1:2, 10:30], seed=_seed(), heads=2, rows=5,
                               keys=10, dropout=P, return_weights=True, backend=backend)
    dropped = whole[:, 2:4, 5:20, 10:30] == 0  # random inputs: a weight is 0 exactly where it was dropped
    assert 0.2 < dropped.double().mean() < 0.4
    assert torch.equal(piece == 0, dropped)


def test_the_op_path_computes_the_whole_calls_rows():
    """Through the interval op in float32 (the native kernel where it is built): rows 5..20 over keys 10..30 equal those rows of the whole call whose mask
    allows exactly those keys (1e-6: float32 sums of 20 terms in a different blocking)."""
    q, k, v = _inputs(torch.float32)
    allowed = masks.key_ranges(torch.full((30,), 10), torch.full((30,), 30))
    whole = attnkit.attention(q, k, v, mask=allowed, dropout=P, generator=torch.Generator().manual_seed(9))
    piece = attention_piece(q[:, :, 5:20], k[:, :, 10:30], v[:, :, 10:30], seed=_seed(), rows=5, keys=10, dropout=P)
    torch.testing.assert_close(piece, whole[:, :, 5:20], atol=1e-6, rtol=1e-6)


def test_the_native_kernel_draws_a_piece_at_its_offsets():
    """The same piece through the native kernel and through PyTorch's kernels block by block: the
    same weights dropped (read back through identity values: a dropped weight is exactly 0)."""
    native = attnkit._backends.native
    if not native.available():
        pytest.skip(f"native kernel: {native.why_unavailable()}")
    q, k, _ = _inputs(torch.float32)
    identity = torch.eye(20).expand(2, 2, 20, 20)
    lo, hi = torch.zeros(1, 1, 15, dtype=torch.int64), torch.full((1, 1, 15), 20, dtype=torch.int64)
    offsets = _dropout.at_positions(_seed(), 2, 5, 10)
    assert offsets.shape == (4,) and _dropout.has_offsets(offsets)
    piece = (q[:, 2:4, 5:20] * 0.01, k[:, 1:2, 10:30].expand(2, 2, 20, 8), identity)
    assert policy.kernel_for(IntervalInputs(*piece, lo, hi, dropout=P, seed=offsets)) == "native"
    ours = attention_piece(*piece, seed=_seed(), heads=2, rows=5, keys=10, dropout=P, backend="tiled")
    with native.turned_off():
        theirs = attention_piece(*piece, seed=_seed(), heads=2, rows=5, keys=10, dropout=P, backend="tiled")
    assert 0.2 < (ours == 0).double().mean() < 0.4
    assert torch.equal(ours == 0, theirs == 0)


def test_attention_piece_takes_a_seed_not_a_generator():
    q, k, v = _inputs()
    with pytest.raises(TypeError, match="seed"):
        attention_piece(q, k, v, seed=_seed(), dropout=P, generator=torch.Generator())
    with pytest.raises(TypeError, match="seed must be an int64"):
        attention_piece(q, k, v, seed=None, dropout=P)
