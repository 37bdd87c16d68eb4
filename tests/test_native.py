"""attnkit's own CPU kernel (``attnkit._backends.native``) against the float64 oracle: random key
intervals per row (empty rows, rows past the keys), tiny blocks and chunks (so rows cross many
chunks of the running softmax), GQA, Dv != D, strided inputs, scores spanning the whole float
exponent range; and that the tiled backend runs it exactly where it applies.

``make test`` builds the kernel first; where it cannot be built (no compiler, not x86-64 with
AVX2) these tests skip and the tiled backend uses PyTorch's kernel, which test_tiled covers."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from attnkit._backends import dropout, native
from oracle import flash_backward_float32, oracle_attention, oracle_lse

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
    key_rows_outer = draw(st.booleans())  # keys and values as a model's projections give them, or not
    key, value = (torch.randn(batch, lk, kv_heads, dim, generator=g).transpose(1, 2) if key_rows_outer else
                  torch.randn(batch, kv_heads, lk, dim, generator=g) for dim in (dk, dv))
    rows = draw(st.sampled_from([1, batch]))
    lo = torch.randint(-3, lk + 2, (rows, lq), generator=g)
    width = torch.randint(0, lk + 3, (rows, lq), generator=g)
    hi = lo + width  # may be empty, start before key 0 or end past the last key
    return dict(query=query, key=key, value=value, lo=lo, hi=hi,
                scale=draw(st.floats(0.05, 3.0)), block=draw(st.integers(1, 9)), chunk=draw(st.integers(1, 17)))


def assert_laid_out_like(result, like):
    """Dense, with rows outer to heads ([B, L, H, C] in memory) exactly where ``like`` has them so:
    a model's ``view(B, L, H * C)`` of the result, or of a gradient, needs no copy (as SDPA's)."""
    rows_outer = like.shape[1] > 1 and like.shape[2] > 1 and like.stride(1) < like.stride(2)
    assert (result.transpose(1, 2) if rows_outer else result).is_contiguous(), (result.stride(), like.stride())


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
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert_laid_out_like(out, c["query"])
    torch.testing.assert_close(out, expected.float(), **FP32)
    expected_lse = oracle_lse(c["query"], c["key"], allowed, c["scale"])
    assert torch.equal(torch.isneginf(lse), torch.isneginf(expected_lse))  # rows with no key: -inf
    torch.testing.assert_close(lse.double().nan_to_num(neginf=0.0), expected_lse.nan_to_num(neginf=0.0), **FP32)


def _flash_floors(c, grad_out, grad_lse, expected, keep=None, p=0.0) -> list[float]:
    """Twice the error of FlashAttention's algorithm in float32 on the case (oracle.
    flash_backward_float32) against the ``expected`` dq, dk, dv: the float32 floor a gradient's
    bound must allow beside its own. Where every row of a key attends it alone, dk is 0 in exact
    arithmetic and the oracle's autograd gets 0, while the algorithm's row term rowsum(dO * O) leaves
    float32's rounding of each row's dO . V (129 rows of two heads on one key, scale 1, D = 64: ours
    6.9e-5, this algorithm 7.1e-5, PyTorch's own fused float32 kernel 6.8e-5, all over a bound
    relative to the largest gradient, which is 0 there)."""
    allowed = _allowed(c["lo"], c["hi"], c["key"].shape[2])
    flash = flash_backward_float32(c["query"], c["key"], c["value"], grad_out, allowed, c["scale"], keep=keep,
                                   dropout=p, grad_lse=grad_lse)[1:]
    return [2 * (f.double() - want).abs().max().item() if want.numel() else 0.0 for f, want in zip(flash, expected)]


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
    floors = _flash_floors(c, grad_out, grad_lse, expected)
    for name, grad, want, like, floor in zip("qkv", grads, expected, (c["query"], c["key"], c["value"]), floors):
        assert grad.shape == like.shape and grad.dtype == torch.float32, name
        assert_laid_out_like(grad, like)
        # Relative to the largest gradient: scores reach |s| ~ 50 here (scale 3, 16 features), whose
        # fp32 rounding (ulp 4e-6) enters every weight exp(s - lse) recomputed from the lse. Over
        # 2000 cases the error was <= 1.5e-5 of the largest gradient; PyTorch's own fused fp32
        # kernel, the same way recomputing, erred by <= 5.6e-6 and plain fp32 autograd by <= 6e-6 on
        # such cases. 5e-5 is 3x our worst; a wrong key or row gives errors of order 1. Beside it,
        # FlashAttention's float32 floor, twice over (_flash_floors; the soak's rows on one key)
        size = max(1.0, want.abs().max().item()) if want.numel() else 1.0
        torch.testing.assert_close(grad.double(), want, atol=max(5e-5 * size, floor), rtol=0, msg=f"d{name}")


@needs_native
@pytest.mark.parametrize("dk, dv, block, chunk", [(80, 72, 37, 13), (130, 17, 64, 100), (64, 64, 96, 7),
                                                  (5, 150, 33, 64)])
def test_gradients_of_wide_heads_and_many_rows_match_the_oracle(dk, dv, block, chunk):
    """Head dims across and between the backward's feature tiles (16 features in the 256-bit build,
    64 in the 512-bit one; whole and partial vectors), blocks of several 32-row groups with padding,
    chunks cut mid-tile, GQA, keys laid out as a model's."""
    g = torch.Generator().manual_seed(dk * 1000 + dv)
    lq, lk = 150, 170
    query = torch.randn(2, 4, lq, dk, generator=g)
    key, value = (torch.randn(2, lk, 2, dim, generator=g).transpose(1, 2) for dim in (dk, dv))
    lo = torch.randint(-3, lk, (2, lq), generator=g)
    hi = lo + torch.randint(0, lk, (2, lq), generator=g)
    c = dict(query=query, key=key, value=value, lo=lo, hi=hi, scale=dk ** -0.5)
    out, lse = native.interval_forward(query, key, value, lo, hi, c["scale"], block=block, chunk=chunk)
    grad_out, grad_lse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    grads = native.interval_backward(grad_out, query, key, value, out, lse, lo, hi, c["scale"], grad_lse,
                                     block=block, chunk=chunk, parts=2)
    for name, grad, want in zip("qkv", grads, _oracle_gradients(c, grad_out, grad_lse)):
        # sums of up to 170 keys and 150 features of O(1) terms in fp32: ~1e-5 of the largest
        size = max(1.0, want.abs().max().item())
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
    expected = torch.autograd.grad(loss, (q, k, v))
    floors = _flash_floors(c, grad_out, grad_lse, expected, keep=kept, p=p)
    for name, grad, want, floor in zip("qkv", grads, expected, floors):
        size = max(1.0, want.abs().max().item()) if want.numel() else 1.0
        # as in the test without dropout, kept weights scaled by up to 10 (p = 0.9)
        torch.testing.assert_close(grad.double(), want, atol=max(5e-5 * size / (1 - p), floor), rtol=0,
                                   msg=f"d{name}")


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
def test_keys_and_values_of_a_model_layout_give_the_same_bits_gathered_or_not():
    """From 2048 query rows the forward copies key and value rows that a model's projections give
    ([B, L, Hkv, D] in memory) into one block per head; below, it reads them in place. Either way
    the products are the same sums in the same order: equal bits, and equal to contiguous inputs."""
    g = torch.Generator().manual_seed(0)
    for rows in (2047, 2048):
        query = torch.randn(1, rows, 4, 16, generator=g).transpose(1, 2)
        key, value = (torch.randn(1, 300, 2, 16, generator=g).transpose(1, 2) for _ in range(2))
        lo = (torch.arange(rows) % 300 - 100).clamp(min=0).reshape(1, -1)
        hi = (torch.arange(rows) % 300 + 1).reshape(1, -1)
        out, lse = native.interval_forward(query, key, value, lo, hi, 0.25)
        out_c, lse_c = native.interval_forward(query, key.contiguous(), value.contiguous(), lo, hi, 0.25)
        assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
        assert_laid_out_like(out, query)
    allowed = _allowed(lo, hi, 300)
    expected, _ = oracle_attention(query, key, value, mask=allowed, scale=0.25)
    torch.testing.assert_close(out.double(), expected, **FP32)


