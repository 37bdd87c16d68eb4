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
from attnkit._backends.tiled_plan import tuning
from attnkit._call import make_call
from oracle import oracle_attention, output_and_gradients
from test_native import interval_cases

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.why_unavailable()}")

HALF = [torch.bfloat16, torch.float16]


@contextlib.contextmanager
def _policy_of_a_cpu(*, multiplies: tuple[torch.dtype, ...], tiles: bool):
    """"auto"'s half-precision rules as on a CPU that does (or does not) multiply half precision in
    hardware and give the kernel AMX tiles, on any CPU: the CPU probe and the tiles' state read when
    the kernel loaded (which the policy and ``serves_half_precision`` both read) are patched, and
    the cached rule is recomputed inside and after."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_torch_private, "cpu_multiplies_half_precision", lambda dtype: dtype in multiplies)
        patch.setattr(loading._library, "matrix_units", tiles)
        loading.serves_half_precision.cache_clear()
        try:
            yield
        finally:
            loading.serves_half_precision.cache_clear()


def _skip_unless_units_run(units: str, dtype: torch.dtype) -> None:
    """Skips where ``units`` (``native.half_products``) would not multiply this call: the tiles take
    bfloat16 and float16 (as two bfloat16 parts), the dot products bfloat16, each on CPUs that have
    them."""
    takes = (torch.bfloat16, torch.float16) if units == "tiles" else (torch.bfloat16,)
    if units != "convert" and (dtype not in takes or not native.half_products_available(units)):
        pytest.skip(f"the {units} take {', '.join(map(str, takes))} on CPUs that have them")


@pytest.fixture
def cpu_without_half_units():
    """The policy of a CPU with no half-precision matrix units (AVX2, Zen 3), on any CPU: on one
    with AVX512-BF16 and no AMX, "auto" keeps PyTorch's kernels for half precision (see the last
    test), and these tests are about the kernel's route."""
    with _policy_of_a_cpu(multiplies=(), tiles=False):
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
    with native.half_products("convert"):  # the float32-convert path (the half-precision units: test_native_bf16_products.py)
        out, lse = native.interval_forward(q, k, v, c["lo"], c["hi"], c["scale"], **options)
    out32, lse32 = native.interval_forward(q.float(), k.float(), v.float(), c["lo"], c["hi"], c["scale"], **options)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == out32.shape
    _same(out, out32.to(dtype))
    _same(lse, lse32)

    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    with native.half_products("convert"):
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

    # With the residual: the same output, and out + residual is the float32 output to ~16 more bits
    with native.half_products("convert"):
        same_out, _, low = native.interval_forward(q, k, v, c["lo"], c["hi"], c["scale"], residual=True, **options)
    _same(same_out, out)
    finite = torch.isfinite(out32)
    exact = out.float() + low.float()
    assert ((exact - out32).abs() <= out32.abs() * 2 ** -15 + 1e-7)[finite].all()
    assert (low[~finite] == 0).all()  # out + residual is the output itself where it is not finite
    # and the backward that reads it is the float32 kernel's given the same pair, rounded once
    with native.half_products("convert"):
        grads = native.interval_backward(grad_out, q, k, v, out, lse, c["lo"], c["hi"], c["scale"], block=c["block"],
                                         chunk=c["chunk"], parts=parts, dropout=dropout, seed=7, softcap=softcap,
                                         alibi_slopes=slopes, out_low=low)
    grads32 = native.interval_backward(grad_out.float(), q.float(), k.float(), v.float(), out.float(), lse,
                                       c["lo"], c["hi"], c["scale"], block=c["block"], chunk=c["chunk"], parts=parts,
                                       dropout=dropout, seed=7, softcap=softcap, alibi_slopes=slopes,
                                       out_low=low.float())
    for got, want in zip(grads, grads32):
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


