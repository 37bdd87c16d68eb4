"""The native kernel in bfloat16 and float16 (``csrc/half.h``): inputs and outputs in the call's
dtype, everything between in float32.

Two references:
- the float64 oracle, against which the kernel's error is at most twice the error of PyTorch's
  own kernel in that dtype (FlashAttention's rule), outputs and gradients, for each mask kind;
- the float32 kernel (itself held to the oracle by test_native.py) on the same values upcast:
  a half-precision call computes exactly that and rounds once, so the two agree bit for bit,
  whatever the features (GQA, dropout, soft-capping, ALiBi, lse, layouts, empty rows, NaN).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import _torch_private, masks
from attnkit._backends import auto_runs, native
from attnkit._backends.native import loading
from attnkit._call import make_call
from oracle import oracle_attention, output_and_gradients
from test_native import interval_cases

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.why_unavailable()}")

HALF = [torch.bfloat16, torch.float16]


@contextlib.contextmanager
def _policy_of_a_cpu(*, multiplies_half: bool, tiles: bool):
    """"auto"'s half-precision rules as on a CPU that does (or does not) multiply half precision in
    hardware and give the kernel AMX tiles, on any CPU: the CPU probe and the tiles' state read when
    the kernel loaded (which the policy and ``serves_half_precision`` both read) are patched, and
    the cached rule is recomputed inside and after."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_torch_private, "cpu_multiplies_half_precision", lambda: multiplies_half)
        patch.setattr(loading._library, "matrix_units", tiles)
        loading.serves_half_precision.cache_clear()
        try:
            yield
        finally:
            loading.serves_half_precision.cache_clear()


@pytest.fixture
def cpu_without_half_units():
    """The policy of a CPU with no half-precision matrix units (AVX2, Zen 3), on any CPU: on one
    with AVX512-BF16 and no AMX, "auto" keeps PyTorch's kernels for half precision (see the last
    test), and these tests are about the kernel's route."""
    with _policy_of_a_cpu(multiplies_half=False, tiles=False):
        yield


def _same(got, want):
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@needs_native
@settings(max_examples=40, deadline=None)
@given(c=interval_cases(), dtype=st.sampled_from(HALF), dropout=st.sampled_from([0.0, 0.3]),
       softcap=st.sampled_from([None, 2.0]), alibi=st.booleans(), with_nan=st.booleans(),
       parts=st.sampled_from([1, 3]))
def test_half_precision_is_the_float32_kernel_rounded_once(c, dtype, dropout, softcap, alibi, with_nan, parts):
    """One part rounds each task's float32 sums of dK, dV into the gradient directly; several sum
    their float32 copies first: either way the float32 kernel's sums, rounded once."""
    q, k, v = (c[name].to(dtype) for name in ("query", "key", "value"))
    if with_nan:  # NaN and inf follow the float32 kernel's rules (test_native's IEEE tests)
        k = k.clone()  # any layout: clone keeps the strides, so index rather than view(-1)
        k[0, 0, 0, 0] = float("nan")
        v = v.clone()
        v[-1, -1, -1, -1] = float("inf")
    slopes = torch.rand(q.shape[1]) if alibi else None
    options = dict(block=c["block"], chunk=c["chunk"], dropout=dropout, seed=7, softcap=softcap, alibi_slopes=slopes)
    with native.matrix_units(False):  # the float32-convert path (the AMX tiles: test_native_amx.py)
        out, lse = native.interval_forward(q, k, v, c["lo"], c["hi"], c["scale"], **options)
    out32, lse32 = native.interval_forward(q.float(), k.float(), v.float(), c["lo"], c["hi"], c["scale"], **options)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == out32.shape
    _same(out, out32.to(dtype))
    _same(lse, lse32)

    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    with native.matrix_units(False):
        grads = native.interval_backward(grad_out, q, k, v, out, lse, c["lo"], c["hi"], c["scale"], block=c["block"],
                                         chunk=c["chunk"], parts=parts, dropout=dropout, seed=7, softcap=softcap,
                                         alibi_slopes=slopes)
    # the float32 backward given the same output (rounded to the dtype, as the half call's is)
    grads32 = native.interval_backward(grad_out.float(), q.float(), k.float(), v.float(), out.float(), lse,
                                       c["lo"], c["hi"], c["scale"], block=c["block"], chunk=c["chunk"], parts=parts,
                                       dropout=dropout, seed=7, softcap=softcap, alibi_slopes=slopes)
    for got, want, given_input in zip(grads, grads32, (q, k, v)):
        assert got.dtype == dtype and got.shape == given_input.shape
        _same(got, want.to(dtype))


