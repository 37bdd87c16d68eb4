"""attnkit's Triton kernel for interval masks (``attnkit._backends.triton``) against float64.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors, so
shapes stay tiny and blocks small (16) so that every query and key range spans several blocks:
partial blocks at both ends, blocks every row attends whole, skipped blocks, ragged last blocks.
The forward is checked against ``oracle.py`` (written without attnkit); soft-capping, ALiBi,
dropout and every gradient against :func:`reference`, the textbook formula in float64 under
autograd. Low precision follows FlashAttention's rule: the kernel's error is at most twice that of
the same formula computed in that dtype, plus a little slack.
"""

from __future__ import annotations

import importlib

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")  # conftest sets TRITON_INTERPRET and fixes the interpreter where there is no GPU

from attnkit import masks  # noqa: E402
from attnkit._backends import dropout as attnkit_dropout  # noqa: E402
from oracle import oracle_attention, oracle_lse  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"


import attnkit._backends.triton as kernel  # noqa: E402

SMALL = dict(block_m=16, block_n=16)
SMALL_BACKWARD = (16, 16, 16, 16)


def _inputs(n: int, heads: int, kv_heads: int, q_len: int, k_len: int, dim: int = 24, v_dim: int = 24,
            dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """query, key, value in the [N, L, H, D] memory layout seen as [N, H, L, D] (strided views)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, q_len, heads, dim, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(n, k_len, kv_heads, dim, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(n, k_len, kv_heads, v_dim, generator=g).to(dtype).transpose(1, 2)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)


def _allowed(lo: torch.Tensor, hi: torch.Tensor, k_len: int) -> torch.Tensor:
    """The dense boolean mask ``[S, 1, Lq, Lk]`` of intervals ``[S, R, Lq]``."""
    keys = torch.arange(k_len)
    return ((keys >= lo[..., None]) & (keys < hi[..., None])).any(1)[:, None]


def reference(q, k, v, allowed, scale, *, softcap=None, slopes=None, keep=None, p=0.0, dtype=torch.float64):
    """Attention by the definition in ``dtype`` (differentiable): ``(out, lse)``."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        q_len, k_len = s.shape[-2:]
        distance = (torch.arange(q_len)[:, None] + k_len - q_len - torch.arange(k_len)).abs()
        s = s - slopes.to(dtype).reshape(-1 if slopes.dim() == 2 else 1, s.shape[1], 1, 1) * distance.to(dtype)
    s = s.masked_fill(~allowed, float("-inf"))
    has_key = allowed.any(-1, keepdim=True).expand(*s.shape[:-1], 1)
    safe = s.masked_fill(~has_key, 0.0)
    weights = torch.softmax(safe, dim=-1).masked_fill(~has_key, 0.0)
    lse = torch.where(has_key[..., 0], torch.logsumexp(safe.float() if dtype != torch.float64 else safe, dim=-1),
                      float("-inf"))
    if keep is not None:
        weights = weights * keep / (1.0 - p)
    return weights @ v, lse


def _cpu(*tensors):
    return [t.detach().cpu().double() for t in tensors]


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5, what: str = "") -> None:
    """Within ``tol`` of float64, relative to the tensor's magnitude; non-finite entries must match."""
    actual, expected = _cpu(actual, expected)
    bound = tol * max(1.0, expected[torch.isfinite(expected)].abs().max().item() if expected.numel() else 1.0)
    torch.testing.assert_close(actual, expected, atol=bound, rtol=0.0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _check_gradients(q, k, v, lo, hi, allowed, scale, *, grad_lse: bool, dtype_tol: float = 2e-5,
                     walk: str = "checked", **options):
    """The kernel's dq, dk, dv (and forward) against float64 autograd of :func:`reference`; ``walk``:
    how the dK/dV kernel walks the query blocks."""
    out, lse = kernel.forward(q, k, v, lo, hi, scale=scale, **SMALL, **options)
    g = torch.Generator().manual_seed(7)
    grad_out = torch.randn(out.shape, generator=g).to(DEVICE, out.dtype)
    dlse = torch.randn(lse.shape, generator=g).to(DEVICE) if grad_lse else None
    dq, dk, dv = kernel.backward(grad_out, dlse, q, k, v, out, lse, lo, hi, scale=scale, blocks=SMALL_BACKWARD,
                                 walk=walk, **options)
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    slopes = options.get("alibi_slopes")
    ref_options = {"softcap": options.get("softcap"), "slopes": None if slopes is None else slopes.cpu()}
    if options.get("dropout"):
        ref_options["keep"] = attnkit_dropout.keep_mask(options["seed"].cpu(), *out.shape[:3], k.shape[2],
                                                        options["dropout"])
        ref_options["p"] = options["dropout"]
    ref_out, ref_lse = reference(*leaves, allowed, scale, **ref_options)
    ref_lse_finite = torch.where(torch.isfinite(ref_lse), ref_lse, 0.0)
    loss = (ref_out * grad_out.cpu().double()).sum()
    if grad_lse:
        loss = loss + (ref_lse_finite * dlse.cpu().double()).sum()
    expected = torch.autograd.grad(loss, leaves)
    _close(out, ref_out, what="out")
    _close(lse, ref_lse, what="lse")
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), expected):
        assert got.shape == want.shape and got.dtype == q.dtype
        _close(got, want, dtype_tol, what=name)


