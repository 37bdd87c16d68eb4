"""attnkit's own CPU kernel (``attnkit._backends.native``) against the float64 oracle: random key
intervals per row (empty rows, rows past the keys), tiny blocks and chunks (so rows cross many
chunks of the running softmax), GQA, Dv != D, strided inputs, scores spanning the whole float
exponent range; and that the tiled backend runs it exactly where it applies.

``make test`` builds the kernel first; where it cannot be built (no compiler, not x86-64 with
AVX2) these tests skip and the tiled backend uses PyTorch's kernel, which test_tiled covers."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from attnkit._backends import native
from oracle import oracle_attention, oracle_lse

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernel: {native.why_unavailable()}")

# fp32 against float64: the kernel sums at most 40 O(1) products per row in float32, its exp is
# within 2 ulp of the true value, and a row's result is rescaled once per chunk: a few 1e-7 of
# each O(1) output; 2e-5 leaves margin (the tiled tests use the same bound).
FP32 = dict(atol=2e-5, rtol=2e-5)


@st.composite
def interval_cases(draw, max_len=40):
    batch = draw(st.integers(1, 2))
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    lq, lk = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    dk, dv = draw(st.integers(1, 16)), draw(st.integers(1, 16))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    # query [B, Lq, H, D] transposed to [B, H, Lq, D]: the kernel reads any row strides
    query = torch.randn(batch, lq, heads, dk, generator=g).transpose(1, 2) if draw(st.booleans()) else \
        torch.randn(batch, heads, lq, dk, generator=g)
    key = torch.randn(batch, kv_heads, lk, dk, generator=g)
    value = torch.randn(batch, kv_heads, lk, dv, generator=g)
    rows = draw(st.sampled_from([1, batch]))
    lo = torch.randint(-3, lk + 2, (rows, lq), generator=g)
    width = torch.randint(0, lk + 3, (rows, lq), generator=g)
    hi = lo + width  # may be empty, start before key 0 or end past the last key
    return dict(query=query, key=key, value=value, lo=lo, hi=hi,
                scale=draw(st.floats(0.05, 3.0)), block=draw(st.integers(1, 9)), chunk=draw(st.integers(1, 17)))


def _allowed(lo, hi, lk):
    keys = torch.arange(lk)
    return ((keys >= lo[..., None]) & (keys < hi[..., None]))[:, None]  # [S, 1, Lq, Lk]


@needs_native
@given(c=interval_cases())
def test_output_and_lse_match_the_oracle(c):
    out, lse = native.interval_forward(c["query"], c["key"], c["value"], c["lo"], c["hi"], c["scale"],
                                       block=c["block"], chunk=c["chunk"])
    allowed = _allowed(c["lo"], c["hi"], c["key"].shape[2])
    expected, _ = oracle_attention(c["query"], c["key"], c["value"], mask=allowed, scale=c["scale"])
    assert out.shape == expected.shape and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, expected.float(), **FP32)
    expected_lse = oracle_lse(c["query"], c["key"], allowed, c["scale"])
    assert torch.equal(torch.isneginf(lse), torch.isneginf(expected_lse))  # rows with no key: -inf
    torch.testing.assert_close(lse.double().nan_to_num(neginf=0.0), expected_lse.nan_to_num(neginf=0.0), **FP32)


def _oracle_gradients(c, grad_out, grad_lse):
    """float64 gradients of ``sum(out * grad_out) + sum(lse * grad_lse)`` (rows with no key have
    a constant lse: no gradient) through the oracle."""
    q, k, v = (c[name].double().requires_grad_() for name in ("query", "key", "value"))
    allowed = _allowed(c["lo"], c["hi"], k.shape[2])
    out, _ = oracle_attention(q, k, v, mask=allowed, scale=c["scale"])
    loss = (out * grad_out.double()).sum()
    if grad_lse is not None:
        lse = oracle_lse(q, k, allowed, c["scale"])
        loss = loss + (lse.masked_fill(torch.isneginf(lse), 0.0) * grad_lse.double()).sum()
    return torch.autograd.grad(loss, (q, k, v))


@needs_native
@given(c=interval_cases(), parts=st.integers(1, 4), with_lse=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_gradients_match_the_oracle(c, parts, with_lse, seed):
    """The backward from the forward's own output and lse, any block, chunk and number of row parts
    (which add into separate key-gradient copies), with and without a gradient on the lse."""
    g = torch.Generator().manual_seed(seed)
    out, lse = native.interval_forward(c["query"], c["key"], c["value"], c["lo"], c["hi"], c["scale"])
    grad_out = torch.randn(out.shape, generator=g)
    grad_lse = torch.randn(lse.shape, generator=g) if with_lse else None
    grads = native.interval_backward(grad_out, c["query"], c["key"], c["value"], out, lse, c["lo"], c["hi"],
                                     c["scale"], grad_lse, block=c["block"], chunk=c["chunk"], parts=parts)
    expected = _oracle_gradients(c, grad_out, grad_lse)
    for name, grad, want, like in zip("qkv", grads, expected, (c["query"], c["key"], c["value"])):
        assert grad.shape == like.shape and grad.dtype == torch.float32, name
        # Relative to the largest gradient: scores reach |s| ~ 50 here (scale 3, 16 features), whose
        # fp32 rounding (ulp 4e-6) enters every weight exp(s - lse) recomputed from the lse. Over
        # 2000 cases the error was <= 1.5e-5 of the largest gradient; PyTorch's own fused fp32
        # kernel, the same way recomputing, erred by <= 5.6e-6 and plain fp32 autograd by <= 6e-6 on
        # such cases. 5e-5 is 3x our worst; a wrong key or row gives errors of order 1.
        size = max(1.0, want.abs().max().item()) if want.numel() else 1.0
        torch.testing.assert_close(grad.double(), want, atol=5e-5 * size, rtol=0, msg=f"d{name}")


def _kept(c, p, seed):
    """The kernel's dropout pattern, read through its output: with the identity as values a row's
    output is its weights, dropped ones exactly 0 (kept ones are > 0 unless exp underflows, which
    only happens to weights too small to matter). ``[B, H, Lq, Lk]``."""
    batch, kv_heads, lk = c["key"].shape[0], c["key"].shape[1], c["key"].shape[2]
    identity = torch.eye(lk).expand(batch, kv_heads, lk, lk)
    weights, _ = native.interval_forward(c["query"], c["key"], identity, c["lo"], c["hi"], c["scale"],
                                         dropout=p, seed=seed)
    return weights != 0


@needs_native
@given(c=interval_cases(), p=st.sampled_from([0.1, 0.5, 0.9]), seed=st.integers(-2**62, 2**62),
       with_lse=st.booleans())
def test_dropout_forward_and_gradients_match_the_oracle_with_the_same_pattern(c, p, seed, with_lse):
    """Same pattern for any values, blocks and chunks (it depends on the seed and the position
    only); output and gradients are the oracle's with that pattern: kept weights / (1 - p) times the
    values; the lse is the one before dropout."""
    kept = _kept(c, p, seed)
    out, lse = native.interval_forward(c["query"], c["key"], c["value"], c["lo"], c["hi"], c["scale"],
                                       block=c["block"], chunk=c["chunk"], dropout=p, seed=seed)
    g = torch.Generator().manual_seed(abs(seed) % 2**31)
    grad_out = torch.randn(out.shape, generator=g)
    grad_lse = torch.randn(lse.shape, generator=g) if with_lse else None
    grads = native.interval_backward(grad_out, c["query"], c["key"], c["value"], out, lse, c["lo"], c["hi"],
                                     c["scale"], grad_lse, block=c["block"], chunk=c["chunk"], dropout=p, seed=seed)

    q, k, v = (c[name].double().requires_grad_() for name in ("query", "key", "value"))
    allowed = _allowed(c["lo"], c["hi"], k.shape[2])
    _, weights = oracle_attention(q, k, v, mask=allowed, scale=c["scale"])
    expected = (weights * kept / (1 - p)) @ v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    torch.testing.assert_close(out.double(), expected.detach(), atol=2e-5 / (1 - p), rtol=2e-5)
    expected_lse = oracle_lse(q, k, allowed, c["scale"])
    torch.testing.assert_close(lse.double().nan_to_num(neginf=0.0), expected_lse.detach().nan_to_num(neginf=0.0),
                               **FP32)
    loss = (expected * grad_out.double()).sum()
    if grad_lse is not None:
        loss = loss + (expected_lse.masked_fill(torch.isneginf(expected_lse), 0.0) * grad_lse.double()).sum()
    for name, grad, want in zip("qkv", grads, torch.autograd.grad(loss, (q, k, v))):
        size = max(1.0, want.abs().max().item()) if want.numel() else 1.0
        # as in the test without dropout, kept weights scaled by up to 10 (p = 0.9)
        torch.testing.assert_close(grad.double(), want, atol=5e-5 * size / (1 - p), rtol=0, msg=f"d{name}")


@needs_native
def test_the_dropout_pattern_is_fair_and_differs_by_seed_head_and_row():
    """Over 2 x 4 x 256 x 256 weights: the kept share is 1 - p within 5 standard deviations, for
    every head and sequence; patterns of different heads, rows and seeds agree no more than
    independent ones would; the same seed gives the same pattern."""
    g = torch.Generator().manual_seed(0)
    c = dict(query=torch.randn(2, 4, 256, 8, generator=g), key=torch.randn(2, 2, 256, 8, generator=g),
             lo=torch.zeros(1, 256, dtype=torch.long), hi=torch.full((1, 256), 256), scale=0.1)
    for p in (0.1, 0.5):
        kept = _kept(c, p, seed=12345)
        assert torch.equal(kept, _kept(c, p, seed=12345))
        n = 256 * 256
        sigma = (p * (1 - p) / n) ** 0.5
        for share in kept.float().mean((-1, -2)).flatten():
            assert abs(share - (1 - p)) < 5 * sigma
        both = (1 - p) ** 2  # two independent patterns keep the same weight this often
        pairs = {"heads sharing a kv head": (kept[0, 0], kept[0, 1]), "sequences": (kept[0, 0], kept[1, 0]),
                 "rows": (kept[0, 0, :-1], kept[0, 0, 1:]), "seeds": (kept[0, 0], _kept(c, p, seed=12346)[0, 0])}
        for what, (a, b) in pairs.items():
            agree = (a & b).float().mean()
            assert abs(agree - both) < 5 * (both * (1 - both) / a.numel()) ** 0.5, what


@needs_native
@pytest.mark.parametrize("scale", [1e-3, 1.0, 40.0])
def test_scores_over_the_whole_exponent_range(scale):
    """With scale 40 the scores of a row differ by hundreds: most exp() underflow to 0 and the
    running maximum jumps between chunks, so rescaling by exp(old - new max) is exercised hard."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 300, 32, generator=g) for _ in range(3))
    lo = torch.clamp(torch.arange(300) - 200, min=0)[None]
    hi = torch.arange(1, 301)[None]
    out, lse = native.interval_forward(q, k, v, lo, hi, scale, block=32, chunk=64)
    allowed = _allowed(lo, hi, 300)
    expected, _ = oracle_attention(q, k, v, mask=allowed, scale=scale)
    # Scores of ~200 carry float32 rounding of ~3e-5 before any softmax: any fp32 kernel errs by
    # that much, so the bound is twice the plain float32 computation's own error (FlashAttention's rule).
    reference_error = (oracle_attention(q, k, v, mask=allowed, scale=scale, dtype=torch.float32)[0]
                       - expected).abs().max().item()
    tolerance = max(2 * reference_error, FP32["atol"])
    assert (out.double() - expected).abs().max().item() <= tolerance
    expected_lse = oracle_lse(q, k, allowed, scale)
    assert ((lse.double() - expected_lse).abs() / expected_lse.abs().clamp(min=1)).max() <= 4e-6