@needs_native
def test_half_precision_key_gradient_sums_reuse_kept_memory_without_showing_it():
    """A half-precision backward sums dK and dV in float32 scratch that the kernel keeps from one
    call to the next, unzeroed (zeroed afresh each call, it faulted in ~3,700 pages a float16 window
    backward at L = 16384 on two threads): the next call faults in next to none, and key rows no
    query reaches still come out 0, whatever the last call left there."""
    import resource

    import attnkit.kernel

    g = torch.Generator().manual_seed(3)
    length = 16384
    # eight heads: one part each (tile_tables.backward_parts), whose sums take the scratch; with fewer
    # the rows are cut into parts summed in float32 copies instead
    query, key, value, grad_out = (torch.randn(1, 8, length, 64, generator=g).half() for _ in range(4))
    rows = torch.arange(length).reshape(1, -1)
    window = (rows - 63, rows + 1)
    padded = ((rows - 63).clamp(max=12000 - 1), (rows + 1).clamp(max=12000))  # keys 12000.. unreached

    def gradients(lo, hi):
        out, lse = native.interval_forward(query, key, value, lo, hi, 0.125)
        return native.interval_backward(grad_out, query, key, value, out, lse, lo, hi, 0.125)

    attnkit.kernel.release_memory()
    fresh = gradients(*padded)  # sums in fresh mappings
    assert torch.equal(fresh[1][0, :, 12000:], torch.zeros(8, length - 12000, 64, dtype=torch.half))
    gradients(*window)  # the scratch now holds sums for every key row
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    reused = gradients(*padded)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    for got, want in zip(reused, fresh):
        assert torch.equal(got, want)
    assert faults < 500, faults
    attnkit.kernel.release_memory()


