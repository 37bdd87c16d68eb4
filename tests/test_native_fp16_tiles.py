"""float16 on the native kernel's AMX tiles (``csrc/amx.h``): each float16 value is exactly the sum
of two bfloat16 parts (its upper 8 significant bits and the 3 left), so the products run on the
bfloat16 tiles as x_h y_h + x_h y_l + x_l y_h (x_l y_l, at most 2^-18 of |x| |y|, dropped). Where
the CPU has no AMX (or the OS refuses its state) these tests skip; float16 there takes the
float32-convert path, which ``test_native_half.py`` holds to the float32 kernel bit for bit.

References: float64 on the float16 values (FlashAttention's rule: at most twice the error of
PyTorch's own computation in float16), and the float32-convert path of the same kernel
(``native.half_products("convert")``) for what must not move: the lse to float32's rounding, the
dropout pattern, NaN and inf (a call that meets one runs again on that path, so its bits are that
path's).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from attnkit import masks
from attnkit._backends import native
from attnkit._backends.native import ops, tile_tables
from test_native_bf16_products import (MASKS, SHAPES, backward_within_the_rule, features_within_the_rule,
                                      forward_within_the_rule, random_call_within_the_rule)


@pytest.fixture(autouse=True)
def on_tiles():
    if not native.half_products_available("tiles"):
        pytest.skip("the CPU has no AMX-BF16 (or the OS does not grant its state)")
    with native.half_products("tiles"):
        yield


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:7])) + s[7])
@pytest.mark.parametrize("name", list(MASKS))
def test_forward_within_twice_pytorchs_fp16_error(shape, name):
    got, lse, converted, converted_lse, _ = forward_within_the_rule(torch.float16, shape, name)
    finite = torch.isfinite(lse)
    assert not torch.equal(lse[finite], converted_lse[finite])  # the tiles did run: other float32 sums
    # the scores take the low parts: with the high parts alone (bf16) the lse moved by ~1e-2; the
    # dropped x_l y_l moves a score by up to 2^-18 sum_d |q_d k_d| / sqrt(D) (~1e-5 here)
    torch.testing.assert_close(lse, converted_lse, rtol=1e-5, atol=1e-4)


def test_a_row_on_one_key_reads_that_value_exactly():
    """A row that attends one key has weight 1 there, and out = v: exact only if V's low part joins
    the product (with the high part alone, v would come back with 8 significant bits of its 11). The
    values span float16's range, subnormals to 65504. Its lse is its one score, q . k / sqrt(D):
    float32's rounding plus the dropped x_l y_l, within 2^-16 of sum |q_d k_d| / sqrt(D)."""
    g = torch.Generator().manual_seed(4)
    length, dim = 96, 64
    magnitude = torch.pow(2.0, torch.randint(-24, 16, (1, 2, length, dim), generator=g).float())
    v = (torch.randn(1, 2, length, dim, generator=g).sign() * magnitude * (1 + torch.rand(1, 2, length, dim, generator=g)))
    v = v.clamp(-65504, 65504).half()
    q, k = (torch.randn(1, 2, length, dim, generator=g).half() for _ in range(2))
    lo, hi = (t[:, 0] for t in masks.sliding_window(1).row_ranges(length, length))
    out, lse = native.interval_forward(q, k, v, lo, hi, dim ** -0.5)
    assert torch.equal(out, v)
    products = q.double() * k.double()
    exact = products.sum(-1) * dim ** -0.5
    bound = products.abs().sum(-1) * dim ** -0.5 * 2 ** -16
    assert ((lse.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:7])) + s[7])
@pytest.mark.parametrize("name", ["window", "causal+padding"])
def test_backward_within_twice_pytorchs_fp16_error(shape, name):
    """The five products on the tiles in two parts each (scores and dP = dO V^T over three times the
    features, dV and dK with dO's and Q's low parts, dQ with K^T's): gradients against float64 by
    the 2x rule, the lse's gradient too."""
    backward_within_the_rule(torch.float16, shape, name)


@pytest.mark.parametrize("feature", ["softcap", "alibi", "dropout", "scale"])
def test_features_within_twice_pytorchs_fp16_error(feature):
    """Forward and backward with each score modifier, a scale, and dropout (the same pattern as the
    float32-convert path: the same zeros)."""
    got = features_within_the_rule(torch.float16, feature)
    if feature == "dropout":
        with native.half_products("convert"):
            converted = features_within_the_rule(torch.float16, feature)
        assert torch.equal(got[0] == 0, converted[0] == 0)


def _on_tiles_and_converted(q, k, v, grad_out, lo, hi):
    """Output, lse and the three gradients of the raw ops (with the residual, as a differentiated
    call runs them), on the tiles and on the float32-convert path."""
    def run():
        out, lse, low = native.interval_forward(q, k, v, lo, hi, 0.125, residual=True)
        return (out, lse, *native.interval_backward(grad_out, q, k, v, out, lse, lo, hi, 0.125, out_low=low))

    got = run()
    with native.half_products("convert"):
        return got, run()