MASKS = {
    "causal": (lambda n: masks.causal(), 40, 40),
    "causal_short_queries": (lambda n: masks.causal(), 23, 50),
    "causal_long_queries": (lambda n: masks.causal(), 50, 23),  # the first rows see no key
    "window": (lambda n: masks.sliding_window(8) & masks.causal(), 45, 45),
    "window_two_sided": (lambda n: masks.sliding_window(6, causal=False), 37, 37),
    "sinks_and_window": (lambda n: (masks.first_keys(3) | masks.sliding_window(8)) & masks.causal(), 41, 41),
    "documents": (lambda n: masks.document(ids=torch.tensor([[0] * 20 + [1] * 17 + [2] * 5,
                                                             [0] * 3 + [1] * 30 + [2] * 9][:n])) & masks.causal(),
                  42, 42),
    "key_padding_empty_sequence": (lambda n: masks.padding([0, 5][:n]), 30, 35),
    "varlen": (lambda n: masks.varlen([17, 33][:n], [29, 12][:n]) & masks.causal(), 33, 35),
    "key_ranges_two_per_row": (lambda n: _random_ranges(n, 40, 36), 40, 36),
}


def _random_ranges(n: int, q_len: int, k_len: int) -> masks.StructuredMask:
    """Two arbitrary ranges a row per sequence (S = N, R = 2), many of them empty (lo >= hi)."""
    g = torch.Generator().manual_seed(1)
    lo1, hi1, lo2, hi2 = (torch.randint(0, k_len + 1, (n, q_len), generator=g) for _ in range(4))
    hi1[:, ::7] = lo1[:, ::7]  # rows whose first range is empty
    lo2[:, 1::3] = k_len  # rows whose second range is empty
    lo1[:, 5::11], hi1[:, 5::11], lo2[:, 5::11] = 9, 3, k_len  # rows with no key at all
    return masks.key_ranges([lo1, lo2], [hi1, hi2])


@pytest.mark.parametrize("walk", ["checked", "runs"])
@pytest.mark.parametrize("name", list(MASKS))
def test_masks_forward_and_gradients(name: str, walk: str) -> None:
    """Every mask kind, GQA 2:1, D = 24 (padded to 32), ragged lengths, strided inputs; the dK/dV
    kernel walking its query blocks either way (two random ranges a row: blocks that no row reaches
    between those that do, whole blocks apart)."""
    build, q_len, k_len = MASKS[name]
    n = 2
    mask = build(n)
    lo, hi = mask.row_ranges(q_len, k_len)
    allowed = _allowed(lo, hi, k_len)
    assert torch.equal(allowed.expand(n, 1, q_len, k_len), mask.dense(q_len, k_len).expand(n, 1, q_len, k_len))
    q, k, v = _inputs(n, 2, 1, q_len, k_len)
    scale = 24 ** -0.5
    out, lse = kernel.forward(q, k, v, lo, hi, scale=scale, **SMALL)
    expected, _ = oracle_attention(q.cpu(), k.cpu(), v.cpu(), mask=allowed, scale=scale)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    _close(out, expected, what="out")
    _close(lse, oracle_lse(q.cpu(), k.cpu(), allowed, scale), what="lse")
    empty = ~allowed.expand(n, 2, q_len, k_len).any(-1)
    assert torch.all(out.cpu()[empty] == 0) and torch.all(lse.cpu()[empty] == float("-inf"))
    _check_gradients(q, k, v, lo, hi, allowed, scale, grad_lse=True, walk=walk)


def test_the_runs_of_query_blocks_a_key_block_reaches() -> None:
    """``reached_blocks``: per key block, the first query block that reaches it, the run of whole
    blocks from the first whole one, and one past the last that reaches it; a whole block after a
    broken run is left to the masked walk (needless work, right results)."""
    from attnkit._backends.triton.inputs import block_summary, reached_blocks

    def runs(lo, hi, k_len, block_m=4, block_n=4):
        lo, hi = (torch.tensor(x)[None, None] for x in (lo, hi))
        return reached_blocks(block_summary(lo, hi, k_len, block_m), k_len, block_n)[0, 0].tolist()

    # causal over 12 rows and keys, blocks of 4: key block 0 is whole in query blocks 1-2, reached by
    # 0-2; key block 1 reached by 1-2, whole in 2; key block 2 reached (and partly) by block 2 only
    rows = list(range(12))
    assert runs([0] * 12, [i + 1 for i in rows], 12) == [[0, 1, 3, 3], [1, 2, 3, 3], [2, 3, 3, 3]]
    # whole, broken, whole: the run stops at the break; a key block no row reaches: zeros
    lo = [0] * 4 + [8] * 4 + [0] * 4
    hi = [4] * 4 + [12] * 4 + [4] * 4
    assert runs(lo, hi, 12) == [[0, 0, 1, 3], [0, 0, 0, 0], [1, 1, 2, 2]]
    # a ragged last key block is never whole: masked
    assert runs([0] * 4, [10] * 4, 10, block_m=4, block_n=8) == [[0, 0, 1, 1], [0, 1, 1, 1]]
    # nor is a ragged last query block (its rows past Lq attend nothing): the whole visits load no row past Lq
    assert runs([0] * 10, [12] * 10, 12) == [[0, 0, 2, 3]] * 3