@needs_native
def test_large_outputs_reuse_freed_memory_and_overwrite_all_of_it():
    """Outputs and gradients of 32 MiB or more come from mappings the kernel keeps when they are
    freed (no page faults on the next call). A reused mapping still holding NaN from its last
    tenant must not show through anywhere (rows with no key are zeros): the results equal those
    computed in fresh memory, bit for bit. At most 256 MiB is kept, and release_memory() gives it
    back."""
    import attnkit.kernel

    attnkit.kernel.release_memory()
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 2, 4096, 1024, generator=g) for _ in range(3))  # 32 MiB each
    rows = torch.arange(4096).reshape(1, -1)
    lo, hi = rows - 15, rows + 1
    hi[:, 1000:1100] = lo[:, 1000:1100]  # rows with no key
    grad_out = torch.randn(query.shape, generator=g)

    def results():
        out, lse = native.interval_forward(query, key, value, lo, hi, 0.03)
        return (out, lse, *native.interval_backward(grad_out, query, key, value, out, lse, lo, hi, 0.03))

    fresh = results()
    expected = [t.clone() for t in fresh]
    addresses = {t.data_ptr() for t in fresh if t.nbytes >= 32 << 20}
    assert len(addresses) == 4  # output, dq, dk, dv
    for t in fresh:
        t.fill_(float("nan"))
    del fresh, t
    reused = results()
    assert {t.data_ptr() for t in reused if t.nbytes >= 32 << 20} == addresses
    assert torch.equal(reused[0][0, :, 1000:1100], torch.zeros(2, 100, 1024))
    for got, want in zip(reused, expected):
        assert torch.equal(got, want)
    del reused
    # the four results, and the backward's per-part key-gradient copies when it split rows
    assert 4 * (32 << 20) <= attnkit.kernel.release_memory() <= 256 << 20
    assert attnkit.kernel.release_memory() == 0

    many = [native.interval_forward(query, key, value, lo, hi, 0.03)[0] for _ in range(10)]
    del many
    assert attnkit.kernel.release_memory() == 256 << 20  # the 8 most recently freed


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
    with pytest.raises(RuntimeError, match="lse must be"):
        native.interval_backward(out, q, q, q, out, lse[..., :3], lo, hi, 1.0)
    with pytest.raises(RuntimeError, match="grad_lse must be"):
        native.interval_backward(out, q, q, q, out, lse, lo, hi, 1.0, grad_lse=lse[..., :3])
    with pytest.raises(RuntimeError, match="out must be"):
        native.interval_backward(out, q, q, q, out[:, :, :3], lse, lo, hi, 1.0)


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


# -- IEEE semantics: non-finite inputs and scores ---------------------------------------------------
#
# Row i attends A_i = [lo_i, hi_i) & [0, Lk). A pair outside A_i contributes nothing, whatever its
# q, k, v or dO hold; within A_i arithmetic is IEEE: a NaN or +inf score makes the row's output
# and lse NaN, scores of -inf weigh exactly 0 (times an infinite value: NaN), a row whose scores
# are all -inf (or that has no key) is zeros with lse -inf and takes no part in the gradients, and
# the gradients are autograd's of that definition (dropped weights included: 0 * NaN is NaN).

_UNDERFLOW = -87.0  # the kernel's exp is exactly 0 below this (expf turns subnormal at -87.3)
_EPS32 = torch.finfo(torch.float32).eps


def _ieee_oracle(q, k, v, lo, hi, scale, keep=None, p=0.0):
    """float64 ``(out, lse, weights before dropout)`` of the definition above, written pair by pair: every product
    takes both operands through ``torch.where`` on the pair's mask, so that a pair outside A_i
    enters no product, forward or backward (autograd of ``0 * x`` is NaN for a NaN x). Scores are
    rounded to float32 (where the kernel's overflow to inf happens) with a float64 gradient, and a
    weight exp(s - max) is 0 below the kernel's underflow cut; the tests keep scores away from
    both edges, so only patterns that any float32 kernel must give are checked."""
    heads, kv_heads, lk = q.shape[1], k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    keys = torch.arange(lk)
    attended = ((keys >= lo[..., None]) & (keys < hi[..., None]))[:, None].expand(q.shape[0], heads, -1, -1)

    def scores(pairs):
        both = pairs[..., None]
        exact = scale * (torch.where(both, q[:, :, :, None], 0.0) * torch.where(both, k[:, :, None], 0.0)).sum(-1)
        rounding = torch.where(torch.isfinite(exact), exact.float().double() - exact, 0.0).detach()
        return torch.where(pairs, exact + rounding, float("-inf"))

    s = scores(attended)
    with torch.no_grad():  # rows whose scores are all -inf (or that have no key) have no weight
        has_key = ~(s.amax(-1) == float("-inf"))  # NaN rows have one
    row_max = s.amax(-1, keepdim=True).detach()  # NaN for a NaN score, +inf for an infinite one
    shifted = s - torch.where(has_key[..., None], row_max, 0.0)
    # the cut multiplies (0 * a non-finite gradient is NaN, as the kernel's 0 weight times it); a
    # where would drop that gradient
    e = torch.where(attended, torch.exp(shifted) * ~(shifted.detach() < _UNDERFLOW), 0.0)
    total = e.sum(-1, keepdim=True)
    # a row with no weight still multiplies its attended values (and, backward, keys) by its 0s
    weights = e / torch.where(has_key[..., None], total, 1.0)
    kept = weights if keep is None else weights * keep / (1.0 - p)  # a dropped NaN stays NaN
    both = attended[..., None]
    out = (torch.where(both, kept[..., None], 0.0) * torch.where(both, v[:, :, None], 0.0)).sum(-2)
    safe_total = torch.where(has_key, total[..., 0], 1.0)
    lse = torch.where(has_key, row_max[..., 0] + torch.log(safe_total), float("-inf"))
    return out, lse, weights.detach()


