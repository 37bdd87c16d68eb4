"""The tiled backend against the float64 oracle: structured and dense masks, tiny blocks (so
every call crosses many blocks, partial edges and batched runs), GQA, gradients, lse, weights,
dropout, empty rows; and that it really skips what the mask removes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from attnkit._backends import auto_runs, native, tiled, tiled_plan
from attnkit._call import make_call
from conftest import tiled_kernel
from oracle import oracle_attention, oracle_lse, output_and_gradients
from strategies import cases, mask_cases


@pytest.fixture(autouse=True, scope="module", params=["native", "pytorch"])
def forward_kernel(request):
    """Every test runs with each kernel of the tiled backend, forward and backward: attnkit's own
    (float32, bfloat16, float16, no dense mask; where it is built) and PyTorch's fused one block by block."""
    with tiled_kernel(request.param):
        yield request.param


# tiny problems: one thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


# fp32 against float64 over <= 40 keys and <= 16 features of O(1) randn values: a few ulp
# (1.2e-7) of each O(1) output, plus one rounding per merged partial result; 2e-5 leaves margin.
FP32 = dict(atol=2e-5, rtol=2e-5)
# Gradients sum up to 40 such products per entry (and the tiled ones add per-block parts).
FP32_GRAD = dict(atol=1e-4, rtol=1e-4)


@st.composite
def tiled_cases(draw, max_len=40):
    """Inputs [B, H, L, D] (GQA sometimes; Dv = Dk for the fused kernel or not for the plain-ops
    one), a structured mask, maybe causal=True on top, and a block size that cuts many blocks."""
    batch = draw(st.integers(1, 2))
    heads = draw(st.sampled_from([1, 2, 4]))
    kv_heads = draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]))
    lq, lk = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    dk = draw(st.integers(1, 16))
    dv = dk if draw(st.booleans()) else draw(st.integers(1, 16))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    query = torch.randn(batch, heads, lq, dk, generator=g)
    key = torch.randn(batch, kv_heads, lk, dk, generator=g)
    value = torch.randn(batch, kv_heads, lk, dv, generator=g)
    case = draw(mask_cases(batch=batch, max_len=max_len))
    causal = draw(st.booleans())
    allowed = case.allowed(lq, lk)[:, None]  # [S, 1, Lq, Lk]
    if causal:
        allowed = allowed & masks.causal_mask(lq, lk)
    # merge_span 0 keeps every block's fully attended range apart from its masked edges, so rows
    # merge several partial results; 1024 runs each block's span as one masked range.
    # key_align > 1 widens masked ranges into keys no row of the block attends.
    tuning = dict(block_size=draw(st.integers(1, 9)), merge_span=draw(st.sampled_from([0, 6, 1024])),
                  key_align=draw(st.sampled_from([1, 3, 16])))
    return dict(query=query, key=key, value=value, mask=case.mask, causal=causal, allowed=allowed,
                tuning=tuning, scale=draw(st.one_of(st.none(), st.floats(0.1, 2.0))))


def _oracle(c, dtype=torch.float64):
    return oracle_attention(c["query"], c["key"], c["value"], mask=c["allowed"], scale=c["scale"], dtype=dtype)


def _tiled(c, query=None, key=None, value=None, **kwargs):
    with tiled_plan.tuning(**c["tuning"]):
        return attnkit.attention(query if query is not None else c["query"], key if key is not None else c["key"],
                                 value if value is not None else c["value"], mask=c["mask"], causal=c["causal"],
                                 scale=c["scale"], backend="tiled", **kwargs)


@given(c=tiled_cases())
def test_forward_and_gradients_match_the_oracle(c):
    expected, _ = _oracle(c)
    q, k, v = (c[n].clone().requires_grad_() for n in ("query", "key", "value"))
    output = _tiled(c, q, k, v)
    torch.testing.assert_close(output.double(), expected, **FP32)

    q64, k64, v64 = (c[n].double().requires_grad_() for n in ("query", "key", "value"))
    exact, _ = oracle_attention(q64, k64, v64, mask=c["allowed"], scale=c["scale"])
    upstream = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected_grads = torch.autograd.grad((exact * upstream).sum(), (q64, k64, v64))
    grads = torch.autograd.grad((output * upstream.float()).sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, **FP32_GRAD)