def _cases():
    """(name, lo, hi) row intervals of the structured masks the issue measures, L = 192."""
    length = 192
    made = {
        "window": masks.sliding_window(48),
        "documents": masks.document([40, 72, 80]) & masks.causal(),
        "causal+padding": masks.causal() & masks.padding([150]),
    }
    return [(name, mask, length) for name, mask in made.items()]


def _call(q, k, v, mask=None, causal=False):
    return make_call(q, k, v, mask=mask, causal=causal, scale=None, dropout=0.0, generator=None,
                     return_weights=False)


def _max_error(got, want):
    return (got.double() - want).abs().max().item()


@needs_native
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name,mask,length", _cases())
def test_within_twice_pytorchs_error_against_float64(dtype, name, mask, length, cpu_without_half_units):
    """Outputs and the three gradients against float64, beside SDPA in the same dtype over the
    same dense mask (GQA: 4 query heads on 2 key/value heads, the keys repeated for SDPA)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, length, 64, generator=g)
    k, v = (torch.randn(1, 2, length, 64, generator=g) for _ in range(2))
    grad_out = torch.randn(1, 4, length, 64, generator=g)
    allowed = mask.dense(length, length, ndim=4)
    allowed = allowed if allowed.dim() == 4 else allowed[None, None]
    assert allowed.any(-1).all(), "every row attends a key (SDPA gives NaN for rows with none)"

    def gradients(fn, dt):
        return output_and_gradients(fn, (q, k, v), grad_out, dt)

    expected = gradients(lambda a, b, c: oracle_attention(a, b, c, mask=allowed)[0], torch.float64)
    pytorch = gradients(lambda a, b, c: F.scaled_dot_product_attention(
        a, b.repeat_interleave(2, 1), c.repeat_interleave(2, 1), attn_mask=allowed), dtype)
    assert auto_runs(_call(q.to(dtype), k.to(dtype), v.to(dtype), mask=mask)) == "tiled:native"
    ours = gradients(lambda a, b, c: attnkit.attention(a, b, c, mask=mask), dtype)
    for what, got, theirs, want in zip(("output", "dq", "dk", "dv"), ours, pytorch, expected):
        assert got.dtype == dtype
        bound = 2 * _max_error(theirs, want)
        assert _max_error(got, want) <= bound, (what, _max_error(got, want), bound)


@needs_native
@pytest.mark.parametrize("dtype", HALF)
def test_auto_sends_half_precision_structured_calls_to_the_native_kernel(dtype, cpu_without_half_units):
    q = torch.randn(1, 2, 512, 32, dtype=dtype)
    for mask in (masks.sliding_window(64), masks.document([200, 312]), masks.causal() & masks.padding([400])):
        assert auto_runs(_call(q, q, q, mask=mask)) == "tiled:native"
    for grad in (False, True):  # plain causal too, with or without a backward to run (see the policy)
        assert auto_runs(_call(q, q.requires_grad_(grad), q, causal=True)) == "tiled:native"


@needs_native
@pytest.mark.parametrize("dtype", HALF)
def test_a_model_layout_keeps_its_layout_and_dtype(dtype):
    """Projections viewed as heads ([B, L, H, D] in memory): outputs and gradients come back laid
    out the same way, in the dtype, equal to the float32 kernel's rounded; 2100 rows, so that the
    keys and values are gathered first (params.h, rows_together)."""
    g = torch.Generator().manual_seed(0)
    length = 2100
    q = torch.randn(1, length, 4, 16, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(1, length, 2, 16, generator=g).to(dtype).transpose(1, 2)
    lo = torch.clamp(torch.arange(length) - 40, min=0)[None]
    hi = (torch.arange(length) + 1)[None]
    with native.matrix_units(False):  # the float32-convert path (the AMX tiles: test_native_amx.py)
        out, lse = native.interval_forward(q, k, k, lo, hi, 0.2)
    assert out.dtype == dtype and out.transpose(1, 2).is_contiguous()
    _same(out, native.interval_forward(q.float(), k.float(), k.float(), lo, hi, 0.2)[0].to(dtype))
    grad_out = torch.ones_like(out)
    with native.matrix_units(False):
        grads = native.interval_backward(grad_out, q, k, k, out, lse, lo, hi, 0.2)
    grads32 = native.interval_backward(grad_out.float(), q.float(), k.float(), k.float(), out.float(), lse, lo, hi, 0.2)
    assert all(grad.transpose(1, 2).is_contiguous() for grad in grads)
    for got, want in zip(grads, grads32):
        assert got.dtype == dtype
        _same(got, want.to(dtype))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_no_query_rows_give_zero_key_gradients(dtype):
    """No task runs without query rows: dK and dV (written by the tasks in half precision) are
    still zeros, in the dtype."""
    q, k = torch.randn(1, 2, 0, 8).to(dtype), torch.randn(1, 2, 5, 8).to(dtype)
    lo, hi = torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long)
    out, lse = native.interval_forward(q, k, k, lo, hi, 0.5)
    _, dk, dv = native.interval_backward(torch.ones_like(out), q, k, k, out, lse, lo, hi, 0.5)
    for grad in (dk, dv):
        assert grad.dtype == dtype and grad.shape == k.shape
        _same(grad, torch.zeros_like(k))


@needs_native
def test_mixed_dtypes_are_refused():
    q = torch.randn(1, 1, 8, 4)
    lo, hi = torch.zeros(1, 8, dtype=torch.long), torch.full((1, 8), 8)
    with pytest.raises(RuntimeError, match="one dtype"):
        native.interval_forward(q, q.bfloat16(), q, lo, hi, 1.0)
    with pytest.raises(RuntimeError, match="one dtype"):
        native.interval_forward(q.double(), q.double(), q.double(), lo, hi, 1.0)


@needs_native
def test_half_precision_plain_causal_runs_the_kernel_at_every_length(cpu_without_half_units):
    # the kernel's bf16 forward beat SDPA's causal one up to 32768 (0.75-0.99x, 2026-11-27), its
    # backward took a fifth to an eighth of SDPA's: no length sends these calls to SDPA
    for length in (128, 8192, 32768):
        q = torch.empty(1, 1, length, 8, dtype=torch.bfloat16)
        for dtype in (torch.bfloat16, torch.float16):
            x = q.to(dtype)
            assert auto_runs(_call(x, x, x, causal=True)) == "tiled:native", (length, dtype)
            assert auto_runs(_call(x, x.clone().requires_grad_(), x, causal=True)) == "tiled:native", (length, dtype)
    tiny = torch.empty(1, 1, 64, 8, dtype=torch.bfloat16)
    assert auto_runs(_call(tiny, tiny, tiny, causal=True)) == "torch"  # below NATIVE_MIN_PAIRS


@needs_native
def test_where_the_kernel_multiplies_on_amx_tiles_it_serves_half_precision():
    """A CPU with AMX-BF16: the kernel's bf16 products run on the tiles and beat PyTorch's AMX
    kernels in bf16 and fp16, forward and training (loading.serves_half_precision)."""
    with _policy_of_a_cpu(multiplies_half=True, tiles=True):
        assert native.serves("cpu", torch.bfloat16, False) and native.serves("cpu", torch.float16, False)
        q = torch.randn(1, 2, 512, 32, dtype=torch.bfloat16)
        assert auto_runs(_call(q, q, q, mask=masks.sliding_window(64))) == "tiled:native"
        # no mask, no backward: SDPA's AMX kernel below 1024 x 1024 (policy.NATIVE_UNMASKED_MIN_PAIRS_AMX)
        assert auto_runs(_call(q, q, q)) == "torch"
        assert auto_runs(_call(q, q.clone().requires_grad_(), q)) == "tiled:native"
        wide = torch.randn(1, 2, 1024, 32, dtype=torch.bfloat16)
        assert auto_runs(_call(wide, wide, wide)) == "tiled:native"


def test_where_the_cpu_multiplies_half_precision_pytorchs_kernels_keep_those_calls():
    """AVX512-BF16 CPUs without AMX (unmeasured): PyTorch's bf16 kernels use those units and the
    kernel has no such path, so half-precision calls stay off it (float32 calls do not change)."""
    with _policy_of_a_cpu(multiplies_half=True, tiles=False):
        assert not native.serves("cpu", torch.bfloat16, False) and not native.serves("cpu", torch.float16, False)
        q = torch.randn(1, 2, 512, 32, dtype=torch.bfloat16)
        assert auto_runs(_call(q, q, q, mask=masks.sliding_window(64))) == "tiled:blocks"
        assert native.serves("cpu", torch.float32, False) == native.enabled()