@needs_native
def test_the_exp_is_within_a_few_ulp():
    """The kernel's own exp, seen through softmax weights: row i attends keys {0, i}, so its
    output is a two-point blend whose weight is exp(-gap) / (1 + exp(-gap)) exactly."""
    gaps = torch.linspace(0.0, 80.0, 4001)
    query = torch.ones(1, 1, gaps.numel(), 1)
    key = torch.zeros(1, 1, 2, 1)
    key[..., 1, 0] = 1.0
    value = torch.tensor([[0.0], [1.0]]).expand(1, 1, 2, 1).contiguous()
    # score(key 0) = 0, score(key 1) = -gap (scale = -gap per row is not possible: put it in q)
    query[0, 0, :, 0] = -gaps
    lo = torch.zeros(1, gaps.numel(), dtype=torch.long)
    hi = torch.full_like(lo, 2)
    out, _ = native.interval_forward(query, key, value, lo, hi, 1.0)
    expected = torch.exp(-gaps.double()) / (1 + torch.exp(-gaps.double()))
    relative = ((out[0, 0, :, 0].double() - expected).abs() / expected).max()
    assert relative < 8 * torch.finfo(torch.float32).eps


@needs_native
@pytest.mark.parametrize("shape", [(1, 2, 0, 8, 8), (0, 2, 5, 8, 8), (1, 2, 5, 8, 0)])
def test_empty_shapes(shape):
    """No rows, no sequences, or values with no features: the lse is still every row's."""
    batch, heads, length, dk, dv = shape
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(batch, heads, length, dk, generator=g), torch.randn(batch, heads, length, dk, generator=g)
    v = torch.randn(batch, heads, length, dv, generator=g)
    lo = torch.zeros(1, length, dtype=torch.long)
    hi = torch.arange(1, length + 1)[None]
    out, lse = native.interval_forward(q, k, v, lo, hi, 0.5, block=2, chunk=3)
    assert out.shape == (batch, heads, length, dv) and lse.shape == (batch, heads, length)
    torch.testing.assert_close(lse.double(), oracle_lse(q, k, _allowed(lo, hi, length), 0.5), **FP32)
    grad_out, grad_lse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    grads = native.interval_backward(grad_out, q, k, v, out, lse, lo, hi, 0.5, grad_lse, block=2, chunk=3)
    case = dict(query=q, key=k, value=v, lo=lo, hi=hi, scale=0.5)
    for grad, want in zip(grads, _oracle_gradients(case, grad_out, grad_lse)):
        assert grad.shape == want.shape  # with Dv = 0 only the lse carries a gradient
        torch.testing.assert_close(grad.double(), want, **FP32)