def test_the_walk_is_checked() -> None:
    q, k, v = _inputs(1, 1, 1, 16, 16)
    lo, hi = masks.causal().row_ranges(16, 16)
    out, lse = kernel.forward(q, k, v, lo, hi, scale=0.25, **SMALL)
    with pytest.raises(ValueError, match="walk must be one of"):
        kernel.backward(torch.ones_like(out), None, q, k, v, out, lse, lo, hi, scale=0.25, walk="lists")


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_gqa_and_value_width(kv_heads: int) -> None:
    """Four query heads on one or two key/value heads, Dv != D, without grad_lse."""
    q, k, v = _inputs(1, 4, kv_heads, 33, 21, dim=20, v_dim=12, seed=3)
    lo, hi = (masks.sliding_window(10) & masks.causal()).row_ranges(33, 21)
    _check_gradients(q, k, v, lo, hi, _allowed(lo, hi, 21), 0.3, grad_lse=False)


def test_softcap_and_alibi() -> None:
    """Soft-capping then ALiBi (slopes per head and per sequence), forward and backward."""
    q, k, v = _inputs(2, 2, 1, 24, 30, dim=16, v_dim=16, seed=4)
    q = q * 3  # scores large enough that the cap bends them
    lo, hi = masks.causal().row_ranges(24, 30)
    allowed = _allowed(lo, hi, 30)
    _check_gradients(q, k, v, lo, hi, allowed, 0.25, grad_lse=True, softcap=2.0)
    slopes = torch.tensor([[0.5, 0.125], [0.25, 1.0]]).to(DEVICE)
    _check_gradients(q, k, v, lo, hi, allowed, 0.25, grad_lse=True, alibi_slopes=slopes[0])
    _check_gradients(q, k, v, lo, hi, allowed, 0.25, grad_lse=False, alibi_slopes=slopes, softcap=3.0)


@pytest.mark.parametrize("scale", [-0.4, 0.0])
def test_a_scale_of_zero_or_below(scale: float) -> None:
    """The forward takes its rows' max over the raw products only for a positive scale (then it is
    the scores' max); a negative scale turns the largest product into the smallest score."""
    q, k, v = _inputs(1, 2, 1, 37, 40, dim=16, v_dim=16, seed=13)
    lo, hi = (masks.sliding_window(20) & masks.causal()).row_ranges(37, 40)
    _check_gradients(q, k, v, lo, hi, _allowed(lo, hi, 40), scale, grad_lse=True)


