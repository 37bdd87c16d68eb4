"""The GPU route, checked on the CPU: what ``"auto"`` runs on CUDA, and the two GPU engines behind
the tiled backend (FlexAttention on a BlockMask built from the intervals; attnkit's Triton kernel,
here through Triton's interpreter) against the float64 oracle through ``attnkit.attention`` itself.

The CUDA rule reads only a call's shapes and flags (:func:`policy._cuda_route`), so it is checked
on CPU calls with the engines' availability set by hand. The engines run on CPU tensors: Flex
eagerly (forward only: PyTorch has no CPU backward for it), Triton's kernels interpreted
(``TRITON_INTERPRET=1``, set by conftest where there is no GPU), forward and backward.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit._backends import engines, interval_op, policy, tiled
from attnkit._backends.engines import GpuEngines
from attnkit._backends.tiled_plan import tuning
from attnkit._call import make_call
from oracle import oracle_attention

triton_missing = not GpuEngines.find().triton


def _call(mask=None, length=256, head_dim=64, dtype=torch.bfloat16, grad=True, **options):
    q = torch.empty(1, 8, length, head_dim, dtype=dtype, requires_grad=grad)
    k = torch.empty(1, 2, length, head_dim, dtype=dtype)
    settings = dict(mask=mask, causal=False, scale=None, dropout=0.0, generator=None, return_weights=False)
    return make_call(q, k, k, **{**settings, **options})


@pytest.mark.parametrize("flex_here, triton_here", [(True, True), (False, True), (False, False)])
def test_the_cuda_rule_sends_every_interval_call_to_an_interval_engine(monkeypatch, flex_here, triton_here):
    """Structured masks, score modifiers and the lse go to Flex where a gradient may follow (dropout,
    and head sizes Flex does not compile, to Triton), to Triton in half precision where none will
    (its forward kernel measured faster); SDPA keeps what it runs as it is: no mask, plain causal, a
    decoding step, a dense tensor mask, weights. Without the engines, SDPA (the lse: the tiled backend)."""
    monkeypatch.setattr(policy, "_gpu_engines", lambda: GpuEngines(flex=flex_here, triton=triton_here))
    interval = "tiled:flex" if flex_here else "tiled:triton" if triton_here else "torch"
    after_flex = "tiled:triton" if triton_here else "torch"
    route = lambda *a, **k: str(policy._cuda_route(_call(*a, **k)))  # noqa: E731
    assert route(masks.sliding_window(64)) == interval
    assert route(masks.document([100, 156]) & masks.causal()) == interval
    assert route(masks.causal() & masks.padding(200)) == interval
    assert route(None, softcap=30.0) == interval
    assert route(None, sinks=torch.zeros(8)) == interval
    assert route(masks.sliding_window(64), dropout=0.1) == after_flex  # Flex has no dropout
    assert route(None, dropout=0.1) == after_flex  # attnkit's pattern, no L x L weights
    assert route(masks.sliding_window(64), head_dim=24) == after_flex  # nor 24-wide heads
    assert route(None, return_lse=True) == (interval if interval != "torch" else "tiled")
    assert route(None) == route(masks.causal()) == route(None, causal=True) == "torch"
    assert route(masks.sliding_window(64), return_weights=True) == "torch"
    assert route(masks.sliding_window(64).dense(256, 256)) == "torch"  # already L x L
    assert route(masks.sliding_window(64), length=1) == "torch"  # a decoding step
    forward_only = "tiled:triton" if triton_here else interval
    assert route(masks.sliding_window(64), grad=False) == route(None, softcap=30.0, grad=False) == forward_only
    assert route(masks.sliding_window(64), grad=False, dtype=torch.float16) == forward_only
    assert route(masks.sliding_window(64), grad=False, dtype=torch.float32) == interval  # IEEE fp32 on FMA units


def test_the_cpu_rule_is_unchanged_by_the_cuda_one():
    assert policy.choose(_call(masks.sliding_window(64), dtype=torch.float32)).backend == "tiled"
    assert str(policy.choose(_call(None, dtype=torch.float32))) == "torch"


def test_flex_supports_powers_of_two_from_16():
    x = lambda d, dtype=torch.bfloat16: torch.empty(1, 1, 4, d, dtype=dtype)  # noqa: E731
    assert engines.flex_supports(x(16), x(16), x(128)) and engines.flex_supports(x(64), x(64), x(64))
    assert not engines.flex_supports(x(24), x(24), x(24)) and not engines.flex_supports(x(8), x(8), x(8))
    assert not engines.flex_supports(x(64, torch.float64), x(64, torch.float64), x(64, torch.float64))


# -- the engines through attnkit.attention on CPU tensors ----------------------------------------------

MASKS = {
    "causal, fewer queries": (masks.causal(), 37, 53),
    "window": (masks.sliding_window(9), 53, 53),
    "window (left, right)": (masks.sliding_window(5, 3), 53, 53),
    "documents": (masks.document([20, 0, 17, 16]) & masks.causal(), 53, 53),
    "per-sequence padding, empty rows": (masks.padding([0, 41]), 53, 53),
    "first keys | window": (masks.first_keys(3) | masks.sliding_window(6), 53, 53),
    "prefix-LM": (masks.prefix_lm([7, 30]), 53, 53),
}


def _inputs(q_len, k_len, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, q_len, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(2, kv_heads, k_len, head_dim, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def _oracle(q, k, v, mask, q_len, k_len):
    allowed = mask.dense(q_len, k_len, ndim=4)
    return oracle_attention(q, k, v, mask=allowed)[0]


@pytest.mark.parametrize("name", list(MASKS))
def test_flex_route_matches_the_oracle(name):
    mask, q_len, k_len = MASKS[name]
    q, k, v = _inputs(q_len, k_len)
    with tuning(kernel="flex"):
        out, lse = attnkit.attention(q, k, v, mask=mask, backend="tiled", return_lse=True)
    expected = _oracle(q, k, v, mask, q_len, k_len)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=0)
    empty = ~mask.dense(q_len, k_len, ndim=4).any(-1).expand_as(lse)
    assert torch.isneginf(lse[empty]).all() and torch.isfinite(lse[~empty]).all()


def test_flex_route_builds_one_block_mask_per_mask_object(monkeypatch):
    """A model passes one mask object to every layer: its BlockMask is built once."""
    from attnkit._backends import flex

    built = []
    real = flex.block_mask_from_bounds
    monkeypatch.setattr(flex, "block_mask_from_bounds", lambda *a, **k: built.append(1) or real(*a, **k))
    mask = masks.sliding_window(9)
    q, k, v = _inputs(53, 53)
    with tuning(kernel="flex"):
        first = attnkit.attention(q, k, v, mask=mask, backend="tiled")
        for _ in range(3):
            assert torch.equal(attnkit.attention(q, k, v, mask=mask, backend="tiled"), first)
        attnkit.attention(q, k, v, mask=masks.sliding_window(9), backend="tiled")  # another object
    assert len(built) == 2


def test_flex_route_refuses_what_flex_cannot_do():
    q, k, v = _inputs(16, 16)
    with tuning(kernel="flex"), pytest.raises(ValueError, match="FlexAttention has no dropout"):
        attnkit.attention(q, k, v, mask=masks.sliding_window(4), backend="tiled", dropout=0.1)


# test_triton_kernel.py holds the kernel itself to float64 on every mask kind; through attnkit.attention
# the masks that exercise the route's own parts (bottom-right alignment, two ranges, per-sequence rows,
# empty rows) are enough, and the interpreter is slow.
THROUGH_ATTENTION = ["causal, fewer queries", "per-sequence padding, empty rows", "first keys | window", "prefix-LM"]


@pytest.mark.skipif(triton_missing, reason="triton is not installed")
@pytest.mark.parametrize("name", THROUGH_ATTENTION)
def test_triton_route_matches_the_oracle_forward_and_backward(name, monkeypatch):
    """The kernel the forward ran is the one the backward runs (chosen once, saved)."""
    mask, q_len, k_len = MASKS[name]
    q, k, v = (t.requires_grad_() for t in _inputs(q_len, k_len))
    chosen = []
    real = policy.kernel_for
    monkeypatch.setattr(policy, "kernel_for", lambda inputs: chosen.append(real(inputs)) or chosen[-1])
    with tuning(kernel="triton"):
        out = attnkit.attention(q, k, v, mask=mask, backend="tiled")
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    assert chosen == ["triton"]  # asked once, by the forward; the backward ran what it ran
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = _oracle(q64, k64, v64, mask, q_len, k_len)
    expected_grads = torch.autograd.grad(expected, (q64, k64, v64), grad.double())
    torch.testing.assert_close(out.double(), expected.detach(), atol=2e-6, rtol=0)
    for ours, theirs in zip(grads, expected_grads):
        torch.testing.assert_close(ours.double(), theirs, atol=2e-5, rtol=0)


@pytest.mark.skipif(triton_missing, reason="triton is not installed")
def test_triton_route_with_score_modifiers_sinks_and_lse_matches_the_tiled_backend():
    """Soft-capping, ALiBi and sinks on Triton against the same call on PyTorch's kernels block by
    block (itself held to the oracle by test_vocabulary.py): outputs, lse and gradients."""
    mask = masks.sliding_window(11)
    q, k, v = (t.requires_grad_() for t in _inputs(45, 45))
    options = dict(softcap=2.0, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]),
                   sinks=torch.tensor([0.3, -1.0, 2.0, 0.0], requires_grad=True), return_lse=True)
    results = []
    for kernel in ("triton", "blocks"):
        with tuning(kernel=kernel):
            out, lse = attnkit.attention(q, k, v, mask=mask, backend="tiled", **options)
        grads = torch.autograd.grad((out * out).sum() + lse.sum(), (q, k, v, options["sinks"]))
        results.append((out, lse, *grads))
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, atol=3e-5, rtol=1e-5)


@pytest.mark.skipif(triton_missing, reason="triton is not installed")
def test_triton_route_draws_the_cpu_dropout_pattern():
    """Dropout with a structured mask: the same (seed, position) pattern as every other path."""
    mask = masks.document([13, 19]) & masks.causal()
    q, k, v = _inputs(32, 32)
    v = torch.eye(32).expand(2, 2, 32, 32)  # the output rows are the dropped-out weights
    outs = []
    for kernel in ("triton", "blocks"):
        with tuning(kernel=kernel):
            outs.append(attnkit.attention(q, k, v, mask=mask, backend="tiled", dropout=0.3,
                                          generator=torch.Generator().manual_seed(5)))
    assert torch.equal(outs[0] == 0, outs[1] == 0)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=0)
    assert 0.2 < (outs[0][mask.dense(32, 32, ndim=4).expand_as(outs[0])] == 0).double().mean() < 0.4


def test_the_op_refuses_to_run_flex_itself():
    q, k, v = _inputs(8, 8)
    lo, hi = torch.zeros(1, 1, 8, dtype=torch.int64), torch.full((1, 1, 8), 8)
    with pytest.raises(ValueError, match="does not run FlexAttention"):
        interval_op.forward_op(interval_op.IntervalInputs(q, k, v, lo, hi, scale=1 / math.sqrt(16), kernel="flex"))
    assert tiled.interval_inputs  # the tiled backend is the one that calls it


@pytest.mark.parametrize("kernel", ["flex", "triton"])
def test_a_non_finite_value_in_a_partly_masked_block_stays_out_of_the_rows_that_mask_it(kernel):
    """Block kernels multiply whole blocks: 0 x inf would put a masked-out inf value into its block's
    other rows. Both engines redo such a call pairwise (blockwise.pairwise_if_not_finite): NaN and inf
    land exactly where the reference backend puts them."""
    if kernel == "triton" and triton_missing:
        pytest.skip("triton is not installed")
    q, k, v = _inputs(40, 40)
    k[0, 1, 5, 0] = float("nan")
    v[1, 0, 7, 3] = float("inf")
    mask = masks.sliding_window(4)
    expected = attnkit.attention(q, k, v, mask=mask, backend="reference")
    with tuning(kernel=kernel):
        out = attnkit.attention(q, k, v, mask=mask, backend="tiled")
    assert expected.isnan().any() and expected.isinf().any()
    assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.isinf(), expected.isinf())
    torch.testing.assert_close(out.nan_to_num(0.0, 9.0, -9.0), expected.nan_to_num(0.0, 9.0, -9.0), atol=1e-5, rtol=0)