def _call(q, k, v, mask=None, causal=False, dropout=0.0):
    return make_call(q, k, v, mask=mask, causal=causal, scale=None, dropout=dropout, generator=None,
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
    # values of the dtype, so that float64 computes the exact answer to what each contender is given
    # (FlashAttention's tests hold the low-precision inputs and output gradient to the reference so)
    q, k, v, grad_out = (t.to(dtype).float() for t in (q, k, v, grad_out))
    allowed = mask.dense(length, length, ndim=4)
    allowed = allowed if allowed.dim() == 4 else allowed[None, None]
    assert allowed.any(-1).all(), "every row attends a key (SDPA gives NaN for rows with none)"

    assert auto_runs(_call(q.to(dtype), k.to(dtype), v.to(dtype), mask=mask)) == "tiled:native"
    _beside_reference(lambda a, b, c: attnkit.attention(a, b, c, mask=mask),
                      lambda a, b, c: oracle_attention(a, b, c, mask=allowed)[0],
                      lambda a, b, c: F.scaled_dot_product_attention(
                          a, b.repeat_interleave(2, 1), c.repeat_interleave(2, 1), attn_mask=allowed),
                      (q, k, v), grad_out, dtype)


def _beside_reference(ours, reference, bar, inputs, grad_out, dtype):
    """Output and gradients of ``ours`` in ``dtype`` within twice the error of ``bar`` (PyTorch in
    that dtype) against ``reference`` in float64."""
    want = output_and_gradients(reference, inputs, grad_out, torch.float64)
    theirs = output_and_gradients(bar, inputs, grad_out, dtype)
    got = output_and_gradients(ours, inputs, grad_out, dtype)
    for what, mine, pytorch, exact in zip(("output", "dq", "dk", "dv"), got, theirs, want):
        assert mine.dtype == dtype, (what, mine.dtype)
        assert _max_error(mine, exact) <= 2 * _max_error(pytorch, exact), (what, _max_error(mine, exact),
                                                                          _max_error(pytorch, exact))


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
    with native.half_products("convert"):  # the float32-convert path (the half-precision units: test_native_bf16_products.py)
        out, lse = native.interval_forward(q, k, k, lo, hi, 0.2)
    assert out.dtype == dtype and out.transpose(1, 2).is_contiguous()
    _same(out, native.interval_forward(q.float(), k.float(), k.float(), lo, hi, 0.2)[0].to(dtype))
    grad_out = torch.ones_like(out)
    with native.half_products("convert"):
        grads = native.interval_backward(grad_out, q, k, k, out, lse, lo, hi, 0.2)
    grads32 = native.interval_backward(grad_out.float(), q.float(), k.float(), k.float(), out.float(), lse, lo, hi, 0.2)
    assert all(grad.transpose(1, 2).is_contiguous() for grad in grads)
    for got, want in zip(grads, grads32):
        assert got.dtype == dtype
        _same(got, want.to(dtype))


@needs_native
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("units", ["convert", "tiles", "dots"])
@pytest.mark.parametrize("mask", [masks.document([107, 19, 133, 1, 40]) & masks.causal(), masks.causal(),
                                  (masks.sliding_window(9) | masks.padding([15])) & masks.causal()],
                         ids=["documents", "causal", "two ranges"])
def test_peaked_rows_read_the_output_as_computed(dtype, units, mask):
    """Scores of scale 1 at D = 64 make many rows' weights peak on one key. FlashAttention's row term
    rowsum(dO * O), taken from the output rounded to the dtype, then dominates dQ and dK: 2.9x the
    error of PyTorch's own call in bf16 (D != Dv: its math path, which sums P * dP). The forward
    keeps what the rounding took off (the op's residual), and the row term reads the output as
    computed: within twice PyTorch's error on the float32-convert path, and on the AMX tiles and the
    dot products, whose forward takes P in two bf16 parts for P V here (D != Dv: PyTorch's bar is its
    float32 math path)."""
    _skip_unless_units_run(units, dtype)
    if units != "convert" and mask.row_ranges(300, 300)[0].shape[1] > 1:
        pytest.skip("rows of two ranges run in float32, one range at a time")
    g = torch.Generator().manual_seed(114)
    q = torch.randn(2, 1, 300, 64, generator=g)
    k = torch.randn(2, 1, 300, 64, generator=g)
    v = torch.randn(2, 1, 300, 32, generator=g)
    grad_out = torch.randn(2, 1, 300, 32, generator=g)
    q, k, v, grad_out = (t.to(dtype).float() for t in (q, k, v, grad_out))
    dense = mask.dense(300, 300, ndim=4)

    def ours(a, b, c):
        with tuning(kernel="native"), native.half_products(units):  # the backward too
            return attnkit.attention(a, b, c, mask=mask, backend="tiled", scale=1.0)

    _beside_reference(ours, lambda a, b, c: attnkit.attention(a, b, c, mask=mask, backend="reference", scale=1.0),
                      lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=dense, scale=1.0),
                      (q, k, v), grad_out, dtype)