def _finite_or_zero(t):
    return torch.where(torch.isfinite(t), t.double(), 0.0).abs()


def _gradient_bounds(q, k, v, grad_out, grad_lse, weights, factors, out, lo, hi, scale):
    """Per entry of dq, dk, dv, the sum of the magnitudes that float32 rounding acts on: with |.|
    of the finite parts, P the weights, f the dropout factors and
    G_ij = scale P_ij (f_ij |dO_i| . |v_j| + |dO_i| . |O_i| + |dlse_i|) over attended pairs,
    dq_i <- sum_j G_ij |k_j|, dk_j <- sum_i G_ij |q_i|, dv_j <- sum_i f_ij P_ij |dO_i|. Where the
    weights are one-hot (huge scores), dS = P (f dP - delta) cancels to 0 in exact arithmetic and to
    ~eps * scale * |dP| in float32: a bound relative to the largest gradient would call that wrong."""
    heads, kv_heads = q.shape[1], k.shape[1]
    qa, ka, va, ga, oa, pa = (_finite_or_zero(t) for t in (q, k, v, grad_out, out, weights))
    ka, va = ka.repeat_interleave(heads // kv_heads, 1), va.repeat_interleave(heads // kv_heads, 1)
    gla = 0.0 if grad_lse is None else _finite_or_zero(grad_lse)[..., None]
    keys = torch.arange(k.shape[2])
    attended = ((keys >= lo[..., None]) & (keys < hi[..., None]))[:, None]
    pa = torch.where(attended, pa, 0.0)
    g = scale * pa * (factors * (ga @ va.transpose(-1, -2)) + (ga * oa).sum(-1, keepdim=True) + gla)

    def per_kv_head(t):
        return t.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)

    return g @ ka, per_kv_head(g.transpose(-1, -2) @ qa), per_kv_head((pa * factors).transpose(-1, -2) @ ga)