def test_scores_beyond_float32s_largest_over_log2e() -> None:
    """Finite scores of 2.4e38-2.55e38, whose product with log2(e) overflows: the row's largest score
    weighs 1 and the others 0 (the scores lie ~1e36 apart), as in float64: finite outputs equal to
    the top key's value, and that score as the lse, for a plain call and for one with a modifier
    (ALiBi, slope 0: the scores then stay in natural units). The scale, 0.75, makes each score a
    rounded product: compiled, a product fused into the max's subtraction would weigh the top key
    exp(+-1e31) (common.rounded_product); the interpreter fuses nothing."""
    q_len, k_len = 5, 40
    q, k, v = _inputs(1, 1, 1, q_len, k_len, dim=16, v_dim=16, seed=14)
    q = torch.zeros_like(q)
    q[..., 0] = 1.69e19
    k = torch.zeros_like(k)
    k[..., 0] = torch.linspace(1.0e19, 2.0e19, k_len).to(DEVICE).view(1, 1, k_len)
    lo, hi = masks.causal().row_ranges(q_len, k_len)
    expected = v[0, 0, hi[0, 0].long() - 1]  # each row's last key has the largest score
    top = (q[0, 0, :, 0].cpu().double() * k[0, 0, hi[0, 0].long() - 1, 0].cpu().double() * 0.75).float()
    assert bool((top > 3.4028235e38 / 1.4426950408889634).all()) and bool(torch.isfinite(top).all())
    for options in ({}, {"alibi_slopes": torch.zeros(1).to(DEVICE)}):
        out, lse = kernel.forward(q, k, v, lo, hi, scale=0.75, **SMALL, **options)
        torch.testing.assert_close(out[0, 0], expected, atol=0, rtol=0)
        torch.testing.assert_close(lse[0, 0].cpu(), top.cpu(), atol=0, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype: torch.dtype) -> None:
    """At most twice the error of the formula computed in ``dtype``, plus 1e-4 (FlashAttention's rule)."""
    mask = (masks.first_keys(2) | masks.sliding_window(12)) & masks.causal()
    q, k, v = _inputs(1, 2, 1, 48, 48, dim=32, v_dim=32, dtype=dtype, seed=5)
    lo, hi = mask.row_ranges(48, 48)
    allowed = _allowed(lo, hi, 48)
    out, lse = kernel.forward(q, k, v, lo, hi, scale=32 ** -0.5, **SMALL)
    assert out.dtype == dtype and lse.dtype == torch.float32
    exact, _ = oracle_attention(q.cpu(), k.cpu(), v.cpu(), mask=allowed, scale=32 ** -0.5)
    rounded, _ = oracle_attention(q.cpu(), k.cpu(), v.cpu(), mask=allowed, scale=32 ** -0.5, dtype=dtype)
    error = (out.cpu().double() - exact).abs().max().item()
    assert error <= 2 * (rounded.double() - exact).abs().max().item() + 1e-4

    g = torch.Generator().manual_seed(8)
    grad_out = torch.randn(out.shape, generator=g).to(DEVICE, dtype)
    grads = kernel.backward(grad_out, None, q, k, v, out, lse, lo, hi, scale=32 ** -0.5, blocks=SMALL_BACKWARD)
    for work in (torch.float64, dtype):
        leaves = [t.detach().cpu().to(work).requires_grad_() for t in (q, k, v)]
        ref_out, _ = reference(*leaves, allowed, 32 ** -0.5, dtype=work)
        wanted = torch.autograd.grad((ref_out * grad_out.cpu().to(work)).sum(), leaves)
        if work == torch.float64:
            exact_grads = wanted
        else:
            for got, low, want in zip(grads, wanted, exact_grads):
                assert got.dtype == dtype
                baseline = (low.double() - want).abs().max().item()
                assert (got.cpu().double() - want).abs().max().item() <= 2 * baseline + 1e-4


def test_dropout_pattern_is_attnkits() -> None:
    """The kept weights are exactly attnkit's hash pattern, bit for bit, also with position offsets:
    zero queries weigh every key 1 / Lk and an identity value reads the weights out one by one."""
    n, heads, q_len, k_len = 2, 2, 20, 32
    q = torch.zeros(n, heads, q_len, 16, device=DEVICE)
    k = torch.randn(n, 1, k_len, 16, device=DEVICE)
    v = torch.eye(k_len, device=DEVICE).expand(n, 1, k_len, k_len)
    lo = torch.zeros(1, 1, q_len, dtype=torch.int64)
    hi = torch.full_like(lo, k_len)
    seed = torch.tensor(0x7EDCBA9876543210, dtype=torch.int64)
    for offsets in (None, (1, 3, 5)):
        s = seed if offsets is None else attnkit_dropout.at_positions(seed, *offsets)
        out, _ = kernel.forward(q, k, v, lo, hi, scale=1.0, dropout=0.3, seed=s.to(DEVICE), **SMALL)
        expected = attnkit_dropout.keep_mask(s, n, heads, q_len, k_len, 0.3)
        assert torch.equal(out.cpu() > 0, expected)
        assert 0.5 < expected.float().mean() < 0.9
        torch.testing.assert_close(out.cpu()[expected], torch.full_like(out.cpu()[expected], 1 / (0.7 * k_len)))


def test_dropout_forward_and_gradients() -> None:
    """Dropout under a mask, GQA: output and gradients of the weights with attnkit's keep mask."""
    q, k, v = _inputs(1, 4, 2, 30, 30, dim=16, v_dim=16, seed=6)
    lo, hi = (masks.sliding_window(9) & masks.causal()).row_ranges(30, 30)
    seed = torch.tensor(123456789012345, dtype=torch.int64, device=DEVICE)
    _check_gradients(q, k, v, lo, hi, _allowed(lo, hi, 30), 0.25, grad_lse=True, dropout=0.25, seed=seed)


def test_partial_block_is_masked() -> None:
    """Rows that all reach a block but one of them misses its last key: the block must be masked.
    Treating it as fully attended (from the smallest lo and the largest hi of the block's rows,
    say) would let row 3 see key 31; rows past Lq in the last block must not spoil the full ones."""
    q_len, k_len = 20, 32
    lo = torch.zeros(1, 1, q_len, dtype=torch.int64)
    hi = torch.full_like(lo, k_len)
    hi[0, 0, 3] = 31
    lo[0, 0, 18] = 1
    q, k, v = _inputs(1, 1, 1, q_len, k_len, dim=16, v_dim=16, seed=9)
    allowed = _allowed(lo, hi, k_len)
    out, lse = kernel.forward(q, k, v, lo, hi, scale=0.5, **SMALL)
    _close(out, oracle_attention(q.cpu(), k.cpu(), v.cpu(), mask=allowed, scale=0.5)[0], what="out")
    _close(lse, oracle_lse(q.cpu(), k.cpu(), allowed, 0.5), what="lse")
    _check_gradients(q, k, v, lo, hi, allowed, 0.5, grad_lse=True)