@needs_native
def test_rows_of_one_with_any_stride():
    """A single key or query row may come with a stride shorter than a row (size-1 dims carry any
    stride); BLAS would reject it as a leading dimension."""
    q = torch.randn(1, 2, 8, 1).expand(1, 2, 8, 1).permute(0, 1, 3, 2)  # [1, 2, 1, 8], row stride 1
    k = torch.randn(1, 2, 8, 1).permute(0, 1, 3, 2)
    v = torch.randn(1, 2, 8, 1).permute(0, 1, 3, 2)
    assert q.stride(-2) < q.shape[-1] and k.stride(-2) < k.shape[-1]
    lo, hi = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long)
    out, lse = native.interval_forward(q, k, v, lo, hi, 1.0)
    torch.testing.assert_close(out, v.expand(1, 2, 1, 8))  # one key: its value, weight 1
    torch.testing.assert_close(lse, (q * k).sum(-1))


@needs_native
def test_bad_inputs_raise():
    q = torch.randn(1, 2, 4, 8)
    lo, hi = torch.zeros(1, 4, dtype=torch.long), torch.full((1, 4), 4)
    with pytest.raises(RuntimeError, match="float32"):
        native.interval_forward(q.double(), q.double(), q.double(), lo, hi, 1.0)
    with pytest.raises(RuntimeError, match="lo, hi"):
        native.interval_forward(q, q, q, lo.int(), hi.int(), 1.0)
    with pytest.raises(RuntimeError, match="shapes"):
        native.interval_forward(q, torch.randn(1, 3, 4, 8), torch.randn(1, 3, 4, 8), lo, hi, 1.0)
    out, lse = native.interval_forward(q, q, q, lo, hi, 1.0)
    with pytest.raises(RuntimeError, match="grad_out must be"):
        native.interval_backward(out[:, :1], q, q, q, out, lse, lo, hi, 1.0)
    with pytest.raises(RuntimeError, match="lse and delta"):
        native.interval_backward(out, q, q, q, out, lse[..., :3], lo, hi, 1.0)