@given(c=tiled_cases())
def test_matches_the_reference_backend_with_the_dense_mask(c):
    """The issue's statement of exactness: tiled == reference fed the dense form of the mask."""
    dense = c["mask"].dense(c["query"].shape[-2], c["key"].shape[-2])
    reference = attnkit.attention(c["query"], c["key"], c["value"], mask=dense, causal=c["causal"],
                                  scale=c["scale"], backend="reference")
    torch.testing.assert_close(_tiled(c), reference, **FP32)


def _max_error(a, b):
    return (a.double() - b.double()).abs().max().item()


@given(c=tiled_cases(max_len=32))
def test_bfloat16_within_twice_the_reference_error(c):
    """FlashAttention's rule: our bf16 error against float64 is at most twice the error of the
    plain bf16 computation (the oracle in bf16) against float64; floor: one bf16 ulp at 1."""
    low = {n: c[n].to(torch.bfloat16) for n in ("query", "key", "value")}
    c = {**c, **low}
    exact, _ = _oracle(c)
    plain, _ = _oracle(c, dtype=torch.bfloat16)
    output = _tiled(c)
    assert output.dtype == torch.bfloat16
    assert _max_error(output, exact) <= 2 * _max_error(plain, exact) + 2**-8


@given(c=tiled_cases())
def test_log_sum_exp_matches_the_oracle(c):
    scale = c["scale"] if c["scale"] is not None else 1 / math.sqrt(c["query"].shape[-1])
    expected = oracle_lse(c["query"], c["key"], c["allowed"], scale)  # -inf exactly where a row has no key
    output, lse = _tiled(c, return_lse=True)
    assert lse.shape == expected.shape and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), torch.isneginf(expected))
    torch.testing.assert_close(lse.double().nan_to_num(neginf=0.0), expected.nan_to_num(neginf=0.0), **FP32)
    torch.testing.assert_close(output, _tiled(c), atol=0, rtol=0)  # asking for lse changes nothing


@given(c=tiled_cases(max_len=24))
def test_weights_match_the_oracle_and_reproduce_the_output(c):
    expected_out, expected_weights = _oracle(c)
    output, weights, lse = _tiled(c, return_weights=True, return_lse=True)
    torch.testing.assert_close(weights.double(), expected_weights, **FP32)
    torch.testing.assert_close(output.double(), expected_out, **FP32)
    value = c["value"].repeat_interleave(c["query"].shape[1] // c["value"].shape[1], dim=1)
    torch.testing.assert_close(output, weights @ value, **FP32)
    _, plain_lse = _tiled(c, return_lse=True)
    torch.testing.assert_close(lse, plain_lse, **FP32)


@given(case=cases(max_len=20, max_dim=8), block=st.integers(1, 7), merge_span=st.sampled_from([0, 1024]))
def test_dense_tensor_masks_and_causal_match_the_oracle(case, block, merge_span):
    """Tiled also runs any call without a structured mask: bool/additive masks (with -inf rows),
    per-head masks, 2-D and 3-D inputs, causal with Lq != Lk."""
    expected, _ = oracle_attention(case.query, case.key, case.value, **case.kwargs())
    with tiled_plan.tuning(block_size=block, merge_span=merge_span):
        output = attnkit.attention(case.query, case.key, case.value, backend="tiled", **case.kwargs())
    torch.testing.assert_close(output.double(), expected, **FP32)


GRADCHECK_CASES = {
    "window, fused kernel": dict(mask=masks.sliding_window(3), dv=4),
    "document & causal, plain kernel": dict(mask=masks.document([3, 4, 4]) & masks.causal(), dv=3),
    "padding per sequence, empty rows": dict(mask=masks.padding(torch.tensor([0, 5])) & masks.causal(), dv=4),
    "prefix-LM, GQA": dict(mask=masks.prefix_lm(4), dv=4, kv_heads=1),
    "dense additive mask": dict(mask=torch.randn(9, 11, dtype=torch.float64).masked_fill(
        torch.eye(9, 11, dtype=torch.bool).logical_not() & (torch.rand(9, 11) < 0.5), float("-inf")), dv=4),
}


def _oracle_output_and_lse(q, k, v, mask):
    """float64 output and lse of the oracle (rows with no key: lse 0, a constant), differentiable."""
    allowed = mask if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool else None
    if isinstance(mask, masks.StructuredMask):
        allowed = mask.dense(q.shape[-2], k.shape[-2], ndim=4)
    bias = mask if isinstance(mask, torch.Tensor) and mask.is_floating_point() else None
    if bias is not None:
        allowed = bias != float("-inf")
    out, _ = oracle_attention(q, k, v, mask=bias if bias is not None else allowed)
    scores = q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    if bias is not None:
        scores = scores + bias.masked_fill(~allowed, 0.0)
    lse = torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), -1)
    return out, lse.masked_fill(torch.isneginf(lse), 0.0)


