"""The FlexAttention engine (attnkit._backends.flex): block masks built from intervals against
``create_block_mask`` (the same skipped / partial / full blocks), the mask_mods against the masks'
dense form as a block-sparse kernel applies them, and attention against a float64 reference
(GQA, soft-capping, ALiBi, sinks, lse, rows with no key, gradients, bf16 by FlashAttention's rule).

On the CPU FlexAttention runs eagerly: it applies ``mask_mod`` everywhere and ignores the block
classification, so the block tests here are what guards it; the kernels that skip blocks run on
the GPU (``test_cuda_compiled``, skipped without one).
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor
from torch.nn.attention import flex_attention as flex_api
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

import attnkit
from attnkit import masks
from attnkit._backends import flex
from attnkit._backends.tiled_plan import intervals
from oracle import oracle_attention, oracle_lse

pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.usefixtures("one_thread")]  # tiny problems (conftest.one_thread)

#: (Lq, Lk, block size): lengths that are and are not multiples of the blocks, Lq < Lk and Lq > Lk,
#: square and (query block, key block) blocks
SHAPES = [(64, 64, 16), (100, 100, (32, 16)), (37, 100, 16), (100, 45, (32, 16)), (100, 45, 16)]


def _key_ranges(q_len: int, k_len: int, two: bool) -> masks.StructuredMask:
    """Random rows, with gaps between neighbours' ranges (blocks in the gaps must be skipped)."""
    g = torch.Generator().manual_seed(q_len * 1000 + k_len)
    lo = torch.randint(0, k_len, (q_len,), generator=g)
    hi = lo + torch.randint(0, 12, (q_len,), generator=g)
    if not two:
        return masks.key_ranges(lo, hi)
    lo2 = torch.randint(0, k_len, (q_len,), generator=g)
    return masks.key_ranges([lo, lo2], [hi, lo2 + torch.randint(0, 30, (q_len,), generator=g)])


def _key_ranges_with_empty_rows(q_len: int, k_len: int) -> masks.StructuredMask:
    """The random rows of :func:`_key_ranges`, but the first 32 rows empty, as ``lo == hi`` or
    ``lo > hi`` off the block boundaries (an empty range touches no block: rounding its ends out
    to blocks must not make one)."""
    g = torch.Generator().manual_seed(q_len + k_len)
    lo = torch.randint(0, k_len, (q_len,), generator=g)
    hi = lo + torch.randint(0, 12, (q_len,), generator=g)
    rows = min(32, q_len)
    lo[:rows] = torch.arange(rows) % 7 + 3
    hi[:rows] = lo[:rows] - torch.arange(rows) % 3  # equal, or below
    return masks.key_ranges(lo, hi)