@pytest.mark.parametrize("where", ["query", "key", "value"])
@pytest.mark.parametrize("planted", [float("nan"), float("inf"), float("-inf")])
def test_a_nan_or_inf_runs_the_call_again_converted(where, planted):
    """A non-finite value does not split into two finite parts (inf - inf), so a call whose splits
    meet one runs again on the float32-convert path: the output, lse and gradients are that path's,
    bit for bit."""
    g = torch.Generator().manual_seed(30)
    q, k, v, grad_out = (torch.randn(1, 2, 100, 64, generator=g).half() for _ in range(4))
    {"query": q, "key": k, "value": v}[where][0, 1, 40, 3] = planted
    lo, hi = (t[:, 0] for t in masks.sliding_window(20).row_ranges(100, 100))
    got, converted = _on_tiles_and_converted(q, k, v, grad_out, lo, hi)
    assert got[0].isnan().any() or got[0].isinf().any() or got[2].isnan().any()
    for what, mine, theirs in zip(("output", "lse", "dq", "dk", "dv"), got, converted):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True, msg=what)


@pytest.mark.parametrize("where", ["key", "value"])
@pytest.mark.parametrize("planted", [float("nan"), float("inf")])
def test_a_nan_or_inf_no_row_attends_changes_nothing(where, planted):
    """In a key no row attends, a NaN or inf stays out of every result: the tiles never split it
    (the keys' rows are split over the blocks' spans), or meet it in the 32-key blocks of K^T and
    V^T they read and run the call again converted; either way, results as the convert path's."""
    g = torch.Generator().manual_seed(32)
    q, k, v, grad_out = (torch.randn(1, 2, 100, 64, generator=g).half() for _ in range(4))
    mask = masks.causal() & masks.padding([70])  # keys 70-99 attended by no row
    {"key": k, "value": v}[where][0, 1, 75, 3] = planted
    lo, hi = (t[:, 0] for t in mask.row_ranges(100, 100))
    got, converted = _on_tiles_and_converted(q, k, v, grad_out, lo, hi)
    for what, mine, theirs in zip(("output", "lse", "dq", "dk", "dv"), got, converted):
        assert mine.isfinite().all() and theirs.isfinite().all(), what
        assert (mine.float() - theirs.float()).abs().max() <= 2e-3, what


def test_a_nan_in_the_outputs_gradient_alone_keeps_the_forwards_rows():
    """dO is split by the backward alone: a NaN there sends the backward (not the forward) to the
    convert path, which puts NaN and inf where that path does."""
    g = torch.Generator().manual_seed(31)
    q, k, v, grad_out = (torch.randn(1, 2, 100, 64, generator=g).half() for _ in range(4))
    grad_out[0, 0, 50, 7] = float("nan")
    lo, hi = (t[:, 0] for t in masks.sliding_window(20).row_ranges(100, 100))
    got, converted = _on_tiles_and_converted(q, k, v, grad_out, lo, hi)
    assert not torch.equal(got[1], converted[1])  # the forward's lse: the tiles' sums
    for mine, theirs in zip(got[2:], converted[2:]):
        assert torch.equal(mine.isnan(), theirs.isnan()) and torch.equal(mine.isinf(), theirs.isinf())
        assert (mine.float() - theirs.float()).nan_to_num().abs().max() <= 2e-3


def test_the_backward_takes_the_packed_tiles_table():
    q = torch.zeros(1, 2, 64, 64, dtype=torch.float16)
    lo, hi = masks.sliding_window(16).row_ranges(64, 64)
    assert ops.backward_packs(q, q, q, q)
    assert tile_tables.backward_tiles(lo, hi, True) == tile_tables.PACKED_BACKWARD_TILES[0][1]
    assert not ops.backward_packs(q[..., :48], q[..., :48], q[..., :48], q[..., :48])  # not whole tiles
    with native.half_products("dots"):  # the dot products take bfloat16 only
        assert not ops.backward_packs(q, q, q, q)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(length=st.integers(1, 160), heads=st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2)]),
       dims=st.sampled_from([(32, 32), (64, 64), (64, 32), (32, 64)]),
       kind=st.sampled_from(["window", "documents", "padding", "prefix", "causal"]), width=st.integers(1, 160),
       feature=st.sampled_from(["none", "softcap", "alibi", "sinks", "dropout"]), seed=st.integers(0, 2**16))
# every row on one key, with dropout: dk is 0 in exact arithmetic and both bars read 0; ours read
# 1.03e-5 (FlashAttention's algorithm in float32: 1.04e-5), over the flat 1e-5 the rule allowed before
@example(length=149, heads=(2, 1), dims=(32, 64), kind="padding", width=1, feature="dropout", seed=464)
def test_random_calls_within_twice_pytorchs_fp16_error(length, heads, dims, kind, width, feature, seed):
    """FlashAttention's rule over random calls, as test_native_bf16_products' test of that name:
    the bar is SDPA over the dense mask for plain calls, the reference backend in float16 for the
    modifiers SDPA lacks; inputs and the output's gradient are float16 values for every contender."""
    random_call_within_the_rule(torch.float16, length, heads, dims, kind, width, feature, seed)