@pytest.mark.parametrize("name", list(GRADCHECK_CASES))
def test_gradients_of_output_and_log_sum_exp_match_the_oracle(name):
    """float64, tiny blocks, many pieces merged: the gradients of output and lse (through the plain-
    ops kernel) and of the output alone (the fused kernel's backward when Dv == Dk) against the
    float64 oracle's autograd, to rounding; one case also by finite differences (gradcheck)."""
    config = GRADCHECK_CASES[name]
    g = torch.Generator().manual_seed(0)
    heads, kv_heads = 2, config.get("kv_heads", 2)
    q = torch.randn(2, heads, 9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv_heads, 11, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv_heads, 11, config["dv"], generator=g, dtype=torch.float64, requires_grad=True)
    up_out = torch.randn(2, heads, 9, config["dv"], generator=g, dtype=torch.float64)
    up_lse = torch.randn(2, heads, 9, generator=g, dtype=torch.float64)

    def fn(q, k, v):
        with tiled_plan.tuning(block_size=2, merge_span=0):
            out, lse = attnkit.attention(q, k, v, mask=config["mask"], backend="tiled", return_lse=True)
        return out, lse.masked_fill(torch.isneginf(lse), 0.0)  # empty rows: a constant -inf

    out, lse = fn(q, k, v)
    want_out, want_lse = _oracle_output_and_lse(q, k, v, config["mask"])
    for loss, want in (((out * up_out).sum() + (lse * up_lse).sum(), (want_out * up_out).sum() + (want_lse * up_lse).sum()),
                       ((out * up_out).sum(), (want_out * up_out).sum())):
        got = torch.autograd.grad(loss, (q, k, v), retain_graph=True)
        expected = torch.autograd.grad(want, (q, k, v), retain_graph=True)
        for x, y in zip(got, expected):
            torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-8)
    if name == "document & causal, plain kernel":
        assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("dv", [4, 3], ids=["fused kernel", "plain kernel"])