def test_nan_in_masked_out_pairs_stays_out() -> None:
    """NaN in padded keys, values and queries (never attended): finite results, equal to the call
    with zeros there, and zero gradients for the padding."""
    n, q_len, k_len = 2, 30, 40
    mask = masks.varlen([30, 19], [37, 21]) & masks.causal()
    lo, hi = mask.row_ranges(q_len, k_len)
    q, k, v = _inputs(n, 2, 1, q_len, k_len, dim=16, v_dim=16, seed=10)
    clean = [t.clone() for t in (q, k, v)]
    for t, (sequence, start) in zip((q, k, v), ((1, 19), (1, 21), (1, 21))):
        t[sequence, :, start:] = float("nan")
    out, lse = kernel.forward(q, k, v, lo, hi, scale=0.25, **SMALL)
    want_out, want_lse = kernel.forward(*clean, lo, hi, scale=0.25, **SMALL)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    grad_out = torch.ones_like(out)
    dq, dk, dv = kernel.backward(grad_out, None, q, k, v, out, lse, lo, hi, scale=0.25, blocks=SMALL_BACKWARD)
    want = kernel.backward(grad_out, None, *clean, want_out, want_lse, lo, hi, scale=0.25, blocks=SMALL_BACKWARD)
    for got, expected in zip((dq, dk, dv), want):
        assert torch.isfinite(got).all() and torch.equal(got, expected)
    assert torch.all(dq[1, :, 19:] == 0) and torch.all(dk[1, :, 21:] == 0) and torch.all(dv[1, :, 21:] == 0)


def test_nan_in_attended_pairs_propagates() -> None:
    """A NaN key makes exactly the rows that attend it NaN (its block's other rows stay finite)."""
    q_len = k_len = 40
    q, k, v = _inputs(1, 1, 1, q_len, k_len, dim=16, v_dim=16, seed=11)
    k[0, 0, 5, 3] = float("nan")
    lo, hi = (masks.sliding_window(12) & masks.causal()).row_ranges(q_len, k_len)
    out, lse = (t.cpu() for t in kernel.forward(q, k, v, lo, hi, scale=0.25, **SMALL))
    attends = (lo[0, 0] <= 5) & (5 < hi[0, 0])
    assert torch.isnan(out[0, 0][attends]).all() and torch.isnan(lse[0, 0][attends]).all()
    assert torch.isfinite(out[0, 0][~attends]).all() and torch.isfinite(lse[0, 0][~attends]).all()


def test_non_finite_values_in_partial_blocks_reach_only_the_rows_that_attend_them() -> None:
    """NaN, +inf and -inf values of keys attended by part of a block, with two ranges a row, GQA,
    soft-capping, ALiBi and dropout: the kernel alone (no check after it) gives the NaN / inf
    pattern and the finite values of the pairwise definition (:func:`blockwise.dense_attention`,
    which never multiplies a masked pair), in blocks every row attends and in partial ones alike."""
    from attnkit._backends import blockwise

    n, heads, kv_heads, length = 1, 2, 1, 40
    mask = (masks.first_keys(3) | masks.sliding_window(10)) & masks.causal()
    lo, hi = mask.row_ranges(length, length)
    q, k, v = _inputs(n, heads, kv_heads, length, length, dim=16, v_dim=16, seed=12)
    v[0, 0, 7, 3] = float("inf")   # rows 7..16 attend key 7, in blocks they share with rows that do not
    v[0, 0, 20, 0] = float("nan")
    v[0, 0, 30, 5], v[0, 0, 31, 5] = float("inf"), float("-inf")  # both signs in one column: NaN where both
    v[0, 0, 1, 2] = float("-inf")  # a first key: every row attends it, through the second range too
    slopes = torch.tensor([0.5, 0.25])
    seed = torch.tensor(987654321, dtype=torch.int64)
    options = dict(scale=0.3, softcap=2.0, dropout=0.2)
    out, lse = kernel.forward(q, k, v, lo, hi, alibi_slopes=slopes.to(DEVICE), seed=seed.to(DEVICE), **options,
                              **SMALL)
    want, want_lse, _ = blockwise.dense_attention(*(t.cpu().double() for t in (q, k, v)), lo, hi, None, 0.3, 0.2,
                                                  seed, exact=True, softcap=2.0, alibi=slopes.double())
    assert torch.isinf(want).any() and torch.isnan(want).any() and torch.isfinite(want).any()
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(test(out.cpu()), test(want)), test.__name__
    finite = torch.isfinite(want)
    torch.testing.assert_close(out.cpu().double()[finite], want[finite], atol=2e-5, rtol=0)
    torch.testing.assert_close(lse.cpu().double(), want_lse, atol=2e-5, rtol=0)


