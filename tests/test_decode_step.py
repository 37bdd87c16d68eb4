"""A decoding step by plain ops with no read of the device (``_backends/decode_step.py``): against a
float64 definition written pair by pair (NaN and inf planted in attended and masked-out pairs, masks
shared by the heads or not, additive masks, GQA, half precision), and through ``attnkit.attention``
where ``fused.DECODE_STEP_DEVICES`` names the device: the path taken, no host read of a tensor, the
other paths' results on finite inputs, and the calls it leaves to them."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from attnkit._backends import decode_step, fused

_SPECIALS = (float("nan"), float("inf"), float("-inf"))


def _definition(query, key, value, allowed, scale, bias=0.0):
    """float64 output of one query row per head ``[B, H, 1, Dv]``: only ``allowed`` pairs
    (``[B or 1, H or 1, 1, Lk]``) enter a product, and their score gains ``bias`` (an additive
    mask); a NaN or +inf attended score makes the row NaN; a row whose attended scores are all -inf
    (or that has none) weighs its attended values by 0."""
    q, k, v = query.double(), key.double(), value.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    allowed = allowed.expand(q.shape[0], q.shape[1], 1, k.shape[2])
    pair = allowed[..., None]  # [B, H, 1, Lk, 1]
    products = torch.where(pair, q[:, :, :, None, :] * k[:, :, None, :, :], 0.0)
    scores = torch.where(allowed, products.sum(-1) * scale + bias, float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    shift = torch.where(row_max == float("-inf"), 0.0, row_max)
    e = torch.exp(scores - shift)
    total = e.sum(-1, keepdim=True)
    weights = e / torch.where(total == 0, 1.0, total)
    return torch.where(pair, weights[..., None] * v[:, :, None, :, :], 0.0).sum(-2)


@st.composite
def steps(draw):
    batch = draw(st.integers(1, 3))
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 4]))
    lk, dk, dv = draw(st.integers(1, 40)), draw(st.integers(1, 16)), draw(st.integers(1, 16))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(batch, heads, 1, dk, generator=g)
    k, v = (torch.randn(batch, kv_heads, lk, d, generator=g) for d in (dk, dv))
    kind = draw(st.sampled_from(["none", "shared", "per head", "additive"]))
    allowed = torch.ones(1, 1, 1, lk, dtype=torch.bool)
    mask = None
    if kind != "none":
        rows = batch if draw(st.booleans()) else 1
        allowed = torch.rand(rows, heads if kind == "per head" else 1, 1, lk, generator=g) < 0.7
        mask = allowed
        if kind == "additive":
            mask = torch.where(allowed, torch.randn(allowed.shape, generator=g), float("-inf"))
    for _ in range(draw(st.integers(0, 4))):
        target = draw(st.sampled_from([q, k, v]))
        index = tuple(int(torch.randint(0, n, (), generator=g)) for n in target.shape)
        target[index] = draw(st.sampled_from(_SPECIALS))
    return dict(query=q, key=k, value=v, mask=mask, allowed=allowed, scale=draw(st.floats(0.05, 1.0)),
                dtype=draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16])))


def _assert_same_non_finite_and_close(got, want, atol, rtol):
    got = got.double()
    for kind in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(kind(got), kind(want)), (kind.__name__, got, want)
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], atol=atol, rtol=rtol)


@settings(max_examples=150, deadline=None)
@given(c=steps())
def test_the_step_follows_the_definition(c):
    dtype = c["dtype"]
    q, k, v = (c[name].to(dtype) for name in ("query", "key", "value"))
    mask = c["mask"]
    taken = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused, "DECODE_STEP_DEVICES", frozenset({"cpu"}))
        patch.setattr(fused, "decode_step_attention",
                      lambda call: taken.append(1) or decode_step.decode_step_attention(call))
        out = attnkit.attention(q, k, v, mask=mask, scale=c["scale"], backend="torch")
    assert taken, "the decoding step did not run"
    assert out.dtype == dtype and out.shape == (q.shape[0], q.shape[1], 1, v.shape[-1])
    bias = 0.0 if mask is None or mask.dtype == torch.bool else mask.double().masked_fill(~c["allowed"], 0.0)
    want = _definition(q, k, v, c["allowed"], c["scale"], bias)
    # float32: sums of <= 16 products over <= 40 keys; half precision: the output's one rounding
    # (the step computes in float32 from the exact upcast inputs, as the definition does)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else \
        dict(atol=1e-3, rtol=2 ** -8 if dtype == torch.bfloat16 else 2 ** -11)
    _assert_same_non_finite_and_close(out, want, **tolerance)


def _reads(fn) -> int:
    """How many times ``fn()`` read a tensor's value back to the host (``aten::_local_scalar_dense``:
    ``item``, ``tolist``, ``bool``; on an accelerator each waits for the device)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(event.count for event in prof.key_averages() if event.key == "aten::_local_scalar_dense")


@pytest.mark.parametrize("mask", [None, "padding", "window"])
def test_attention_reads_nothing_back_and_gives_what_the_sdpa_path_gives(mask, monkeypatch):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 1, 16, generator=g)
    k, v = (torch.randn(3, 2, 50, 16, generator=g) for _ in range(2))
    structured = {None: None, "padding": masks.padding(torch.tensor([50, 31, 7])),
                  "window": masks.sliding_window(12)}[mask]

    def call():
        return attnkit.attention(q, k, v, mask=structured)

    sdpa_path = call()
    assert _reads(call) > 0  # the check of SDPA's output reads it back: the count can fail
    monkeypatch.setattr(fused, "DECODE_STEP_DEVICES", frozenset({"cpu"}))
    step = call()
    assert _reads(call) == 0
    torch.testing.assert_close(step, sdpa_path, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", ["gradient", "two rows", "weights", "dropout", "softcap", "sinks"])
def test_calls_it_does_not_serve_keep_their_path(case, monkeypatch):
    monkeypatch.setattr(fused, "DECODE_STEP_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(fused, "decode_step_attention", lambda call: pytest.fail("the decoding step ran"))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 2 if case == "two rows" else 1, 8, generator=g, requires_grad=case == "gradient")
    k, v = (torch.randn(1, 4, 20, 8, generator=g) for _ in range(2))
    options = {"weights": dict(return_weights=True), "dropout": dict(dropout=0.1),
               "softcap": dict(softcap=5.0), "sinks": dict(sinks=torch.zeros(4))}.get(case, {})
    result = attnkit.attention(q, k, v, backend="torch", **options)
    out = result[0] if isinstance(result, tuple) else result
    assert torch.isfinite(out).all() and math.prod(out.shape) > 0