def test_calls_cut_to_the_size_limits_stay_exact(dv):
    """Big groups are cut into several kernel calls (fewer blocks, or fewer rows of one block):
    output and gradients still the float64 oracle's."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 23, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 23, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 23, dv, generator=g, dtype=torch.float64, requires_grad=True)
    for mask in (masks.sliding_window(5), masks.document([11, 12])):
        with tiled_plan.tuning(block_size=2, merge_span=0, call_rows=5, call_scores=40):
            out = attnkit.attention(q, k, v, mask=mask, backend="tiled")
        expected, _ = oracle_attention(q, k, v, mask=mask.dense(23, 23))
        torch.testing.assert_close(out, expected)
        up = torch.randn(out.shape, generator=g, dtype=torch.float64)
        for x, y in zip(torch.autograd.grad((out * up).sum(), (q, k, v)),
                        torch.autograd.grad((expected * up).sum(), (q, k, v))):
            torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dv", [16, 8], ids=["fused kernel", "plain kernel"])
def test_rows_with_no_key_give_zeros_finite_gradients_and_minus_inf_lse(dtype, dv):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 40, 16, generator=g).to(dtype).requires_grad_()
    k = torch.randn(2, 2, 20, 16, generator=g).to(dtype).requires_grad_()
    v = torch.randn(2, 2, 20, dv, generator=g).to(dtype).requires_grad_()
    # causal with Lq > Lk empties the first 20 rows; sequence 0 has no real key at all.
    mask = masks.causal() & masks.padding(torch.tensor([0, 20]))
    with tiled_plan.tuning(block_size=8, merge_span=0):
        out, lse = attnkit.attention(q, k, v, mask=mask, backend="tiled", return_lse=True)
    empty = torch.zeros(2, 1, 40, dtype=torch.bool)
    empty[0] = True
    empty[1, :, :20] = True
    assert (out[empty.expand(2, 2, 40)] == 0).all() and torch.isfinite(out).all()
    assert torch.isneginf(lse[empty.expand(2, 2, 40)]).all() and torch.isfinite(lse[~empty.expand(2, 2, 40)]).all()
    (out.float().square().sum() + lse.masked_fill(torch.isneginf(lse), 0).sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[empty.expand(2, 2, 40)] == 0).all()


def _qkv(seed=0, lq=24, lk=24, dv=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 4, lq, 8, generator=g), torch.randn(2, 2, lk, 8, generator=g),
            torch.randn(2, 2, lk, dv, generator=g))


def test_dropout_is_reproducible_from_the_generator_and_leaves_the_global_rng_alone():
    q, k, v = _qkv()
    mask = masks.sliding_window(5)
    torch.manual_seed(0)
    expected_next = torch.rand(3)
    torch.manual_seed(0)
    with tiled_plan.tuning(block_size=4):
        run = lambda seed: attnkit.attention(q, k, v, mask=mask, dropout=0.4, backend="tiled",  # noqa: E731
                                             generator=torch.Generator().manual_seed(seed))
        a, b, c = run(1), run(1), run(2)
    assert torch.equal(torch.rand(3), expected_next)
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(5)
    with tiled_plan.tuning(block_size=4):
        first = attnkit.attention(q, k, v, mask=mask, dropout=0.4, backend="tiled")
    torch.manual_seed(5)
    with tiled_plan.tuning(block_size=4):
        assert torch.equal(first, attnkit.attention(q, k, v, mask=mask, dropout=0.4, backend="tiled"))


def test_dropout_is_unbiased_and_applied_to_the_returned_weights():
    q, k, v = _qkv(lq=6, lk=9)
    mask = masks.sliding_window(4, causal=False)
    g = torch.Generator().manual_seed(11)
    with tiled_plan.tuning(block_size=2):
        draws = torch.stack([attnkit.attention(q, k, v, mask=mask, dropout=0.3, generator=g, backend="tiled")
                             for _ in range(400)])
        out, weights = attnkit.attention(q, k, v, mask=mask, dropout=0.5, generator=g, return_weights=True,
                                         backend="tiled")
    clean = attnkit.attention(q, k, v, mask=mask, backend="reference")
    # Each output sums <= 7 terms with per-term std <= |v| * sqrt(p/(1-p)); over 400 draws the
    # mean's standard error is below 0.08 here, so 0.4 is a 5-sigma band.
    assert (draws.mean(0) - clean).abs().max() < 0.4
    assert draws.std(0).mean() > 0.05
    torch.testing.assert_close(out, weights @ v.repeat_interleave(2, dim=1), **FP32)
    _, clean_weights = attnkit.attention(q, k, v, mask=mask, return_weights=True, backend="reference")
    kept = weights != 0
    torch.testing.assert_close(weights[kept], clean_weights[kept] / 0.5, **FP32)


def test_dropout_gradients_match_the_reference_with_the_same_pattern():
    """Every backend draws the same dropout pattern from the same generator state, so the tiled
    backend's dropout gradients are the reference backend's (float64, to rounding)."""
    q, k, v = (t.double().requires_grad_() for t in _qkv(lq=7, lk=9))

    def grads(backend):
        with tiled_plan.tuning(block_size=2):
            out = attnkit.attention(q, k, v, mask=masks.sliding_window(3), dropout=0.3, backend=backend,
                                    generator=torch.Generator().manual_seed(7))
        return (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))

    for x, y in zip(grads("tiled"), grads("reference")):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-10)


def test_keys_that_no_query_may_attend_are_never_read():
    """Padding keys full of NaN do not reach the output: tiled never touches them (a dense
    kernel would multiply them by zero weights and return NaN)."""
    q, k, v = _qkv(lq=30, lk=30)
    lengths = torch.tensor([17, 30])
    k, v = k.clone(), v.clone()
    k[0, :, 17:] = float("nan")
    v[0, :, 17:] = float("nan")
    mask = masks.padding(lengths) & masks.sliding_window(6)
    with tiled_plan.tuning(block_size=4):
        out = attnkit.attention(q, k, v, mask=mask, backend="tiled")
    assert torch.isfinite(out).all()
    finite = attnkit.attention(q, k.nan_to_num(3.0), v.nan_to_num(3.0), mask=mask, backend="reference")
    torch.testing.assert_close(out, finite, **FP32)
    assert torch.isnan(oracle_attention(q, k, v, mask=mask.dense(30, 30))[0]).any()  # the trap is real for matmuls
    torch.testing.assert_close(attnkit.attention(q, k, v, mask=mask, backend="reference"), finite, **FP32)


def test_aligned_ranges_never_read_keys_that_no_row_attends():
    """One 30-row block of causal + padding: its masked span [0, 17) would widen to 32 keys, but
    keys 17.. are padding (NaN here) and must stay unread; the result equals the reference."""
    q, k, v = _qkv(lq=30, lk=30)
    k, v = k[:1].clone(), v[:1].clone()
    k[..., 17:, :] = float("nan")
    v[..., 17:, :] = float("nan")
    mask = masks.padding([17]) & masks.causal()
    with tiled_plan.tuning(block_size=32, key_align=16):
        groups = tiled.plan_of(make_call(q[:1], k, v, mask=mask, causal=False, scale=None, dropout=0.0,
                                         generator=None, return_weights=False))
        out = attnkit.attention(q[:1], k, v, mask=mask, backend="tiled")
    assert max(g.key_start + g.length for g in groups) == 17
    assert torch.isfinite(out).all()
    expected = attnkit.attention(q[:1], k.nan_to_num(3.0), v.nan_to_num(3.0), mask=mask, backend="reference")
    torch.testing.assert_close(out, expected, **FP32)


def test_a_sliding_window_runs_even_key_spans():
    """A 512 window with 32-row blocks attends a 543-key span per block; the plan widens it to
    544 into the key before the window (masked for every row), where the fused kernel runs
    5-10% faster per pair, and the result still equals the oracle."""
    call = _call(2048, masks.sliding_window(512))
    interior = max(tiled.plan_of(call), key=lambda g: g.count)
    assert (interior.length, interior.key_start - interior.q0) == (544, -512)
    q, k, v = _qkv(lq=700, lk=700)
    out = attnkit.attention(q, k, v, mask=masks.sliding_window(512), backend="tiled")
    expected, _ = oracle_attention(q, k, v, mask=masks.sliding_window(512).dense(700, 700), dtype=torch.float64)
    torch.testing.assert_close(out, expected.to(out.dtype), **FP32)


def _call(length, mask, heads=8, head_dim=64, dtype=torch.float32, **kwargs):
    q = torch.empty(1, heads, length, head_dim, dtype=dtype)
    options = dict(causal=False, scale=None, dropout=0.0, generator=None, return_weights=False) | kwargs
    return make_call(q, q, q, mask=mask, **options)


def test_the_plan_computes_little_more_than_the_attended_pairs_in_few_calls():
    window = _call(4096, masks.sliding_window(512))
    attended = 512 / 4096  # about: each row attends 512 keys
    assert tiled.visited_fraction(window) < 1.15 * attended  # corners of the window blocks only
    groups = tiled.plan_of(window)
    # The first 512 rows (windows clipped at key 0) differ block by block; the rest is one
    # batched call (or a few, cut to the size limit).
    assert len(groups) <= 512 // tiled_plan.settings().block_size + 8
    assert sum(g.count * g.rows for g in groups if g.count > 1) >= 4096 - 512
    documents = _call(4096, masks.document([1000, 1500, 1596]))
    assert len(tiled.plan_of(documents)) < 12
    assert tiled.visited_fraction(documents) < 1.1 * (1000**2 + 1500**2 + 1596**2) / 4096**2


def _auto(call) -> str:
    """"torch" or "tiled": whether auto's op keeps the mask sparse (native kernel or blocks) or
    runs the fused kernel densely, as "torch" would."""
    runs = auto_runs(call)
    return "torch" if runs in ("torch", "tiled:dense") else "tiled"


def test_auto_runs_long_structured_masks_tiled_and_everything_else_fused(forward_kernel):
    native_runs = forward_kernel == "native"  # the thresholds follow the kernel tiled would run
    assert _auto(_call(4096, masks.sliding_window(256))) == "tiled"
    assert _auto(_call(4096, masks.document([1024] * 4))) == "tiled"
    assert _auto(_call(128, masks.sliding_window(16))) == ("tiled" if native_runs else "torch")
    assert _auto(_call(64, masks.sliding_window(8))) == "torch"  # too short to profit
    # Masks keeping most pairs, or all: the native kernel wins whatever it keeps (SDPA over the
    # mask as a tensor is slower than SDPA unmasked, which the kernel beats); PyTorch's kernel
    # per block only below 60%
    assert _auto(_call(4096, masks.padding([4096]))) == ("tiled" if native_runs else "torch")  # nothing to skip
    assert _auto(_call(1024, masks.prefix_lm(512))) == ("tiled" if native_runs else "torch")
    assert _auto(_call(4096, masks.padding([3600]))) == ("tiled" if native_runs else "torch")
    assert _auto(_call(4096, masks.padding([4000]))) == ("tiled" if native_runs else "torch")  # 98% of the pairs
    assert _auto(_call(4096, masks.causal() & masks.padding([3000]))) == "tiled"
    # Plain causal, masks.causal() or causal=True alike: the native kernel beat SDPA's causal path,
    # forward and backward, at every length from 128 (AVX2 and AVX-512 builds); below, and without
    # the native kernel, SDPA's causal path (PyTorch's kernel block by block is no faster)
    for length, native_wins in ((128, True), (2048, True), (4096, True), (16384, True), (64, False)):
        expected = "tiled:native" if native_runs and native_wins else "torch"
        trained = _call(length, masks.causal())
        trained.query.requires_grad_()
        assert auto_runs(trained) == expected, length
        for mask, causal in ((masks.causal(), False), (None, True)):
            forward_alone = "tiled:native" if native_runs and length >= 128 else "torch"
            assert auto_runs(_call(length, mask, causal=causal)) == forward_alone, length
            with torch.no_grad():
                assert auto_runs(trained) == forward_alone, length
    assert auto_runs(_call(2048, masks.causal(), causal=True)) == ("tiled:native" if native_runs else "torch")
    # a chunk of rows after a cache (bottom-right): the op on the rows' spans, either spelling
    chunk = [torch.empty(1, 8, 2048, 64), torch.empty(1, 8, 4096, 64), torch.empty(1, 8, 4096, 64)]
    for mask, causal in ((masks.causal(), False), (None, True)):
        call = make_call(*chunk, mask=mask, causal=causal, scale=None, dropout=0.0, generator=None,
                         return_weights=False)
        assert auto_runs(call) == ("tiled:native" if native_runs else "tiled:dense")  # 75% of the pairs
    # one decoding step (GQA): bottom-right causal is every key, SDPA without planning, same numbers
    step = [torch.randn(1, 8, 1, 64), torch.randn(1, 2, 300, 64), torch.randn(1, 2, 300, 64)]
    call = make_call(*step, mask=masks.causal(), causal=False, scale=None, dropout=0.0, generator=None,
                     return_weights=False)
    assert auto_runs(call) == "torch"
    torch.testing.assert_close(attnkit.attention(*step, mask=masks.causal()),
                               attnkit.attention(*step, mask=masks.causal(), backend="reference"))
    # no mask: the native kernel over every key from 1024 x 1024 pairs (512 x 512 with a backward)
    # and up to 128 features a head (it beat SDPA's unmasked path there); shorter, wider or one
    # query row: SDPA's
    assert auto_runs(_call(4096, None)) == ("tiled:native" if native_runs else "torch")
    assert auto_runs(_call(1024, None)) == ("tiled:native" if native_runs else "torch")
    assert auto_runs(_call(512, None)) == "torch"
    trained = _call(512, None)
    trained.query.requires_grad_()
    assert auto_runs(trained) == ("tiled:native" if native_runs else "torch")
    trained = _call(256, None)
    trained.query.requires_grad_()
    assert auto_runs(trained) == "torch"
    # half precision (where the kernel serves it): from 128 x 128, bf16 forward-only from 512 x 512
    # (on a CPU with AMX the bf16 forward from 1024 x 1024: policy.NATIVE_UNMASKED_MIN_PAIRS_AMX)
    for dtype, length, forward_alone in ((torch.bfloat16, 256, False), (torch.bfloat16, 512, True),
                                        (torch.float16, 128, True)):
        served = native_runs and native.serves("cpu", dtype, False)
        tiles_wait = dtype == torch.bfloat16 and native.matrix_units_available()
        expected = "tiled:native" if served and forward_alone and not tiles_wait else "torch"
        assert auto_runs(_call(length, None, dtype=dtype)) == expected, (dtype, length)
        trained = _call(128, None, dtype=dtype)
        trained.query.requires_grad_()
        assert auto_runs(trained) == ("tiled:native" if served else "torch"), dtype
    assert auto_runs(_call(1024, None, heads=2, head_dim=256)) == "torch"
    step = [torch.empty(1, 8, 1, 64), torch.empty(1, 8, 4096, 64), torch.empty(1, 8, 4096, 64)]
    assert auto_runs(make_call(*step, mask=None, causal=False, scale=None, dropout=0.0, generator=None,
                               return_weights=False)) == "torch"
    assert auto_runs(_call(4096, None, return_weights=True)) == "torch"
    assert auto_runs(_call(16, None, return_lse=True)) == ("tiled:native" if native_runs else "tiled:blocks")


def test_auto_runs_dropout_on_the_native_kernel_whatever_the_mask(forward_kernel):
    """SDPA has no fused CPU kernel with dropout: where the native kernel runs, auto sends every
    dropout call to it (no mask, causal, any length), except calls returning the weights."""
    def call(length, mask, **kwargs):
        q = torch.empty(1, 8, length, 64)
        options = dict(causal=False, scale=None, dropout=0.1, generator=None, return_weights=False) | kwargs
        return make_call(q, q, q, mask=mask, **options)

    expected = "tiled:native" if forward_kernel == "native" else "torch"
    assert auto_runs(call(32, None)) == expected
    assert auto_runs(call(8192, masks.causal())) == (expected if forward_kernel == "native" else "tiled:blocks")
    assert auto_runs(call(256, None, causal=True)) == expected
    assert auto_runs(call(256, None, return_weights=True)) == "torch"
    assert auto_runs(call(256, masks.causal().dense(256, 256))) == "torch"  # a dense tensor mask
    assert auto_runs(call(256, None, dropout=0.0)) == "torch"


def test_training_saves_only_linear_memory():
    """The forward keeps query, key, value, output and lse for the backward: nothing L x L."""
    length = 2048
    q = torch.randn(1, 2, length, 16, requires_grad=True)
    out = attnkit.attention(q, q, q, mask=masks.sliding_window(64), backend="tiled")
    node = out.grad_fn
    # past the reshape back to the caller's layout, to the op's node (its autograd.Function where
    # torch.func or torch.compile may see the call, the op's own registered autograd in plain eager)
    while not any(name in type(node).__name__ for name in ("IntervalAttention", "interval_attention")):
        node = node.next_functions[0][0]
    saved = sum(t.numel() for t in node.saved_tensors if t is not None)
    assert saved <= 5 * q.numel()
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_other_backends_cannot_return_the_log_sum_exp():
    q = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match=r"backend 'torch' cannot return the log-sum-exp.*\['tiled'\]"):
        attnkit.attention(q, q, q, backend="torch", return_lse=True)
    with pytest.raises(TypeError, match=r"return_lse must be a bool, got int"):
        attnkit.attention(q, q, q, return_lse=1)
    out, lse = attnkit.attention(q, q[:, :0], q[:, :0], return_lse=True)  # no keys at all
    assert (out == 0).all() and torch.isneginf(lse).all() and lse.shape == (2, 3)


def test_plans_are_reused_for_equal_masks_and_redone_when_a_lengths_tensor_changes():
    """The plan cache compares the rows' bounds by value: a mask rebuilt alike reuses the plan,
    a padding-lengths tensor edited in place (the same mask object) gets a fresh, right one."""
    lengths = torch.tensor([40, 25])
    q, k, v = (torch.randn(2, 2, 40, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = masks.padding(lengths) & masks.sliding_window(9)
    def cached(mask):
        call = make_call(q, k, v, mask=mask, causal=False, scale=None, dropout=0.0, generator=None,
                         return_weights=False)
        return tiled_plan.plans.plan(tiled_plan.Problem(*tiled_plan.row_bounds(call), 40, 40, 2, False))

    with tiled_plan.tuning(block_size=4):
        first = cached(mask)
        assert cached(masks.padding(torch.tensor([40, 25])) & masks.sliding_window(9)) is first
        attnkit.attention(q, k, v, mask=mask, backend="tiled")
        lengths[1] = 7  # in place: the same mask object now means something else
        output = attnkit.attention(q, k, v, mask=mask, backend="tiled")
    expected, _ = oracle_attention(q, k, v, mask=mask.dense(40, 40))
    torch.testing.assert_close(output.double(), expected, **FP32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients_within_twice_the_plain_error(dtype):
    """Both kernels in half precision. Block by block (the native kernel off, as on CPUs whose
    half-precision calls stay off it), a window's batched block runs add their key and value
    gradients into float32 sums (index_add_ once refused the bf16 pieces)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 600, 16, generator=g)
    k, v = (torch.randn(1, 2, 600, 16, generator=g) for _ in range(2))
    up = torch.randn(1, 4, 600, 16, generator=g)
    mask = masks.sliding_window(64)
    allowed = mask.dense(600, 600)

    def run(fn, dt):
        return output_and_gradients(fn, (q, k, v), up, dt)

    exact = run(lambda a, b, c: oracle_attention(a, b, c, mask=allowed)[0], torch.float64)
    plain = run(lambda a, b, c: oracle_attention(a, b, c, mask=allowed, dtype=dtype)[0], dtype)
    ours = run(lambda a, b, c: attnkit.attention(a, b, c, mask=mask), dtype)
    for got, low, want in zip(ours, plain, exact):
        assert got.dtype == dtype
        assert _max_error(got, want) <= 2 * _max_error(low, want) + torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_runs_unmasked_calls_on_the_native_kernel_exactly(dtype):
    """What auto now runs for long unmasked calls (the native kernel over every key where it serves
    the dtype, else SDPA): GQA, Lq != Lk, forward from 1024 x 1024 pairs and training from 512 x 512,
    against the float64 oracle (float32 within FP32, half precision within twice the plain error)."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 4, 1024, 16, generator=g)
    k, v = (torch.randn(1, 2, 1100, 16, generator=g) for _ in range(2))
    call = make_call(q.to(dtype), k.to(dtype), v.to(dtype), mask=None, causal=False, scale=None, dropout=0.0,
                     generator=None, return_weights=False)
    assert auto_runs(call) == ("tiled:native" if native.serves("cpu", dtype, False) else "torch")
    expected, _ = oracle_attention(q, k, v)
    got = attnkit.attention(q.to(dtype), k.to(dtype), v.to(dtype))
    plain, _ = oracle_attention(q.to(dtype), k.to(dtype), v.to(dtype), dtype=dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), expected, **FP32)
    else:
        assert _max_error(got, expected) <= 2 * _max_error(plain, expected) + torch.finfo(dtype).eps
    # training: 600 x 640 pairs, above the training threshold only
    q, k, v, up = q[:, :, :600], k[:, :, :640], v[:, :, :640], torch.randn(1, 4, 600, 16, generator=g)
    leaf = torch.empty_like(q, dtype=dtype, requires_grad=True)
    trained = make_call(leaf, k.to(dtype), v.to(dtype), mask=None, causal=False, scale=None, dropout=0.0,
                        generator=None, return_weights=False)
    assert auto_runs(trained) == ("tiled:native" if native.serves("cpu", dtype, False) else "torch")

    def run(fn, dt):  # fresh leaves for each run (.to of a float32 tensor to float32 is the tensor)
        return output_and_gradients(fn, tuple(t.clone() for t in (q, k, v)), up, dt)

    exact = run(lambda a, b, c: oracle_attention(a, b, c)[0], torch.float64)
    low = run(lambda a, b, c: oracle_attention(a, b, c, dtype=dtype)[0], dtype)
    ours = run(lambda a, b, c: attnkit.attention(a, b, c), dtype)
    for mine, theirs, want in zip(ours, low, exact):
        assert mine.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(mine.double(), want, **FP32)
        else:
            assert _max_error(mine, want) <= 2 * _max_error(theirs, want) + torch.finfo(dtype).eps


@pytest.mark.parametrize("kernel", ["native", "triton", "flex", "blocks", "dense"])
def test_a_forced_kernel_applies_a_dense_mask_or_refuses_it(kernel):
    """The kernels that read only the intervals cannot apply a boolean tensor mask: forced by
    ``tuning(kernel=...)``, they used to run as if it were absent (a random 70 x 70 mask: error 2.0
    on "native" and 0.27 on "triton"); now the call is refused before anything is built, naming the
    kernel and the mask's shape. The block kernels apply it."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 70, 8, generator=g) for _ in range(3))
    mask = torch.rand(70, 70, generator=g) < 0.5
    with tiled_plan.tuning(kernel=kernel):
        if kernel in ("native", "triton", "flex"):
            with pytest.raises(ValueError, match=rf"'{kernel}' kernel .* dense tensor mask of shape \(70, 70\)"):
                attnkit.attention(q, k, v, mask=mask, backend="tiled")
            return
        got = attnkit.attention(q, k, v, mask=mask, backend="tiled")
    want, _ = oracle_attention(q, k, v, mask=mask, scale=8 ** -0.5)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