@needs_native
@pytest.mark.parametrize("dtype", HALF)
def test_sinks_fold_into_the_output_before_its_rounding(dtype):
    """Sinks rescale the rows after the kernel; rescaling an output already rounded to the dtype
    rounds it twice (2.1-2.4x the error of the same call in plain ops). The op folds them into the
    output as computed (with its residual) and rounds once. The bar: the reference backend in the
    dtype (PyTorch has no kernel with sinks), against it in float64."""
    g = torch.Generator().manual_seed(19)
    q, k, v, grad_out = (torch.randn(1, 2, 400, 32, generator=g).to(dtype).float() for _ in range(4))
    sinks = torch.randn(2, generator=g)

    def ours(a, b, c):
        with tuning(kernel="native"), native.half_products("convert"):
            return attnkit.attention(a, b, c, causal=True, backend="tiled", scale=0.3, sinks=sinks)

    def reference(a, b, c):
        return attnkit.attention(a, b, c, causal=True, backend="reference", scale=0.3, sinks=sinks)

    _beside_reference(ours, reference, reference, (q, k, v), grad_out, dtype)


@needs_native
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("mask", [masks.causal(), (masks.sliding_window(9) | masks.padding([15])) & masks.causal()],
                         ids=["one range", "two ranges"])
def test_the_output_is_the_same_with_or_without_a_backward_to_follow(dtype, mask):
    """The residual is kept only where an input requires a gradient; the output's bits must not
    depend on it (sinks fold into the output as computed either way)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 200, 64, generator=g).to(dtype) for _ in range(3))
    sinks = torch.tensor([0.3, -1.0])
    with tuning(kernel="native"):
        for extra in ({}, {"sinks": sinks}):
            plain = attnkit.attention(q, k, v, mask=mask, backend="tiled", **extra)
            trained = attnkit.attention(q, k, v.requires_grad_(), mask=mask, backend="tiled", **extra)
            v.requires_grad_(False)
            assert torch.equal(plain, trained.detach()), extra


@needs_native
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("units", ["convert", "tiles", "dots"])
def test_a_row_on_one_key_under_dropout_has_no_query_gradient(dtype, units):
    """A row that attends one key has weight 1 there whatever its score, so its dq and the key's dk
    are exactly 0; under dropout its output is ``v / (1 - p)`` or 0, which the dtype rounds. A row
    term from that rounded output left dq off by 0.06 and dk by 0.18 in bf16 (p = 0.1); from the
    output as computed, only float32's rounding is left on the float32-convert path. On the AMX
    tiles the forward's bf16 weights carry the keep mask alone and 1 / (1 - p) multiplies each row
    in float32: inside the weights it made the output read v x bf16(1 / (1 - p)) while the
    backward's dP took the exact factor, and 0.015 was left. The dot products share the tiles'
    forward."""
    _skip_unless_units_run(units, dtype)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 128, 64, generator=g).to(dtype)
    k, v, grad_out = (torch.randn(1, 2, 128, 64, generator=g).to(dtype) for _ in range(3))
    mask = masks.sliding_window(1)  # each row attends its own key alone
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with tuning(kernel="native"), native.half_products(units):  # the backward too
        out = attnkit.attention(*leaves, mask=mask, backend="tiled", dropout=0.1,
                                generator=torch.Generator().manual_seed(1))
        out.backward(grad_out)
    assert (out == 0).any() and (out != 0).any(), "some weights dropped, some kept"
    assert leaves[0].grad.abs().max().item() <= 1e-3
    assert leaves[1].grad.abs().max().item() <= 1e-3


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
    with _policy_of_a_cpu(multiplies=(torch.bfloat16, torch.float16), tiles=True):
        assert native.serves("cpu", torch.bfloat16, False) and native.serves("cpu", torch.float16, False)
        q = torch.randn(1, 2, 512, 32, dtype=torch.bfloat16)
        assert auto_runs(_call(q, q, q, mask=masks.sliding_window(64))) == "tiled:native"
        # no mask, no backward: SDPA's AMX kernel below 1024 x 1024 (policy.NATIVE_UNMASKED_MIN_PAIRS_AMX)
        assert auto_runs(_call(q, q, q)) == "torch"
        assert auto_runs(_call(q, q.clone().requires_grad_(), q)) == "tiled:native"
        wide = torch.randn(1, 2, 1024, 32, dtype=torch.bfloat16)
        assert auto_runs(_call(wide, wide, wide)) == "tiled:native"


def test_where_the_cpu_multiplies_half_precision_pytorchs_kernels_keep_forward_only_calls():
    """AVX512-BF16 CPUs without AMX (played on a Xeon with oneDNN held to AVX512_CORE_BF16):
    PyTorch's bf16 kernels use those units and were faster forward, the kernel in training, so
    bfloat16 calls with no backward stay off the kernel and calls with one run on it (the route
    names it: the op sees no requires_grad). Float16 and float32 calls run the kernel."""
    with _policy_of_a_cpu(multiplies=(torch.bfloat16,), tiles=False):
        assert not native.serves("cpu", torch.bfloat16, False)
        assert native.serves("cpu", torch.bfloat16, False, True) == native.enabled()
        # no float16 units there: PyTorch's float16 converts too, and the kernel beat it forward
        assert native.serves("cpu", torch.float16, False) == native.enabled()
        q = torch.randn(1, 2, 512, 32, dtype=torch.bfloat16)
        trained = q.clone().requires_grad_()
        window = masks.sliding_window(64)
        assert auto_runs(_call(q, q, q, mask=window)) == "tiled:blocks"
        assert auto_runs(_call(q, q, q, causal=True)) == "torch"
        if native.enabled():
            assert auto_runs(_call(trained, q, q, mask=window)) == "tiled:native"
            assert auto_runs(_call(trained, q, q, causal=True)) == "tiled:native"
            assert auto_runs(_call(trained, q, q, mask=window, dropout=0.1)) == "tiled:native"
            with torch.no_grad():
                assert auto_runs(_call(trained, q, q, mask=window)) == "tiled:blocks"
            # and the call runs it, backward included, to the float32 kernel's results rounded once
            leaves = [t.clone().requires_grad_() for t in (q, q, q)]
            out = attnkit.attention(*leaves, mask=window)
            out.sum().backward()
            wide = [t.detach().double().requires_grad_() for t in (q, q, q)]
            want = attnkit.attention(*wide, mask=window, backend="reference")
            want.sum().backward()
            torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)
            for got, exact in zip(leaves, wide):
                torch.testing.assert_close(got.grad.double(), exact.grad, rtol=2e-2, atol=2e-2)
        assert native.serves("cpu", torch.float32, False) == native.enabled()