def _document_ids(q_len: int, k_len: int) -> masks.StructuredMask:
    """Two sequences packed differently ([2, T]), T = Lk: per-sequence block masks (S = 2)."""
    cut = [min(10, k_len), max(k_len - 7, 0)]
    ids = torch.stack([torch.arange(k_len) // 23, (torch.arange(k_len)[:, None] >= torch.tensor(cut)).sum(1)])
    return masks.document(ids=ids)


# name -> (mask for (Lq, Lk), causal=True folded in by the call)
CASES = {
    "full": (lambda q, k: None, False),
    "causal": (lambda q, k: masks.causal(), False),
    "causal_flag": (lambda q, k: None, True),
    "window": (lambda q, k: masks.sliding_window(16), False),
    "window_left_right": (lambda q, k: masks.sliding_window(5, 9), False),
    "window_left_only": (lambda q, k: masks.sliding_window(7, -1), True),
    "document": (lambda q, k: masks.document([30, 1, 50, 19]), False),
    "document_causal": (lambda q, k: masks.document([20, 0, 41, 39]), True),
    "document_short": (lambda q, k: masks.document([20, 0, 30]), False),  # T = 50: later positions in none
    "document_ids": (_document_ids, False),
    "document_window": (lambda q, k: masks.document([40, 60]) & masks.sliding_window(8), False),
    "prefix_lm": (lambda q, k: masks.prefix_lm(20), False),
    "prefix_lm_per_sequence": (lambda q, k: masks.prefix_lm([10, 60]), False),
    "padding": (lambda q, k: masks.padding([k - 30, k]), False),
    "first_keys_or_window": (lambda q, k: masks.first_keys(4) | masks.sliding_window(16), False),
    "key_ranges": (lambda q, k: _key_ranges(q, k, two=False), False),
    "key_ranges_two": (lambda q, k: _key_ranges(q, k, two=True), False),
    "key_ranges_with_empty_rows": (_key_ranges_with_empty_rows, False),
    "varlen": (lambda q, k: masks.varlen([q // 2, q], [k - 5, k]) & masks.causal(), False),
}
#: The cases mask_mod_for answers with its arithmetic rule (the others read the intervals).
RULES = {"full", "causal", "causal_flag", "window", "window_left_right", "window_left_only", "document",
         "document_causal", "document_short", "document_ids", "document_window"}


def _case(name: str, q_len: int, k_len: int) -> tuple[masks.StructuredMask | None, bool, Tensor, Tensor]:
    make, causal_too = CASES[name]
    structure = make(q_len, k_len)
    lo, hi = intervals(structure, causal_too, q_len, k_len)
    return structure, causal_too, lo, hi



def _dense(structure: masks.StructuredMask | None, causal_too: bool, q_len: int, k_len: int) -> Tensor:
    """``[S, Lq, Lk]`` from the mask's own dense form (not from the intervals this module reads)."""
    mask = structure & masks.causal() if causal_too and structure is not None else (
        masks.causal() if causal_too else structure)
    if mask is None:
        return torch.ones(1, q_len, k_len, dtype=torch.bool)
    return mask.dense(q_len, k_len, ndim=3).reshape(-1, q_len, k_len)


def _dense_mask_mod(dense: Tensor):
    if dense.shape[0] == 1:
        return lambda b, h, q, kv: dense[0, q, kv]
    return lambda b, h, q, kv: dense[b, q, kv]


def _codes(num: Tensor, indices: Tensor, columns: int) -> Tensor:
    """The listed blocks of FlexAttention's ``(num [S, 1, rows], indices [S, 1, rows, cols])`` as
    booleans ``[S, rows, columns]``; only the first ``num`` indices of a row count."""
    listed = torch.arange(indices.shape[-1]) < num[..., None]
    dense = torch.zeros(*indices.shape[:-1], columns + 1, dtype=torch.bool)
    dense.scatter_(-1, torch.where(listed, indices.long(), columns), True)
    return dense[:, 0, :, :columns]


def _classes(bm: BlockMask) -> Tensor:
    """Per (query block, key block): 0 skipped, 1 partial, 2 full; ``[S, nq, nk]``."""
    nk = bm.kv_indices.shape[-1]
    return (_codes(bm.kv_num_blocks, bm.kv_indices, nk).int()
            + 2 * _codes(bm.full_kv_num_blocks, bm.full_kv_indices, nk).int())


def _q_classes(bm: BlockMask) -> Tensor:
    """The same from the transposed (backward) tables, ``[S, nk, nq]``."""
    nq = bm.q_indices.shape[-1]
    return (_codes(bm.q_num_blocks, bm.q_indices, nq).int()
            + 2 * _codes(bm.full_q_num_blocks, bm.full_q_indices, nq).int())


def _as_a_kernel_applies(bm: BlockMask, sequences: int) -> Tensor:
    """``[S, Lq, Lk]``: what a block-sparse kernel attends: every pair of a full block, the pairs
    ``mask_mod`` allows in a partial block, nothing elsewhere."""
    q_len, k_len = bm.seq_lengths
    q_block, k_block = bm.BLOCK_SIZE
    classes = _classes(bm).expand(sequences, -1, -1)
    per_pair = classes.repeat_interleave(q_block, 1).repeat_interleave(k_block, 2)[:, :q_len, :k_len]
    evaluated = create_mask(bm.mask_mod, sequences, 1, q_len, k_len, device="cpu")[:, 0]
    return (per_pair == 2) | ((per_pair == 1) & evaluated)


# -- the block mask --------------------------------------------------------------------------------


@pytest.mark.parametrize("q_len,k_len,block_size", SHAPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_block_mask_matches_create_block_mask(name, q_len, k_len, block_size):
    structure, causal_too, lo, hi = _case(name, q_len, k_len)
    dense = _dense(structure, causal_too, q_len, k_len)
    expected = create_block_mask(_dense_mask_mod(dense), dense.shape[0], 1, q_len, k_len, device="cpu",
                                 BLOCK_SIZE=block_size)
    mask_mod = flex.mask_mod_for(structure, causal_too, q_len, k_len, lo, hi)
    got = flex.block_mask_from_bounds(lo, hi, q_len, k_len, block_size=block_size, mask_mod=mask_mod)

    assert got.seq_lengths == (q_len, k_len) and got.BLOCK_SIZE == expected.BLOCK_SIZE
    assert got.kv_indices.shape == (lo.shape[0], 1, *expected.kv_indices.shape[2:])
    assert torch.equal(_classes(got), _classes(expected).expand_as(_classes(got)))
    assert torch.equal(_q_classes(got), _q_classes(expected).expand_as(_q_classes(got)))
    for field in ("kv_num_blocks", "full_kv_num_blocks"):
        assert getattr(got, field).dtype == torch.int32
        assert torch.equal(getattr(got, field), getattr(expected, field).expand_as(getattr(got, field)))
    # the listed blocks themselves, in flex's order (ascending key block)
    for num, ind, ref_ind in [(got.kv_num_blocks, got.kv_indices, expected.kv_indices),
                              (got.full_kv_num_blocks, got.full_kv_indices, expected.full_kv_indices)]:
        ref_ind = ref_ind.expand_as(ind)
        listed = torch.arange(ind.shape[-1]) < num[..., None]
        assert torch.equal(torch.where(listed, ind, -1), torch.where(listed, ref_ind, -1))
    # mask_mod_for (rule or intervals) and the blocks together give exactly the mask
    assert torch.equal(_as_a_kernel_applies(got, dense.shape[0]), dense.expand(lo.shape[0], -1, -1))
    assert mask_mod.__name__ == ("rule_mask" if name in RULES else "interval_mask")


@st.composite
def _any_intervals(draw):
    """Arbitrary rows: S sequences, R = 1 or 2 ranges a row, bounds anywhere in [-3, Lk + 3] (empty
    ranges as lo == hi or lo > hi, off and on block boundaries), blocks square or not."""
    q_len, k_len = draw(st.integers(1, 90)), draw(st.integers(1, 90))
    sequences, ranges = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    lo = torch.randint(-3, k_len + 4, (sequences, ranges, q_len), generator=g)
    hi = lo + torch.randint(-4, k_len + 1, (sequences, ranges, q_len), generator=g)
    if ranges == 2:  # disjoint: the second range starts where the first ends, or later
        lo[:, 1] = torch.maximum(lo[:, 1], hi[:, 0].clamp(min=lo[:, 0]))
    block_size = draw(st.sampled_from([16, 32, (16, 32), (32, 16)]))
    return lo, hi, q_len, k_len, block_size


@given(_any_intervals())
def test_block_mask_of_any_intervals_matches_create_block_mask(case):
    """The block classes from the intervals alone equal create_block_mask's over the dense mask, for
    rows with any bounds (an empty range once made a key block partial: lo = hi = 5 rounded out to
    key block 0)."""
    lo, hi, q_len, k_len, block_size = case
    keys = torch.arange(k_len)
    dense = ((keys >= lo[..., None]) & (keys < hi[..., None])).any(1)  # [S, Lq, Lk]
    expected = create_block_mask(_dense_mask_mod(dense), dense.shape[0], 1, q_len, k_len, device="cpu",
                                 BLOCK_SIZE=block_size)
    got = flex.block_mask_from_bounds(lo, hi, q_len, k_len, block_size=block_size)
    assert torch.equal(_classes(got), _classes(expected).expand_as(_classes(got)))
    assert torch.equal(_q_classes(got), _q_classes(expected).expand_as(_q_classes(got)))
    assert torch.equal(_as_a_kernel_applies(got, dense.shape[0]), dense)


@pytest.mark.parametrize("name", ["causal", "document_ids", "first_keys_or_window", "key_ranges_two", "varlen"])
def test_interval_mask_mod_gives_the_mask(name):
    q_len, k_len = 100, 45
    structure, causal_too, lo, hi = _case(name, q_len, k_len)
    got = flex.block_mask_from_bounds(lo, hi, q_len, k_len, block_size=16)  # default: interval_mask_mod
    assert got.mask_mod.__name__ == "interval_mask"
    dense = _dense(structure, causal_too, q_len, k_len)
    assert torch.equal(_as_a_kernel_applies(got, lo.shape[0]), dense.expand(lo.shape[0], -1, -1))


def test_checks_catch_a_wrongly_classified_block():
    """The comparisons above fail on a partial block marked full, or a partial block dropped."""
    q_len = k_len = 100
    _, _, lo, hi = _case("causal", q_len, k_len)
    good = flex.block_mask_from_bounds(lo, hi, q_len, k_len, block_size=16)
    dense = _dense(masks.causal(), False, q_len, k_len)
    assert torch.equal(_as_a_kernel_applies(good, 1), dense)
    classes = _classes(good)
    assert classes[0, 2, 2] == 1  # a diagonal block: partial

    def rebuilt(new: Tensor) -> BlockMask:
        def ordered(blocks):
            d = blocks.int()[:, None]
            return d.sum(-1, dtype=torch.int32), torch.argsort(d, dim=-1, descending=True, stable=True).int()
        return BlockMask.from_kv_blocks(*ordered(new == 1), *ordered(new == 2), BLOCK_SIZE=16,
                                        mask_mod=good.mask_mod, seq_lengths=(q_len, k_len))

    marked_full, dropped = classes.clone(), classes.clone()
    marked_full[0, 2, 2], dropped[0, 2, 2] = 2, 0
    for wrong in (rebuilt(marked_full), rebuilt(dropped)):
        assert not torch.equal(_as_a_kernel_applies(wrong, 1), dense)
        reference = create_block_mask(_dense_mask_mod(dense), 1, 1, q_len, k_len, device="cpu", BLOCK_SIZE=16)
        assert not torch.equal(_classes(wrong), _classes(reference))


def test_block_mask_never_evaluates_the_mask_mod_and_scales():
    """Built from the intervals alone: a mask_mod that may not be called, at a length whose dense
    mask would hold 2**32 pairs; causal gives the diagonal partial and everything below it full."""
    def forbidden(b, h, q, kv):
        raise AssertionError("mask_mod evaluated")

    length, block = 1 << 16, 128
    lo, hi = intervals(None, True, length, length)
    bm = flex.block_mask_from_bounds(lo, hi, length, length, block_size=block, mask_mod=forbidden)
    blocks = length // block
    assert torch.equal(bm.kv_num_blocks, torch.ones(1, 1, blocks, dtype=torch.int32))
    assert torch.equal(bm.kv_indices[0, 0, :, 0], torch.arange(blocks, dtype=torch.int32))
    assert torch.equal(bm.full_kv_num_blocks[0, 0], torch.arange(blocks, dtype=torch.int32))


def test_empty_and_zero_lengths():
    lo = torch.zeros(1, 1, 40, dtype=torch.int64)
    bm = flex.block_mask_from_bounds(lo, lo, 40, 30, block_size=16)  # no row attends anything
    assert bm.kv_num_blocks.sum() == 0 and bm.full_kv_num_blocks.sum() == 0
    q, k = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 0, 8)
    out, lse = flex.flex_interval_attention(q, k, k, lo, lo, scale=0.5)
    assert torch.equal(out, torch.zeros(1, 2, 40, 8)) and bool((lse == -math.inf).all())


# -- attention -------------------------------------------------------------------------------------


def _reference(q, k, v, allowed, scale, softcap=None, slopes=None, sinks=None, dtype=torch.float64):
    """The definition, computed in ``dtype`` (float64: the reference; bf16: the 2x rule's yardstick):
    ``allowed [S, Lq, Lk]``; ``(out, lse)``; zeros and lse -inf (or the sink) where nothing is allowed."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    n, h, lq, _ = q.shape
    lk = k.shape[-2]
    k, v = k.repeat_interleave(h // k.shape[1], 1), v.repeat_interleave(h // v.shape[1], 1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        distance = (torch.arange(lq)[:, None] + (lk - lq) - torch.arange(lk)).abs()
        s = s - slopes.to(dtype).expand(n, h)[..., None, None] * distance
    s = s.masked_fill(~allowed[:, None], -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.to(dtype).view(1, h, 1, 1).expand(n, h, lq, 1)], -1)
    has = torch.isfinite(s).any(-1, keepdim=True)
    safe = s.masked_fill(~has, 0.0)
    weights = torch.softmax(safe, -1).masked_fill(~has, 0.0)
    lse = torch.where(has[..., 0], torch.logsumexp(safe, -1), -math.inf)
    return weights[..., :lk] @ v, lse


def _inputs(n, h, h_kv, q_len, k_len, d=16, dv=16, dtype=torch.float32, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, h, q_len, d, generator=g) * spread
    k = torch.randn(n, h_kv, k_len, d, generator=g)
    v = torch.randn(n, h_kv, k_len, dv, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def test_reference_matches_the_oracle():
    q, k, v = _inputs(2, 4, 2, 50, 70)
    structure, causal_too, lo, hi = _case("document_ids", 50, 70)
    allowed = _dense(structure, causal_too, 50, 70)
    out, lse = _reference(q, k, v, allowed, 0.3)
    expected, _ = oracle_attention(q, k, v, mask=allowed[:, None], scale=0.3)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, oracle_lse(q, k, allowed[:, None], 0.3), atol=1e-12, rtol=0)


MODIFIERS = {
    "plain": {},
    "softcap": dict(softcap=2.0),
    "alibi": dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
    "alibi_per_sequence": dict(alibi_slopes=torch.tensor([[0.5, 0.1, 0.2, 0.3], [0.05, 0.0, 1.0, 0.25]])),
    "sinks": dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0])),
    "all": dict(softcap=3.0, alibi_slopes=torch.tensor([0.3, 0.2, 0.1, 0.05]),
                sinks=torch.tensor([1.0, 0.0, -2.0, 3.0])),
}


def _modifiers(name: str) -> dict:
    m = MODIFIERS[name]
    return dict(softcap=m.get("softcap"), alibi_slopes=m.get("alibi_slopes"), sinks=m.get("sinks"))


def _run(q, k, v, name, q_len, k_len, scale, mods, **kwargs):
    structure, causal_too, lo, hi = _case(name, q_len, k_len)
    mask_mod = flex.mask_mod_for(structure, causal_too, q_len, k_len, lo, hi)
    out, lse = flex.flex_interval_attention(q, k, v, lo, hi, scale=scale, mask_mod=mask_mod, **mods, **kwargs)
    return out, lse, _dense(structure, causal_too, q_len, k_len)


# Each mask with a few modifiers, every modifier at least twice: every new combination of mods
# costs FlexAttention's eager path a dynamo trace (~0.5 s), so not the full product.
FORWARD = [("causal", 100, 37, "plain"), ("causal", 100, 37, "all"), ("document_ids", 64, 64, "softcap"),
           ("document_ids", 64, 64, "all"), ("key_ranges_two", 37, 100, "alibi"), ("key_ranges_two", 37, 100, "sinks"),
           ("varlen", 100, 100, "alibi_per_sequence"), ("varlen", 100, 100, "softcap"),
           ("document_window", 50, 100, "sinks"), ("document_window", 50, 100, "alibi_per_sequence")]


@pytest.mark.parametrize("name,q_len,k_len,modifiers", FORWARD, ids=str)
def test_forward_float32(name, q_len, k_len, modifiers):
    q, k, v = _inputs(2, 4, 2, q_len, k_len, dv=8, spread=2.0)  # spread: scores large enough to cap
    mods = _modifiers(modifiers)
    out, lse, allowed = _run(q, k, v, name, q_len, k_len, 0.3, mods)
    expected, expected_lse = _reference(q, k, v, allowed, 0.3, mods["softcap"], mods["alibi_slopes"], mods["sinks"])
    assert out.dtype == torch.float32 and out.shape == (2, 4, q_len, 8) and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), expected_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("modifiers", ["plain", "all"])
@pytest.mark.parametrize("name,q_len,k_len", [("causal", 100, 100), ("first_keys_or_window", 45, 100)])
def test_forward_bf16_within_twice_the_oracle_error(name, q_len, k_len, modifiers):
    """FlashAttention's rule: at most twice the error of the definition computed in bf16, + 1e-4."""
    q, k, v = _inputs(2, 4, 1, q_len, k_len, dtype=torch.bfloat16, seed=3)
    mods = _modifiers(modifiers)
    out, lse, allowed = _run(q, k, v, name, q_len, k_len, 0.25, mods)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    args = (q, k, v, allowed, 0.25, mods["softcap"], mods["alibi_slopes"], mods["sinks"])
    exact, exact_lse = _reference(*args)
    rough, rough_lse = _reference(*args, dtype=torch.bfloat16)
    assert (out.double() - exact).abs().max() <= 2 * (rough.double() - exact).abs().max() + 1e-4
    assert (lse.double() - exact_lse).abs().max() <= 2 * (rough_lse.double() - exact_lse).abs().max() + 1e-4


@pytest.mark.parametrize("with_sinks", [False, True])
def test_rows_with_no_key(with_sinks):
    """Causal with Lq > Lk (the first 63 rows see nothing), documents ending before the keys do,
    varlen's padding rows."""
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0]) if with_sinks else None
    for name, q_len, k_len in [("causal", 100, 37), ("document_short", 64, 64), ("varlen", 64, 64)]:
        q, k, v = _inputs(2, 4, 4, q_len, k_len)
        out, lse, allowed = _run(q, k, v, name, q_len, k_len, 0.3, dict(sinks=sinks))
        empty = ~allowed.any(-1)  # [S, Lq]
        assert empty.any()
        empty = empty[:, None].expand(2, 4, q_len)
        assert not out.isnan().any() and not lse.isnan().any()
        assert torch.equal(out[empty], torch.zeros_like(out[empty]))
        rows_lse = lse[empty]
        expected = (sinks.view(1, 4, 1).expand(2, 4, q_len)[empty] if with_sinks
                    else torch.full_like(rows_lse, -math.inf))
        assert torch.equal(rows_lse, expected)


@pytest.fixture
def cpu_backward(monkeypatch):
    """PyTorch refuses FlexAttention's backward on the CPU (its compiled CPU kernel has none); the
    eager one it would run is its own dense backward, which is what these tests need: let it."""
    monkeypatch.setattr(flex_api, "_validate_device", lambda *tensors: None)


@pytest.mark.parametrize("name,q_len,k_len,modifiers", [("causal", 70, 37, "sinks"), ("document_ids", 50, 50, "all"),
                                                        ("first_keys_or_window", 40, 60, "plain"),
                                                        ("key_ranges_two", 40, 60, "all")], ids=str)
def test_gradients(cpu_backward, name, q_len, k_len, modifiers):
    """Gradients of q, k, v (GQA) and the sinks, through the output and the lse, against autograd of
    the float64 reference; rows with no key get none."""
    q, k, v = _inputs(2, 4, 2, q_len, k_len, seed=1, spread=2.0)
    mods = _modifiers(modifiers)
    g = torch.Generator().manual_seed(2)
    grad_out, grad_lse = torch.randn(2, 4, q_len, 16, generator=g), torch.randn(2, 4, q_len, generator=g)

    def gradients(run, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        sinks = mods["sinks"].to(dtype).requires_grad_() if mods["sinks"] is not None else None
        out, lse = run(*leaves, {**mods, "sinks": sinks})
        loss = (out * grad_out.to(dtype)).sum() + (torch.where(torch.isfinite(lse), lse, 0) * grad_lse.to(dtype)).sum()
        return torch.autograd.grad(loss, leaves + ([sinks] if sinks is not None else []))

    def with_flex(q, k, v, m):
        out, lse, _ = _run(q, k, v, name, q_len, k_len, 0.3, m)
        return out, lse

    allowed = _dense(*_case(name, q_len, k_len)[:2], q_len, k_len)
    expected = gradients(lambda q, k, v, m: _reference(q, k, v, allowed, 0.3, m["softcap"], m["alibi_slopes"],
                                                       m["sinks"]), torch.float64)
    got = gradients(with_flex, torch.float32)
    for a, b in zip(got, expected):
        assert not a.isnan().any()
        torch.testing.assert_close(a.double(), b, atol=2e-4, rtol=2e-4)


# -- compiled ----------------------------------------------------------------------------------------


def test_compiled_calls_of_one_shape_compile_once(monkeypatch):
    """New window sizes, document boundaries, key ranges and soft caps in calls of one shape reuse
    the compiled flex_attention: they are captured tensors. (Inductor on the CPU has no lse, so this
    counts graphs with a backend that runs them eagerly: recompiles are decided by dynamo's guards,
    whatever the backend.) Each result also matches the reference (no stale captured value)."""
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(flex._flex_call, backend=counting_backend, fullgraph=True)
    monkeypatch.setattr(flex, "_compiled_flex", lambda backend: compiled)
    q_len = k_len = 64
    q, k, v = _inputs(1, 4, 2, q_len, k_len)
    g = torch.Generator().manual_seed(5)
    series = [
        [(masks.sliding_window(size), dict(softcap=cap))
         for size, cap in [(4, 2.0), (9, 3.0), (17, 1.5), (2, 8.0), (30, 5.0)]],
        [(masks.document(lengths) & masks.causal(), dict(alibi_slopes=torch.rand(4, generator=g)))
         for lengths in ([20, 44], [10, 10, 44], [64], [1, 62, 1], [32, 32])],
        [(masks.key_ranges(lo, lo + torch.randint(0, 20, (q_len,), generator=g)), {})
         for lo in (torch.randint(0, k_len, (q_len,), generator=g) for _ in range(5))],
    ]
    for count, calls in enumerate(series, start=1):
        for structure, mods in calls:
            lo, hi = intervals(structure, False, q_len, k_len)
            mask_mod = flex.mask_mod_for(structure, False, q_len, k_len, lo, hi)
            out, lse = flex.flex_interval_attention(q, k, v, lo, hi, scale=0.25, mask_mod=mask_mod, compiled=True,
                                                    **mods)
            expected, expected_lse = _reference(q, k, v, _dense(structure, False, q_len, k_len), 0.25,
                                                mods.get("softcap"), mods.get("alibi_slopes"))
            torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(lse.double(), expected_lse, atol=2e-5, rtol=2e-5)
        assert len(graphs) == count, f"{len(graphs)} graphs after series {count}: recompiled on new values"
    # the count can fail: a new shape does compile again
    lo, hi = intervals(masks.causal(), False, 32, k_len)
    flex.flex_interval_attention(q[:, :, :32], k, v, lo, hi, scale=0.25, compiled=True)
    assert len(graphs) == len(series) + 1
    torch._dynamo.reset()


def test_an_exhausted_compile_cache_raises_instead_of_running_flex_unfused(monkeypatch):
    """Past dynamo's limit on compiled versions, a compiled flex_attention silently runs unfused (an
    Lq x Lk score matrix: 64 GiB at L = 32768, H = 16, measured on an H100 once a program had
    compiled 8 versions of ``torch.compile(flex_attention)``). attnkit compiles a function of its
    own with ``fullgraph=True``: the ninth version raises FlexUnavailable (here with the limit at
    1: the second mask rule), and the engine's callers run the interval kernels instead."""
    torch._dynamo.reset()
    monkeypatch.setattr(flex, "RECOMPILE_LIMIT", 1)
    q, k, v = _inputs(1, 2, 2, 32, 32)
    rules = (masks.sliding_window(5), masks.document([10, 22]) & masks.causal())
    with torch._dynamo.config.patch(recompile_limit=1):
        for index, structure in enumerate(rules):
            lo, hi = intervals(structure, False, 32, 32)
            mask_mod = flex.mask_mod_for(structure, False, 32, 32, lo, hi)
            run = functools.partial(flex.flex_interval_attention, q, k, v, lo, hi, scale=0.25, mask_mod=mask_mod,
                                    compiled=True, backend="eager")
            if index == 0:
                torch.testing.assert_close(run()[0].double(), _reference(q, k, v, _dense(structure, False, 32, 32),
                                                                         0.25, None, None)[0], atol=2e-5, rtol=0)
            else:
                with pytest.raises(flex.FlexUnavailable, match="RECOMPILE_LIMIT"):
                    run()
    torch._dynamo.reset()


def test_the_tiled_backend_runs_the_interval_kernels_where_flex_is_unavailable(monkeypatch):
    from attnkit._backends.tiled_plan import tuning

    def unavailable(*args, **kwargs):
        raise flex.FlexUnavailable("no more versions")

    q, k, v = _inputs(1, 4, 2, 40, 40)
    mask = masks.sliding_window(7)
    expected = attnkit.attention(q, k, v, mask=mask, backend="reference")
    monkeypatch.setattr(flex, "flex_interval_attention", unavailable)
    with tuning(kernel="flex"), pytest.warns(RuntimeWarning, match="interval kernels instead"):
        out = attnkit.attention(q, k, v, mask=mask, backend="tiled")
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: FlexAttention's compiled kernels")
def test_cuda_compiled():
    """The real engine: compiled kernels that skip blocks and skip mask_mod in full blocks, with a
    length that is no multiple of 128 (partial last blocks), forward, lse and gradients."""
    q_len = k_len = 300
    structure = masks.document([100, 57, 143]) & masks.sliding_window(90)
    lo, hi = intervals(structure, False, q_len, k_len)
    allowed = _dense(structure, False, q_len, k_len)
    q, k, v = (t.cuda() for t in _inputs(2, 4, 2, q_len, k_len, d=64, dv=64, dtype=torch.bfloat16, seed=7))
    mods = dict(softcap=20.0, alibi_slopes=torch.tensor([0.1, 0.05, 0.02, 0.01], device="cuda"),
                sinks=torch.tensor([0.5, -1.0, 2.0, 0.0], device="cuda"))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sinks = mods["sinks"].clone().requires_grad_()
    for mask_mod in (flex.mask_mod_for(structure, False, q_len, k_len, lo.cuda(), hi.cuda()),
                     flex.interval_mask_mod(lo.cuda(), hi.cuda())):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out, lse = flex.flex_interval_attention(*leaves, lo.cuda(), hi.cuda(), scale=0.125,
                                                    **{**mods, "sinks": sinks}, mask_mod=mask_mod, compiled=True)
        args = (q.cpu(), k.cpu(), v.cpu(), allowed, 0.125, 20.0, mods["alibi_slopes"].cpu(), mods["sinks"].cpu())
        exact, exact_lse = _reference(*args)
        rough, rough_lse = _reference(*args, dtype=torch.bfloat16)
        assert (out.cpu().double() - exact).abs().max() <= 2 * (rough.double() - exact).abs().max() + 1e-4
        assert (lse.cpu().double() - exact_lse).abs().max() <= 2 * (rough_lse.double() - exact_lse).abs().max() + 1e-4
        grads = torch.autograd.grad(out.float().square().sum() + lse.sum(), leaves + [sinks])
        reference_leaves = [t.cpu().double().requires_grad_() for t in (q, k, v, mods["sinks"])]
        ref_out, ref_lse = _reference(*reference_leaves[:3], allowed, 0.125, 20.0, mods["alibi_slopes"].cpu(),
                                      reference_leaves[3])
        expected = torch.autograd.grad(ref_out.square().sum() + ref_lse.sum(), reference_leaves)
        for a, b in zip(grads, expected):  # bf16 through a 300-key softmax: a relative error of ~1e-2
            assert not a.isnan().any()
            assert (a.cpu().double() - b).norm() <= 3e-2 * b.norm()