def test_a_nan_value_between_the_rows_ranges_stays_out() -> None:
    """The kernels load a partly attended block's values over the hull of its rows' ranges
    (``common.key_hull``): a key in a gap between them, which no row attends, holding NaN reaches
    the block's products, and the forward's second pass must find it there and redo those rows."""
    length = 32
    rows = torch.arange(length)
    lo = torch.where(rows < 8, 0, torch.where(rows < 16, 10, 16))[None, None]
    hi = torch.where(rows < 8, 4, torch.where(rows < 16, 16, 32))[None, None]
    q, k, v = _inputs(1, 2, 1, length, length, dim=16, v_dim=16, seed=16)
    v[0, 0, 6, 2] = float("nan")  # key 6: inside rows 0-15's hull [0, 16), attended by none
    from attnkit._backends import blockwise

    assert not bool(_allowed(lo, hi, length)[..., 6].any())
    # the pairwise definition: a masked pair is never multiplied
    want, want_lse, _ = blockwise.dense_attention(*(t.cpu().double() for t in (q, k, v)), lo, hi, None, 0.25, 0.0,
                                                  None, exact=True)
    assert bool(torch.isfinite(want).all())
    for second_pass in ("gated", "inline"):
        prep = kernel.prepare(q, k, v, lo.to(DEVICE), hi.to(DEVICE), scale=0.25, softcap=None, alibi_slopes=None,
                              dropout=0.0, seed=None)
        out, lse = importlib.import_module("attnkit._backends.triton.forward").launch(prep, 16, 16, 4, 1,
                                                                                      second_pass=second_pass)
        assert bool(torch.isfinite(out).all()), second_pass
        _close(out, want, what=f"out, {second_pass}")
        _close(lse, want_lse, what=f"lse, {second_pass}")