def _score_magnitudes(q, k, lo, hi, scale):
    """scale * sum_d |q_d k_d| of each attended pair (finite parts), 0 elsewhere: what a score's
    rounding acts on. ``[B, H, Lq, Lk]``."""
    heads, kv_heads = q.shape[1], k.shape[1]
    ka = _finite_or_zero(k).repeat_interleave(heads // kv_heads, 1)
    keys = torch.arange(k.shape[2])
    attended = ((keys >= lo[..., None]) & (keys < hi[..., None]))[:, None]
    return torch.where(attended, scale * _finite_or_zero(q) @ ka.transpose(-1, -2), 0.0)


def _unsure_gradients(q, k, lse, lo, hi, scale):
    """Which entries of dq, dk, dv sum over a pair whose weight no float32 backward can recompute:
    P = exp(s - lse) from a score recomputed with other rounding than the forward's (another
    product shape) is off by a factor exp(+-ds), ds ~ eps * (scale * sum_d |q_d k_d| + |lse|),
    which for scores of ~1e20 (the huge scale and rows) is anything from 0 to 1. PyTorch's
    flash backward recomputes the same way. Rows whose lse is not finite have no such weight."""
    heads, kv_heads = q.shape[1], k.shape[1]
    magnitudes = _score_magnitudes(q, k, lo, hi, scale)
    rounding = 4 * q.shape[-1] * _EPS32 * (magnitudes + _finite_or_zero(lse)[..., None])
    keys = torch.arange(k.shape[2])
    attended = ((keys >= lo[..., None]) & (keys < hi[..., None]))[:, None]
    pairs = attended & torch.isfinite(lse)[..., None] & (rounding > 1.0)
    keys_hit = pairs.any(-2).unflatten(1, (kv_heads, heads // kv_heads)).any(2)[..., None]
    return pairs.any(-1, keepdim=True), keys_hit, keys_hit  # [..., 1]: for any feature


def _order_dependent(q, k, lo, hi, scale):
    """Rows (``[B, H, Lq, 1]``) and key rows per kv head (``[B, Hkv, Lk, 1]``) where IEEE float32
    itself leaves the result open: an attended score whose products hold an infinity beside finite
    ones large enough to overflow a partial sum, so that the sum is NaN or that infinity depending on
    the order of the additions (a huge query row with one -inf feature: an FMA chain that overflows
    to +inf before reaching the -inf gives NaN, one that starts with it gives -inf). The float64
    definition adds exactly and never overflows; no float32 kernel can be held to it there."""
    heads, kv_heads = q.shape[1], k.shape[1]
    kr = k.double().repeat_interleave(heads // kv_heads, 1)
    products = q.double()[:, :, :, None, :] * kr[:, :, None, :, :]  # [B, H, Lq, Lk, D]
    finite_sum = torch.where(torch.isfinite(products), products.abs(), 0.0).sum(-1)
    may_overflow = max(1.0, abs(scale)) * finite_sum >= torch.finfo(torch.float32).max / 4
    attended = _allowed(lo, hi, k.shape[2])
    pairs = attended & torch.isinf(products).any(-1) & may_overflow
    rows = pairs.any(-1) | _undetermined_winner(q, kr, attended, _score_magnitudes(q, k, lo, hi, scale), scale)
    keys_hit = (attended & rows[..., None]).any(-2).unflatten(1, (kv_heads, heads // kv_heads)).any(2)[..., None]
    return rows[..., None], keys_hit


def _undetermined_winner(q, kr, attended, magnitudes, scale):
    """Rows (``[B, H, Lq]``) whose scores are so large that float32 rounding alone moves a weight by
    e or more (a score's bound ``4 D eps scale sum_d |q_d k_d|`` above 1: the huge scale or rows),
    and whose top attended score is within the two scores' rounding of another's. Their softmax is
    one-hot on a key that rounding picks: 1.1964258e31 against 1.1964257e31 (7e-8 apart, each
    rounded to 2.5e-5) chose key 12 in the kernel and key 7 in the exact sums. ``kr``: the keys
    repeated to the query heads, in float64; ``magnitudes``: :func:`_score_magnitudes`."""
    scores = scale * (q.double() @ kr.transpose(-1, -2))
    rounding = 4 * q.shape[-1] * _EPS32 * magnitudes
    scores = torch.where(attended & torch.isfinite(scores), scores, float("-inf"))
    top, winner = scores.max(-1, keepdim=True)
    winner_rounding = rounding.gather(-1, winner)
    others = torch.ones_like(scores, dtype=torch.bool).scatter(-1, winner, False)
    close = others & (top - scores < winner_rounding + rounding) & (winner_rounding > 1.0)
    return close.any(-1) & torch.isfinite(top[..., 0])


def _non_finite(t):
    return ~torch.isfinite(t)


def _assert_ieee_close(got, want, atol, rtol, what, kinds=(torch.isnan, torch.isposinf, torch.isneginf)):
    """Same NaN, +inf and -inf positions (or the ``kinds`` given); finite entries within
    ``atol + rtol * |want|`` (``atol`` may be a tensor of per-entry bounds)."""
    got = got.double()
    assert got.shape == want.shape, what
    for kind in kinds:
        differ = kind(got) != kind(want)
        assert not differ.any(), (f"{what}: {kind.__name__} differs at {differ.nonzero()[:5].tolist()}: "
                                  f"got {got[differ][:5].tolist()}, want {want[differ][:5].tolist()}")
    finite = torch.isfinite(want)
    atol = torch.as_tensor(atol, dtype=torch.float64).expand(want.shape)
    error = (got - want).abs()
    bad = finite & ~(error <= atol + rtol * want.abs())
    assert not bad.any(), (f"{what}: off at {bad.nonzero()[:5].tolist()}: got {got[bad][:5].tolist()}, "
                           f"want {want[bad][:5].tolist()}")


_SPECIALS = (float("nan"), float("inf"), float("-inf"))


@st.composite
def ieee_cases(draw):
    """interval_cases with non-finite values planted in q, k, v and dO (anywhere: attended pairs,
    masked keys inside a block's span, keys outside every span), and either a scale of 1e30 or
    rows of +-1e20 (scores of ~1e20 to 1e31, one-hot weights; 1e20 * 1e20 overflows to +inf).
    Ordinary scores stay within +-30 (scale <= 1, 16 features): far from the exp cut at -87."""
    c = draw(interval_cases())
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    huge_scale = draw(st.booleans())
    c["scale"] = 1e30 if huge_scale else draw(st.floats(0.05, 1.0))
    q, k, v = c["query"], c["key"], c["value"]
    batch, heads, lq, dk = q.shape
    kv_heads, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    c["grad_out"] = torch.randn(batch, heads, lq, dv, generator=g)
    c["grad_lse"] = torch.randn(batch, heads, lq, generator=g) if draw(st.booleans()) else None
    if draw(st.booleans()):  # feature 0 of every key positive: an infinite q_0 makes a whole row +-inf
        k[..., 0] = k[..., 0].abs() + 0.5
    for _ in range(draw(st.integers(1, 6))):
        target = draw(st.sampled_from(["query", "key", "value", "grad_out"] + ["huge"] * (not huge_scale)))

        def pick(n):
            return int(torch.randint(0, n, (), generator=g))

        if target == "huge":
            # A whole row of one sign: products never cancel, overflow is certain. Random sizes keep
            # two huge keys from tying (a tie of scores of 1e20 is broken by their rounding).
            size = 1e20 * (1 + float(torch.rand((), generator=g)))
            if draw(st.booleans()):
                q[pick(batch), pick(heads), pick(lq)] = draw(st.sampled_from([size, -size]))
            else:
                k[pick(batch), pick(kv_heads), pick(lk)] = size
            continue
        special = draw(st.sampled_from(_SPECIALS))
        if target == "query":
            q[pick(batch), pick(heads), pick(lq), pick(dk)] = special
        elif target == "key":
            k[pick(batch), pick(kv_heads), pick(lk), pick(dk)] = special
        elif target == "value":
            v[pick(batch), pick(kv_heads), pick(lk), pick(dv)] = special
        else:
            c["grad_out"][pick(batch), pick(heads), pick(lq), pick(dv)] = special
    c["dropout"] = draw(st.sampled_from([0.0, 0.0, 0.5]))
    c["seed"] = draw(st.integers(0, 2**62))
    c["backward_tiles"] = (draw(st.integers(1, 9)), draw(st.integers(1, 17)), draw(st.integers(1, 3)))
    return c


@needs_native
@settings(max_examples=150)
@given(c=ieee_cases())
def test_non_finite_values_follow_the_ieee_definition(c):
    """Output, lse and the three gradients against the pairwise float64 definition: the same NaN,
    +inf and -inf positions, finite values within the tolerances of the tests above (gradients:
    also within 64 eps of what float32 rounding acts on, see _gradient_bounds)."""
    _assert_follows_ieee(c)


def _assert_follows_ieee(c):
    q, k, v, lo, hi, scale, p = c["query"], c["key"], c["value"], c["lo"], c["hi"], c["scale"], c["dropout"]
    out, lse = native.interval_forward(q, k, v, lo, hi, scale, block=c["block"], chunk=c["chunk"], dropout=p,
                                       seed=c["seed"])
    block, chunk, parts = c["backward_tiles"]
    grads = native.interval_backward(c["grad_out"], q, k, v, out, lse, lo, hi, scale, c["grad_lse"], block=block,
                                     chunk=chunk, parts=parts, dropout=p, seed=c["seed"])

    keep = None
    if p > 0:
        keep = dropout.keep_mask(torch.tensor(c["seed"]), q.shape[0], q.shape[1], q.shape[2], k.shape[2], p)
    inputs = [t.double().requires_grad_() for t in (q, k, v)]
    want_out, want_lse, weights = _ieee_oracle(*inputs, lo, hi, scale, keep, p)
    open_rows, open_keys = _order_dependent(q, k, lo, hi, scale)
    _assert_ieee_close(out.masked_fill(open_rows, 0.0), want_out.detach().masked_fill(open_rows, 0.0),
                       FP32["atol"] / (1 - p), FP32["rtol"], "out")
    # a score's own float32 rounding (D products) enters the lse: ~1e20 for scores of 1e27 that
    # cancel from terms of 1e30
    score_error = q.shape[-1] * _EPS32 * _score_magnitudes(q, k, lo, hi, scale).amax(-1)
    _assert_ieee_close(lse.masked_fill(open_rows[..., 0], 0.0), want_lse.detach().masked_fill(open_rows[..., 0], 0.0),
                       FP32["atol"] + score_error, FP32["rtol"], "lse")

    grad_lse = torch.zeros_like(lse) if c["grad_lse"] is None else c["grad_lse"]
    expected = torch.autograd.grad((want_out, want_lse), inputs, (c["grad_out"].double(), grad_lse.double()),
                                   allow_unused=True)
    factors = 1.0 if keep is None else keep / (1 - p)
    bounds = _gradient_bounds(q, k, v, c["grad_out"], c["grad_lse"], weights, factors, want_out.detach(), lo, hi,
                              scale)
    unsure = [a | b for a, b in zip(_unsure_gradients(q, k, lse, lo, hi, scale), (open_rows, open_keys, open_keys))]
    # With an infinite dO the kernel's delta = dO . O (FlashAttention's) and autograd's
    # sum_j P_j (dO . v_j) are both non-finite but may differ in kind (inf * (a finite sum) against
    # a sum of +-inf): the same entries of dq, dk, dv are non-finite, NaN or inf may differ.
    kinds = (_non_finite,) if torch.isinf(c["grad_out"]).any() else (torch.isnan, torch.isposinf, torch.isneginf)
    for name, grad, want, bound, skip in zip("qkv", grads, expected, bounds, unsure):
        finite = want[(torch.isfinite(want) & ~skip).expand(want.shape)]
        size = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
        # the bound of the tests without non-finite values, or 64 eps of the magnitudes rounding acts
        # on (a sum of <= 40 terms, plus the scores' and dP's own rounding)
        tolerance = 5e-5 * size / (1 - p) + 64 * _EPS32 * bound
        _assert_ieee_close(grad.double().masked_fill(skip, 0.0), want.masked_fill(skip, 0.0), tolerance, 0.0,
                           f"d{name}", kinds)


@needs_native
@pytest.mark.parametrize("grad_lse", [False, True])
def test_a_row_whose_scores_are_all_minus_inf_passes_no_nan_of_its_output_to_other_keys(grad_lse):
    """A row whose attended scores are all -inf (an inf in its query) weighs its keys by 0, and its
    output holds NaN where an attended value does (0 x NaN). Its gradients are 0 x what each pair
    multiplies: NaN in dk only at the query's inf, NaN in dq, dv's 0 x dO. FlashAttention's row term
    delta = dO . O would be NaN there and reach every key's dS: the kernel did that until a soak
    found it (the reference backend, the PyTorch-block and Triton kernels, and the definition agree)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(1, 1, 3, 22, generator=g) for _ in range(4))
    q[0, 0, 0, 15], v[0, 0, 1, 17] = float("inf"), float("nan")
    c = dict(query=q, key=k, value=v, grad_out=grad_out, lo=torch.tensor([[-2, 4, -3]]), hi=torch.tensor([[2, 5, 0]]),
             scale=1e30, block=16, chunk=16, dropout=0.0, seed=0, backward_tiles=(16, 16, 1),
             grad_lse=torch.randn(1, 1, 3, generator=g) if grad_lse else None)
    _assert_follows_ieee(c)
    out, lse = native.interval_forward(q, k, v, c["lo"], c["hi"], c["scale"])
    dq, dk, dv = native.interval_backward(grad_out, q, k, v, out, lse, c["lo"], c["hi"], c["scale"], c["grad_lse"])
    assert out[0, 0, 0].isnan().sum() == 1 and dk[0, 0, 0].isnan().sum() == 1 and not dv.isnan().any()


@needs_native
@pytest.mark.parametrize("special", _SPECIALS)
@pytest.mark.parametrize("target", ["key", "value", "query", "grad_out"])
@pytest.mark.parametrize("mask", ["documents", "window"])
def test_non_finite_values_where_halves_of_a_block_skip_keys(mask, special, target):
    """Each half of a 32-row block (16 rows) skips the keys outside its rows' reach in every
    product (tiles.h), its scores written as 0, so no check sees a non-finite value there and no
    product may multiply one. Documents [0, 48) and [48, 96): block 1's first half (rows 32-47)
    attends exactly keys [0, 48), its second half [48, 96), so a NaN or inf query, dO, key or value
    row meets masked pairs only where they are skipped. A window of 41 keys: rows 32-47 reach keys
    [0, 48), rows 48-63 keys [8, 64). Forward and backward follow the IEEE definition: what a row
    attends propagates, what it does not changes nothing."""
    g = torch.Generator().manual_seed(3)
    length = 96
    q, k, v, grad_out = (torch.randn(1, 2, length, 16, generator=g) for _ in range(4))
    rows = torch.arange(length)
    if mask == "documents":
        lo, hi = torch.where(rows < 48, 0, 48)[None], torch.where(rows < 48, 48, 96)[None]
    else:
        lo, hi = (rows - 40)[None], (rows + 1)[None]
    if target == "key":  # a key of one half's skipped keys, attended by the other half
        k[0, 1, 56, 3] = special
        k[0, 0, 5, 2] = special
    elif target == "value":
        v[0, 1, 56, 5] = special
        v[0, 0, 5, 0] = special
    elif target == "query":  # rows beside the keys their half skips
        q[0, 1, 40, 0] = special
        q[0, 0, 60, 7] = special
    else:
        grad_out[0, 1, 40, 1] = special
        grad_out[0, 0, 60, 4] = special
    c = dict(query=q, key=k, value=v, lo=lo, hi=hi, scale=0.5, block=32, chunk=64, grad_out=grad_out,
             grad_lse=None, dropout=0.0, seed=0, backward_tiles=(32, 64, 1))
    _assert_follows_ieee(c)


def _forward_and_backward(q, k, v, lo, hi, grad_out, block=4, chunk=8, p=0.0):
    out, lse = native.interval_forward(q, k, v, lo, hi, 0.5, block=block, chunk=chunk, dropout=p, seed=7)
    grads = native.interval_backward(grad_out, q, k, v, out, lse, lo, hi, 0.5, block=block, chunk=chunk, dropout=p,
                                     seed=7)
    return (out, lse, *grads)


@needs_native
@pytest.mark.parametrize("p", [0.0, 0.5])
def test_non_finite_values_of_pairs_not_attended_change_nothing(p):
    """Rows 0-9 attend keys [0, 10), rows 10-19 keys [11, 20): key 10 belongs to no row but lies in
    every block's span (the products multiply its score and value by a weight of 0), and row 20 has
    no key. NaN and inf there (key, value, the empty row's query and dO) leave every result as
    it is without them, forward and backward."""
    g = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(1, 2, 21, 16, generator=g) for _ in range(4))
    k, v = k[:, :, :20], v[:, :, :20]
    lo = torch.tensor([[0] * 10 + [11] * 10 + [5]])
    hi = torch.tensor([[10] * 10 + [20] * 10 + [5]])
    clean = _forward_and_backward(q, k, v, lo, hi, grad_out, p=p)
    for special in _SPECIALS:
        q2, k2, v2, g2 = q.clone(), k.clone(), v.clone(), grad_out.clone()
        k2[:, :, 10, 3] = special
        v2[:, :, 10, 5] = special
        q2[:, :, 20, 0] = special
        g2[:, :, 20, 1] = special
        poisoned = _forward_and_backward(q2, k2, v2, lo, hi, g2, p=p)
        for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], poisoned, clean):
            finite = torch.isfinite(b)
            assert torch.equal(torch.isfinite(a), finite), f"{name} with {special}"
            torch.testing.assert_close(a[finite], b[finite], **FP32, msg=f"{name} with {special}")


@needs_native
@pytest.mark.parametrize("keys", [1, 13])  # a row tail, and 8-lane steps
@pytest.mark.parametrize("special", ["nan", "inf"])
def test_a_nan_or_infinite_score_makes_the_whole_row_nan(keys, special):
    """A NaN query (NaN scores) or a key that makes a score +inf: that row's output and lse are
    NaN (softmax gives inf / inf), never zeros with lse -inf; its query's gradient and those of the
    keys and values it attends are NaN; every other row is untouched."""
    g = torch.Generator().manual_seed(1)
    q, k, v, grad_out = (torch.randn(1, 1, 16, 8, generator=g) for _ in range(4))
    lo = torch.zeros(1, 16, dtype=torch.long)
    hi = torch.full((1, 16), 16)
    hi[0, 2] = keys  # row 2 attends the first `keys` keys, the others all 16
    if special == "nan":
        q[0, 0, 2, 0] = float("nan")
    else:
        k[0, 0, 0, 0] = float("inf")  # every row's score with key 0 is +-inf: row 2's +inf,
        q[0, 0, :, 0] = -1.0  # the other rows' -inf (weight 0)
        q[0, 0, 2] = 1.0
    out, lse, dq, dk, dv = _forward_and_backward(q, k, v, lo, hi, grad_out, chunk=32)
    assert out[0, 0, 2].isnan().all() and lse[0, 0, 2].isnan()
    assert dq[0, 0, 2].isnan().all()
    for grad in (dk, dv):
        assert grad[0, 0, :keys].isnan().any(-1).all()
    others = [i for i in range(16) if i != 2]
    assert torch.isfinite(out[0, 0, others]).all() and torch.isfinite(lse[0, 0, others]).all()
    if special == "nan":
        assert torch.isfinite(dk[0, 0, keys:]).all() and torch.isfinite(dv[0, 0, keys:]).all()


@needs_native
@pytest.mark.parametrize("keys", [2, 13])
def test_scores_of_minus_inf_weigh_exactly_zero(keys):
    """Key 0's score is 0, the others' -inf (their keys hold -inf, the query 1) with values of
    1e38: the weights are exactly (1, 0, ...) (an exp of -inf that is 1e-38 instead shows as ~1 in
    the output). A row whose scores are all -inf is zeros with lse -inf; its weights of 0 still
    multiply in the gradients, as the reference backend's do (they used to be skipped, giving
    finite gradients where autograd gives NaN)."""
    q = torch.ones(1, 1, 2, 4)
    k = torch.full((1, 1, keys, 4), float("-inf"))
    k[0, 0, 0] = 0.0
    v = torch.full((1, 1, keys, 4), 1e38)
    v[0, 0, 0] = 0.5
    lo = torch.tensor([[0, 1]])
    hi = torch.tensor([[keys, keys]])  # row 1 attends only keys of score -inf
    grad_out = torch.ones(1, 1, 2, 4)
    out, lse, dq, dk, dv = _forward_and_backward(q, k, v, lo, hi, grad_out, chunk=16)
    assert torch.equal(out[0, 0, 0], torch.full((4,), 0.5)) and lse[0, 0, 0] == 0.0
    assert torch.equal(out[0, 0, 1], torch.zeros(4)) and lse[0, 0, 1] == float("-inf")
    # row 0: dq_0 = sum_j dS_0j k_j, with dS_0j = 0 for the keys of -inf: 0 * -inf is NaN (IEEE,
    # as autograd gives); dV of those keys is 0 * dO = 0; row 1 likewise, every key of -inf
    assert dq[0, 0, 0].isnan().all() == (keys > 1) and dq[0, 0, 1].isnan().all()
    assert torch.equal(dv[0, 0, 0], torch.ones(4)) and torch.equal(dv[0, 0, 1:], torch.zeros(keys - 1, 4))