@given(lq=st.integers(1, 200), lk=st.integers(1, 200), seed=st.integers(0, 2**31 - 1), shared=st.booleans())
def test_computed_fraction_counts_each_block_over_its_span(lq, lk, seed, shared):
    """Counted row by row: a block (of the kernel's block size) multiplies all its rows by every
    key from its non-empty rows' lowest start to their highest end."""
    g = torch.Generator().manual_seed(seed)
    lo = torch.randint(-3, lk + 2, (1 if shared else 2, lq), generator=g)
    hi = lo + torch.randint(0, lk + 3, lo.shape, generator=g)
    block, _ = native.tiles(lo, hi)
    computed = 0
    for s in range(lo.shape[0]):
        for first in range(0, lq, block):
            rows = [(max(int(a), 0), min(int(b), lk)) for a, b in zip(lo[s, first:first + block], hi[s, first:first + block])]
            rows = [(a, b) for a, b in rows if a < b]
            if rows:
                computed += min(lq - first, block) * (max(b for _, b in rows) - min(a for a, _ in rows))
    assert native.computed_fraction(lo, hi, lk) == pytest.approx(computed / (lo.shape[0] * lq * lk))


@needs_native
def test_the_build_command_is_a_no_op_once_built():
    result = subprocess.run([sys.executable, "-m", "attnkit.kernel", "--strict"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert str(native.library_path()) in result.stdout
    assert math.isfinite(native.library_path().stat().st_size)


def test_a_failed_build_is_reported_and_does_not_fail_the_install(tmp_path):
    """No writable cache (or no compiler): the build command says why and exits 0, so `make`
    goes on and the tiled backend uses PyTorch's kernel; with --strict it exits 1."""
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache directory would go")
    env = {**os.environ, "ATTNKIT_NATIVE_DIR": str(blocked / "native")}
    command = [sys.executable, "-m", "attnkit.kernel"]
    lenient = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    assert lenient.returncode == 0 and "PyTorch's kernels instead" in lenient.stderr
    strict = subprocess.run([*command, "--strict"], capture_output=True, text=True, env=env, check=False)
    assert strict.returncode == 1
    probe = subprocess.run([sys.executable, "-c", "from attnkit._backends import native; print(native.why_unavailable())"],
                           capture_output=True, text=True, env=env, check=False)
    assert probe.returncode == 0 and ("not built" in probe.stdout or "needs" in probe.stdout)