@pytest.mark.parametrize("poison", ["none", "partial blocks", "padding only"])
def test_the_gated_second_pass_gives_the_inline_passs_bits(poison: str) -> None:
    """``second_pass="gated"`` runs the kernel without the pass, then a second launch that redoes
    only the programs whose partly attended blocks hold a NaN or inf value: the same bits as the
    pass compiled in, with clean values, with such values where part of a block attends them (where
    the kernel without any pass differs), and with NaN only in keys no row attends."""
    import importlib

    forward = importlib.import_module("attnkit._backends.triton.forward")
    n, heads, kv_heads, length = 2, 2, 1, 40
    mask = (masks.first_keys(3) | masks.sliding_window(10)) & masks.causal() & masks.padding([40, 33])
    lo, hi = mask.row_ranges(length, length)
    q, k, v = _inputs(n, heads, kv_heads, length, length, dim=16, v_dim=16, seed=21)
    if poison == "partial blocks":
        v[0, 0, 7, 3], v[1, 0, 20, 0] = float("inf"), float("nan")
    elif poison == "padding only":
        v[1, 0, 35:] = float("nan")  # keys 33.. of the second sequence are padding
    prep = kernel.prepare(q, k, v, lo, hi, scale=0.3, softcap=2.0, alibi_slopes=None, dropout=0.2,
                          seed=torch.tensor(4242, dtype=torch.int64, device=DEVICE))
    inline = forward.launch(prep, 16, 16, 4, 1, second_pass="inline")
    gated = forward.launch(prep, 16, 16, 4, 1, second_pass="gated")
    off = forward.launch(prep, 16, 16, 4, 1, second_pass="off")
    for got, want in zip(gated, inline):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    leaked = not torch.equal(off[0].isnan(), inline[0].isnan()) or not torch.equal(off[0].nan_to_num(),
                                                                                 inline[0].nan_to_num())
    assert leaked == (poison == "partial blocks")
    with pytest.raises(ValueError, match="second_pass"):
        forward.launch(prep, 16, 16, 4, 1, second_pass=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tma_loads_give_the_pointer_loads_results(dtype: torch.dtype) -> None:
    """``loads="tma"`` (key and value tiles of the blocks every row attends whole through the copy
    engine's descriptors, which fill keys past Lk and features past D with zeros) gives what the
    pointer loads give, on the mask kinds, GQA, widths that are not powers of two, strided inputs,
    soft-capping with ALiBi and dropout, and NaN and inf values where part of a block attends them:
    the same bits in half precision (exact products), float32's sums in another order. Layouts the
    engine cannot take (rows 8 bytes apart) fall back to the pointers."""
    forward = importlib.import_module("attnkit._backends.triton.forward")

    def same(got, want):
        assert torch.equal(got.isnan(), want.isnan())
        if dtype == torch.float32:
            torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(got.nan_to_num(), want.nan_to_num())

    # six mask kinds in bfloat16, two in the other dtypes (the interpreter's time)
    names = ["key_ranges_two_per_row", "padding"]  # padding: whole blocks in every dtype
    if dtype == torch.bfloat16:
        names += ["causal_long_queries", "window", "documents", "key_padding_empty_sequence"]
    cases = [(name, 24, 24, {}) for name in names]
    cases += [("documents", 40, 16, dict(softcap=2.0, alibi_slopes=torch.tensor([0.5, 0.25]), dropout=0.3,
                                         seed=torch.tensor(77, dtype=torch.int64))),
              ("causal", 4 if dtype != torch.float32 else 2, 8, {})]  # 8-byte key rows: no descriptor
    padded = (lambda n: masks.padding([35, 20][:n]), 40, 35)
    for index, (name, dim, v_dim, options) in enumerate(cases):
        build, q_len, k_len = padded if name == "padding" else MASKS[name]
        lo, hi = build(2).row_ranges(q_len, k_len)
        q, k, v = _inputs(2, 2, 1, q_len, k_len, dim=dim, v_dim=v_dim, dtype=dtype, seed=30 + index)
        if not options and index % 2 == 0:
            v[0, 0, k_len // 2, 0], v[1, 0, 3, v_dim - 1] = float("nan"), float("inf")
        options = {key: value.to(DEVICE) if torch.is_tensor(value) else value for key, value in options.items()}
        prep = kernel.prepare(q, k, v, lo.to(DEVICE), hi.to(DEVICE), scale=dim ** -0.5,
                              **{"softcap": None, "alibi_slopes": None, "dropout": 0.0, "seed": None, **options})
        assert (forward.tma_descriptors(prep, 16) is None) == (dim * dtype.itemsize < 16), name
        # "off": the kernel without the redo (partial blocks load by pointers either way, so their leak is
        # the same); the gated redo launch, which takes the descriptors too, once (slow here)
        for second_pass in ("off", "gated") if name == "window" else ("off",):
            want = forward.launch(prep, 16, 16, 4, 1, second_pass=second_pass)
            got = forward.launch(prep, 16, 16, 4, 1, second_pass=second_pass, loads="tma")
            for a, b in zip(got, want):
                same(a, b)
    with pytest.raises(ValueError, match="loads"):
        forward.launch(prep, 16, 16, 4, 1, loads="bulk")


def test_a_dropped_nan_weight_stays_nan() -> None:
    """Dropout multiplies the weights by 0 or ``1 / (1 - p)``, so a NaN weight that is dropped is
    still NaN in ``dV = P^T dO``, as the definition (``weights * keep``) has it; selecting 0 for it
    would hide the NaN query from the keys its row attends."""
    from attnkit._backends import blockwise

    lo, hi = (masks.sliding_window(10) & masks.causal()).row_ranges(32, 32)
    q, k, v = _inputs(1, 1, 1, 32, 32, dim=16, v_dim=16, seed=15)
    q[0, 0, 20, 3] = float("nan")  # row 20 attends keys 11..20, about half of its pairs dropped
    seed = torch.tensor(13579, dtype=torch.int64)
    out, lse = kernel.forward(q, k, v, lo, hi, scale=0.25, dropout=0.5, seed=seed.to(DEVICE), **SMALL)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(16))
    _, _, dv = kernel.backward(grad_out.to(DEVICE), None, q, k, v, out, lse, lo, hi, scale=0.25, dropout=0.5,
                               seed=seed.to(DEVICE), blocks=SMALL_BACKWARD)
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    want, _, _ = blockwise.dense_attention(*leaves, lo, hi, None, 0.25, 0.5, seed, exact=True)
    want_dv = torch.autograd.grad((want * grad_out.double()).sum(), leaves[2])[0]
    assert torch.isnan(want_dv[0, 0, 11:21]).all() and not torch.isnan(want_dv[0, 0, :11]).any()
    assert torch.equal(torch.isnan(dv.cpu()), torch.isnan(want_dv))


def test_importing_attnkit_does_not_import_triton() -> None:
    """Triton is optional: attnkit never imports it, and this package says what is missing."""
    script = ("import sys, attnkit, attnkit._backends\n"
              "assert 'triton' not in sys.modules, 'attnkit imported triton'\n"
              "sys.modules['triton'] = None\n"
              "try:\n    import attnkit._backends.triton\nexcept ImportError as error:\n"
              "    assert 'pip install triton' in str(error), error\nelse:\n    raise SystemExit('no ImportError')\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_blocks(dtype: torch.dtype) -> None:
    """The GPU's default tile sizes (larger than these sequences) give the same results."""
    q, k, v = _inputs(1, 2, 1, 37, 45, dim=16, v_dim=16, dtype=dtype, seed=12)
    lo, hi = (masks.sliding_window(20) & masks.causal()).row_ranges(37, 45)
    out, lse = kernel.forward(q, k, v, lo, hi, scale=0.25)
    small_out, small_lse = kernel.forward(q, k, v, lo, hi, scale=0.25, **SMALL)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, small_out, atol=tol, rtol=0)
    torch.testing.assert_close(lse, small_lse, atol=1e-5, rtol=0)
    grad_out = torch.ones_like(out)
    grads = kernel.backward(grad_out, None, q, k, v, out, lse, lo, hi, scale=0.25)
    small = kernel.backward(grad_out, None, q, k, v, out, lse, lo, hi, scale=0.25, blocks=SMALL_BACKWARD)
    for got, want in zip(grads, small):
        torch.testing.assert_close(got, want, atol=tol, rtol=0)


def test_what_the_bounds_give_is_kept_while_the_same_tensors_come_back() -> None:
    """The int32 bounds and the backward's block summaries are built once per pair of bound tensors
    (inputs.derived_from): the same pair again finds them; the pair modified in place, or another
    pair with the same values, builds them anew, and every result follows the bounds it was given."""
    inputs = kernel.inputs
    n, heads, length, scale = 1, 2, 40, 24 ** -0.5
    q, k, v = _inputs(n, heads, 1, length, length, seed=31)
    lo, hi = (t.to(DEVICE) for t in masks.sliding_window(5).row_ranges(length, length))

    def run():
        prep = inputs.prepare(q, k, v, lo, hi, scale=scale, softcap=None, alibi_slopes=None, dropout=0.0, seed=None)
        out, lse = kernel.forward(q, k, v, lo, hi, scale=scale, **SMALL)
        grad_out = torch.ones_like(out)
        grads = kernel.backward(grad_out, None, q, k, v, out, lse, lo, hi, scale=scale, blocks=SMALL_BACKWARD)
        return prep, out, grads

    first, out, grads = run()
    again, out_again, grads_again = run()
    assert again.lo is first.lo and again.hi is first.hi and again.seed is first.seed
    kept = inputs.derived_from(first.lo, first.hi)
    assert any(what[0] == "reached" for what in kept)  # the backward's summaries of those bounds
    assert torch.equal(out, out_again) and all(torch.equal(a, b) for a, b in zip(grads, grads_again))

    lo.clamp_(max=0)  # in place: every row now attends keys 0 .. hi, a different mask
    changed, out_changed, _ = run()
    assert changed.lo is not first.lo and int(changed.lo.max()) == 0
    allowed = _allowed(lo.cpu(), hi.cpu(), length)
    _close(out_changed, reference(q, k, v, allowed, scale)[0], what="after the bounds changed in place")

    copies = lo.clone(), hi.clone()  # equal values, other tensors: built for them, not found
    other = inputs.prepare(q, k, v, *copies, scale=scale, softcap=None, alibi_slopes=None, dropout=0.0, seed=None)
    assert other.lo is not changed.lo and torch.equal(other.lo, changed.lo)


def test_bounds_made_under_inference_mode_are_used_without_being_kept() -> None:
    """Inference tensors keep no version counter (reading it raises), so nothing is kept for them."""
    n, heads, length = 1, 2, 24
    q, k, v = _inputs(n, heads, 2, length, length, seed=32)
    with torch.inference_mode():
        lo, hi = (t.to(DEVICE) for t in masks.sliding_window(4).row_ranges(length, length))
        out, _ = kernel.forward(q, k, v, lo, hi, scale=0.2, **SMALL)
    assert kernel.inputs.derived_from(lo, hi) is None
    _close(out, reference(q, k, v, _allowed(lo.cpu(), hi.cpu(), length), 0.2)[0])


def test_keys_whose_rows_lie_far_apart_are_copied_contiguous() -> None:
    """The kernels place a key block's tiles by int32 offsets; keys and values whose rows lie
    ``inputs.ROW_STRIDE_LIMIT`` elements apart or more are copied contiguous first (with rows 2^22
    apart, 64 of them would pass 2^31), and give the same results."""
    from attnkit._backends.triton import inputs

    q, k, v = _inputs(1, 1, 1, 3, 3, dim=16, v_dim=16, seed=17)
    gap = inputs.ROW_STRIDE_LIMIT + 16
    far = torch.zeros(3 * gap, device=DEVICE)
    far_k = far.as_strided((1, 1, 3, 16), (3 * gap, 3 * gap, gap, 1))
    far_k.copy_(k)
    lo, hi = masks.causal().row_ranges(3, 3)
    prep = kernel.prepare(q, far_k, v, lo.to(DEVICE), hi.to(DEVICE), scale=0.25, softcap=None, alibi_slopes=None,
                          dropout=0.0, seed=None)
    assert prep.key.is_contiguous() and prep.value is v
    out, lse = kernel.forward(q, far_k, v, lo, hi, scale=0.25, **SMALL)
    want, want_lse = kernel.forward(q, k.contiguous(), v, lo, hi, scale=0.25, **SMALL)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
