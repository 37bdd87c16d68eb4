"""NaN and inf are never hidden, and masked-out pairs are never read, on every backend alike.

The definition (``attnkit._backends.numerics``): a (query, key) pair the mask removes contributes
nothing, forward or backward, whatever its query, key or value hold; NaN and inf in attended
pairs propagate as IEEE arithmetic does (an attended NaN or +inf score makes its row NaN, -inf
scores weigh 0). The float64 oracle below follows it pair by pair, written from the definition:
every backend must give its NaN / +inf / -inf pattern exactly, in the output, the lse and the
gradients, and its finite values to rounding.
"""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from attnkit._backends import native, numerics, reference
from attnkit._backends.tiled_plan import tuning

from oracle import pairwise_oracle
from strategies import mask_cases

try:
    import triton  # noqa: F401
except ImportError:
    triton = None

LENGTH, HEADS, DIM = 12, 2, 4
MASK = masks.sliding_window(4) & masks.padding([10, 12])  # sequence 0: keys 10, 11 are padding
ALLOWED = MASK.dense(LENGTH, LENGTH, ndim=4)  # [2, 1, L, L]


def _oracle(q, k, v, scale, allowed=ALLOWED):
    """The definition pair by pair (tests/oracle.py), in float64 or in the inputs' dtype when the
    scores are meant to overflow it."""
    return pairwise_oracle(q, k, v, scale, allowed)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, HEADS, LENGTH, DIM, generator=g) for _ in range(3)]


def _plant(where):
    q, k, v = _inputs()
    scale = DIM**-0.5
    nan, inf = float("nan"), float("inf")
    if where == "attended query":
        q[0, 0, 5, 1] = nan
    elif where == "attended key":
        k[1, 1, 6, 0] = nan  # rows 6..9 attend key 6, the others do not
    elif where == "attended value inf":
        v[0, 1, 3, 2] = inf
    elif where == "values of both signs":
        v[1, 0, 7, 0], v[1, 0, 8, 0] = inf, -inf
    elif where == "padding key and value":
        k[0, :, 10:, :], v[0, :, 10:, :] = nan, nan  # never attended
    elif where == "masked for some rows":
        k[0, 0, 2, :], v[0, 0, 2, 3] = nan, nan  # row 9 no longer sees key 2 (window), rows 2..5 do
    elif where == "key of -inf":
        k[0, 0, 4, 0] = -inf  # scores +inf or -inf by the sign of q
    elif where == "overflowing scale":
        scale = 1e38  # every score overflows to +-inf
    return q, k, v, scale


CASES = ["attended query", "attended key", "attended value inf", "values of both signs", "padding key and value",
         "masked for some rows", "key of -inf", "overflowing scale"]


def _same_pattern(got, want, what, atol=1e-4):
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(test(got), test(want)), f"{what}: {test.__name__} pattern differs"
    finite = torch.isfinite(want)
    torch.testing.assert_close(got.double()[finite], want.double()[finite], atol=atol, rtol=1e-4, msg=what)


def _score_gradient_atol(q, k, v, up, scale):
    """dQ and dK are ``scale * P * (dP - delta)`` times K or Q: the rounding of ``dP - delta``
    (float32 dot products of length DIM, delta summed in another order by every kernel) is
    multiplied by ``scale``. With a one-hot P (overflowed scores) the oracle's softmax backward
    cancels exactly to 0 and a kernel's leaves ``scale * rounding``: bound it by twice
    ``scale * DIM * eps * max|dO| max|V| max|K or Q|`` (LENGTH keys, each one rounding)."""
    eps = torch.finfo(torch.float32).eps
    q, k, v, up = (t.detach() for t in (q, k, v, up))
    largest = max(q.abs().max(), k.abs().max())
    return 2 * scale * DIM * LENGTH * eps * float(up.abs().max() * v.abs().max() * largest)


#: Whether the Triton kernel runs on CPU tensors here (through triton's interpreter).
TRITON_ON_CPU = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


def _engine(backend):
    """The context that makes ``backend`` run what its name says (the test skips where it cannot)."""
    if backend == "tiled" and not native.available():
        pytest.skip(f"native kernel: {native.why_unavailable()}")
    if backend == "tiled on the Triton kernel" and not TRITON_ON_CPU:
        pytest.skip("the Triton kernel on CPU tensors needs triton's interpreter (test_cuda.py runs it on a GPU)")
    if backend == "tiled on PyTorch's kernels":
        return native.turned_off()
    if backend == "tiled on the Triton kernel":
        return tuning(kernel="triton")
    return contextlib.nullcontext()


@pytest.mark.parametrize("backend", ["reference", "torch", "tiled", "tiled on PyTorch's kernels",
                                     "tiled on the Triton kernel", "auto"])
@pytest.mark.parametrize("where", CASES)
def test_nan_and_inf_propagate_as_the_definition_says(backend, where):
    q, k, v, scale = _plant(where)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    name = "tiled" if backend.startswith("tiled") else backend
    with _engine(backend):
        out = attnkit.attention(*inputs, mask=MASK, scale=scale, backend=name)
        up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        grads = torch.autograd.grad(out, inputs, up)
        lse = attnkit.attention(q, k, v, mask=MASK, scale=scale, backend="tiled", return_lse=True)[1] \
            if name == "tiled" else None
    dtype = torch.float32 if where == "overflowing scale" else torch.float64  # overflow is float32's
    oracle_inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    want_out, want_lse = _oracle(*oracle_inputs, scale)
    want_grads = torch.autograd.grad(want_out, oracle_inputs, up.to(dtype))
    _same_pattern(out, want_out, "output")
    if lse is not None:
        _same_pattern(lse, want_lse, "lse")
    score_atol = _score_gradient_atol(q, k, v, up, scale) if where == "overflowing scale" else 1e-4
    for got, want, letter in zip(grads, want_grads, "qkv"):
        _same_pattern(got, want, f"d{letter}", atol=score_atol if letter in "qk" else 1e-4)


@pytest.mark.parametrize("backend", ["tiled", "tiled on PyTorch's kernels", "tiled on the Triton kernel", "auto"])
def test_an_infinite_output_gradient_propagates_as_in_the_reference_backend(backend):
    """``grad_out`` holding -inf (and, in another row, NaN): the tiled backend's gradients, on every
    kernel, have the reference backend's NaN / inf pattern. The fused backward kernels' ``delta = rowsum(dO * O)``
    differs from autograd's sum over the keys there (an infinity times values of both signs), so
    such a backward takes the pairwise path; the native kernel's did not, and gave infinities
    where the reference gives NaN. (Left open: ``"torch"`` runs SDPA's own backward, which differs
    from the reference here, and the reference itself lets ``0 * inf`` of a masked-out pair into
    dV, against the definition above.)"""
    q, k, v = _inputs()
    up = torch.randn(2, HEADS, LENGTH, DIM, generator=torch.Generator().manual_seed(1))
    up[0, 1, 8, 2], up[1, 0, 3, 1] = float("-inf"), float("nan")
    results = []
    for name, context in ((backend, _engine(backend)), ("reference", contextlib.nullcontext())):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        with context:
            out = attnkit.attention(*inputs, mask=MASK, backend="tiled" if name.startswith("tiled") else name)
            results.append(torch.autograd.grad(out, inputs, up))
    for got, want, letter in zip(*results, "qkv"):
        assert torch.isnan(want).any() or torch.isinf(want).any(), letter
        _same_pattern(got, want, f"d{letter}")


# Rows that have keys but no weight, or only NaN and -inf scores: where PyTorch's fused CPU kernel
# leaves the definition (it takes its row maximum with NaN skipped and reads such a row as one with
# no key: zeros) and where the kernels skipped a row of lse -inf. Found by running every backend on
# random calls with NaN and inf planted, against the reference backend.
ROWS = ["query row of NaN over 5 keys", "NaN among -inf scores over 100 keys", "all scores -inf, a value of NaN",
        "all scores -inf, keys of inf", "a +inf score in bfloat16 over 100 keys"]


def _rows_case(case):
    g = torch.Generator().manual_seed(5)
    nan, inf = float("nan"), float("inf")
    keys = 100 if "100 keys" in case else 5
    q, k, v = (torch.randn(1, 2, n, DIM, generator=g) for n in (3, keys, keys))
    k[..., 0] = k[..., 0].abs() + 0.1  # a query of -inf in feature 0 then scores -inf with every key
    if case == "query row of NaN over 5 keys":
        q[0, 0, 1, 2] = nan  # every score of the row NaN: fewer keys than a vector of the CPU kernel
    elif case == "NaN among -inf scores over 100 keys":
        q[0, 1, 0] = torch.tensor([-inf, 0.0, 0.0, 0.0])
        k[0, 1, 99, 1] = nan  # the last key's score NaN, every other -inf
    elif case == "all scores -inf, a value of NaN":
        q[0, 0, 2] = torch.tensor([-inf, 0.0, 0.0, 0.0])
        v[0, 0, 3, 1] = nan  # weighed by 0: 0 x NaN
    elif case == "all scores -inf, keys of inf":
        q[0, 0, 2] = torch.tensor([-inf, -1.0, 0.0, 0.0])
        k[0, 0, 3, 1] = inf  # its score -inf too; the gradients' 0 x inf are NaN
    elif case == "a +inf score in bfloat16 over 100 keys":
        k[0, 1, 2, 3] = inf  # rows whose query is positive there score +inf: the whole row NaN (zeros in SDPA)
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    return q, k, v


@pytest.mark.parametrize("backend", ["reference", "torch", "torch, weights asked", "tiled",
                                     "tiled on PyTorch's kernels", "tiled on the Triton kernel", "auto"])
@pytest.mark.parametrize("case", ROWS)
def test_rows_with_keys_but_no_weight_follow_the_definition(backend, case):
    """The output, lse and gradients of rows whose scores are all NaN, NaN among -inf or all -inf
    (with NaN or inf among their values or keys) have the oracle's NaN / inf pattern on every
    backend, with no mask (SDPA's unmasked path; with weights asked, the materialised path, whose
    softmax made a row of -inf scores NaN) and on the tiled backend's kernels."""
    q, k, v = _rows_case(case)
    scale = DIM**-0.5
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    name = "tiled" if backend.startswith("tiled") else backend.split(",")[0]
    weights = {"return_weights": True} if backend.endswith("weights asked") else {}
    with _engine(backend), (tuning(kernel="native") if backend == "tiled" else contextlib.nullcontext()):
        out = attnkit.attention(*inputs, scale=scale, backend=name, **weights)
        out = out[0] if weights else out
        up = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
        grads = torch.autograd.grad(out, inputs, up)
        lse = attnkit.attention(q, k, v, scale=scale, backend="tiled", return_lse=True)[1] if name == "tiled" else None
    allowed = torch.ones(1, 1, q.shape[2], k.shape[2], dtype=torch.bool)
    oracle_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    want_out, want_lse = _oracle(*oracle_inputs, scale, allowed)
    want_grads = torch.autograd.grad(want_out, oracle_inputs, up.double())
    atol = 1e-4 if q.dtype == torch.float32 else 2e-2
    assert torch.isnan(want_out).any() or torch.isnan(torch.stack(want_grads[:2])).any(), "the case plants no NaN"
    _same_pattern(out, want_out, "output", atol=atol)
    if lse is not None:
        _same_pattern(lse, want_lse, "lse", atol=atol)
    for got, want, letter in zip(grads, want_grads, "qkv"):
        _same_pattern(got, want, f"d{letter}", atol=atol * 10)


@pytest.mark.parametrize("kernel", ["native", "blocks", "dense"])
def test_a_used_lse_of_a_call_with_an_inf_gets_its_gradient(kernel):
    """``return_lse=True`` with the lse in the loss and an inf among the keys: the backward takes the
    dense path, whose lse must be in its graph (it was computed outside it, and autograd refused
    the call: "element 1 of tensors does not require grad"), and whose gradients are the oracle's."""
    if kernel == "native" and not native.available():
        pytest.skip(f"native kernel: {native.why_unavailable()}")
    q, k, v = _inputs()
    k[1, 0, 5, 2] = float("inf")
    scale = DIM**-0.5
    for wants in ((True, True, True), (False, False, True)):  # the lse does not depend on the values
        inputs = [t.clone().requires_grad_(w) for t, w in zip((q, k, v), wants)]
        with tuning(kernel=kernel):
            out, lse = attnkit.attention(*inputs, mask=MASK, scale=scale, backend="tiled", return_lse=True)
        up = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        chosen = [t for t in inputs if t.requires_grad]
        grads = torch.autograd.grad((out * up).sum() + lse.nan_to_num(0.0, 0.0, 0.0).sum(), chosen)
        oracle_inputs = [t.double().requires_grad_(w) for t, w in zip((q, k, v), wants)]
        want_out, want_lse = _oracle(*oracle_inputs, scale)
        loss = (want_out * up.double()).sum() + want_lse.nan_to_num(0.0, 0.0, 0.0).sum()
        want_grads = torch.autograd.grad(loss, [t for t in oracle_inputs if t.requires_grad])
        for got, want in zip(grads, want_grads):
            _same_pattern(got, want, f"gradient ({kernel}, {wants})")


@pytest.mark.parametrize("backend", ["torch", "tiled", "tiled on PyTorch's kernels", "auto"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_calls_with_nan_and_inf_are_non_finite_exactly_where_the_definition_is(backend, data):
    """Any shape, GQA, structured mask (or none, or causal), dtype, weights asked or not, with NaN
    and inf planted in the query, key or value: the output and the three gradients are non-finite
    exactly where the oracle's are (NaN against inf may differ: attnkit's kernel takes exp as 0
    where float32 still has subnormal weights, 0 x inf against a subnormal x inf). This is how the
    hidden rows above were found."""
    batch, kv_heads = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    group = data.draw(st.sampled_from([1, 2]))
    q_len, k_len, dim = data.draw(st.integers(1, 24)), data.draw(st.integers(1, 24)), data.draw(st.integers(1, 8))
    kind = data.draw(st.sampled_from(["none", "causal", "structured"]))
    mask, causal = None, kind == "causal"
    keys, positions = torch.arange(k_len)[None, :], (torch.arange(q_len) + k_len - q_len)[:, None]
    allowed = (keys <= positions if causal else torch.ones(q_len, k_len, dtype=torch.bool))[None, None]
    if kind == "structured":
        case = data.draw(mask_cases(batch=batch, max_len=24))
        mask, allowed = case.mask, case.allowed(q_len, k_len)[:, None]
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(batch, kv_heads * group, q_len, dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, k_len, dim, generator=g) for _ in range(2))
    for _ in range(data.draw(st.integers(1, 3))):
        target = data.draw(st.sampled_from([q, k, v]))
        where = tuple(data.draw(st.integers(0, n - 1)) for n in target.shape)
        target[where] = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    q, k, v = (t.to(dtype) for t in (q, k, v))
    weights = {"return_weights": True} if data.draw(st.booleans()) else {}
    scale = dim**-0.5
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    name = "tiled" if backend.startswith("tiled") else backend
    try:
        with _engine(backend), (tuning(kernel="native") if backend == "tiled" else contextlib.nullcontext()):
            result = attnkit.attention(*inputs, mask=mask, causal=causal, scale=scale, backend=name, **weights)
            out = result[0] if weights else result
            up = torch.randn(out.shape, generator=g).to(dtype)
            grads = torch.autograd.grad(out, inputs, up)
    except ValueError as error:  # a mask that does not fit these lengths
        assert "mask" in str(error)
        return
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want = _oracle(leaves[0], *(t.repeat_interleave(group, 1) for t in leaves[1:]), scale, allowed)[0]
    for got, expected, what in zip([out, *grads], [want, *torch.autograd.grad(want, leaves, up.double())],
                                   ["output", "dq", "dk", "dv"]):
        differ = torch.isfinite(got) != torch.isfinite(expected)
        assert not differ.any(), f"{what}: finite at {differ.nonzero()[:3].tolist()} only on one side"


@pytest.mark.parametrize("backend", ["reference", "torch", "tiled", "tiled on PyTorch's kernels", "auto"])
def test_beyond_the_pairwise_limit_no_pairwise_product_is_built(backend, monkeypatch):
    """``PAIRWISE_LIMIT`` caps the pairwise products (``B x H x Lq x Lk x D`` elements): beyond it
    the kernels' result stands, forward and backward. It was declared and never applied, so a NaN
    in one padding key of a ``[1, 8, 2048, 64]`` call built 8 GiB of products. The limit is lowered
    under this test's call; NaN sits in keys the mask removes, and an inf in the output gradient."""
    monkeypatch.setattr(numerics, "PAIRWISE_LIMIT", 1000)

    def refuse(*args, **kwargs):
        raise AssertionError("pairwise products built beyond PAIRWISE_LIMIT")

    for module in (numerics, reference):
        monkeypatch.setattr(module, "pairwise_scores", refuse)
        monkeypatch.setattr(module, "pairwise_values", refuse)
    q, k, v, scale = _plant("padding key and value")
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    up = torch.randn(2, HEADS, LENGTH, DIM, generator=torch.Generator().manual_seed(1))
    up[1, 0, 3, 1] = float("inf")
    with _engine(backend):
        name = "tiled" if backend.startswith("tiled") else backend
        out = attnkit.attention(*inputs, mask=MASK, scale=scale, backend=name)
        grads = torch.autograd.grad(out, inputs, up)
    assert out.shape == q.shape and all(g.shape == t.shape for g, t in zip(grads, (q, k, v)))


@pytest.mark.parametrize("where", CASES)
def test_triton_forward_alone_follows_the_definition(where):
    """attnkit's Triton forward with no check or redo after it: its partly attended blocks keep
    masked-out pairs out of ``P @ V`` themselves (the sequences' 12 keys are one block of 16,
    attended in part by every row), so its caller reads no value of the output (no host sync)."""
    triton_kernel = pytest.importorskip("attnkit._backends.triton")
    device = "cpu" if TRITON_ON_CPU else "cuda"
    q, k, v, scale = _plant(where)
    lo, hi = MASK.row_ranges(LENGTH, LENGTH)
    out, lse = triton_kernel.forward(*(t.to(device) for t in (q, k, v, lo, hi)), scale=scale, block_m=16,
                                     block_n=16)
    want_out, want_lse = _oracle(*(t.to(torch.float32 if where == "overflowing scale" else torch.float64)
                                   for t in (q, k, v)), scale)
    _same_pattern(out.cpu(), want_out, "output")
    _same_pattern(lse.cpu(), want_lse, "lse")


@pytest.mark.skipif(not TRITON_ON_CPU, reason="the Triton kernel on CPU tensors needs triton's interpreter")
def test_a_forward_on_the_triton_kernel_reads_no_value(monkeypatch):
    """No finiteness check (a host sync on a GPU) around the Triton forward when no gradient is
    wanted; the backward still checks its inputs before running the kernels."""
    q, k, v, _ = _plant("masked for some rows")

    def refuse(*tensors):
        raise AssertionError("a value was read")

    monkeypatch.setattr(numerics, "_largest", refuse)
    with tuning(kernel="triton"), torch.no_grad():
        out = attnkit.attention(q, k, v, mask=MASK, backend="tiled")
    want, _ = _oracle(q.double(), k.double(), v.double(), DIM**-0.5)
    _same_pattern(out, want, "output")


def test_the_extremes_read_in_one_transfer_equal_those_read_one_by_one():
    """On a GPU the finiteness checks read every tensor's extremes in one transfer (each read there
    is a synchronisation); that path, run here on CPU tensors, must give what the CPU's path gives:
    NaN over inf, inf over finite, 0 for an empty tensor, any dtype."""
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(3, 5, generator=g), torch.empty(0, 4), torch.randn(7, generator=g).to(torch.bfloat16),
               torch.tensor([1.0, -float("inf"), 2.0]), torch.tensor([float("nan"), float("inf")]),
               torch.tensor([-3.0, 2.5], dtype=torch.float16)]
    one_by_one = numerics._largest(*tensors, one_read=False)
    together = numerics._largest(*tensors, one_read=True)
    assert one_by_one[1] == 0.0 and one_by_one[3] == float("inf") and one_by_one[5] == 3.0
    assert math.isnan(one_by_one[4]) and math.isnan(together[4])
    assert [x for i, x in enumerate(together) if i != 4] == [x for i, x in enumerate(one_by_one) if i != 4]


@pytest.mark.parametrize("case", ["finite", "NaN out", "inf out", "-inf lse, row with keys", "-inf lse, empty row",
                                  "NaN lse, row with keys", "empty output"])
def test_the_flex_outputs_one_check_equals_the_two_checks(case):
    """FlexAttention's output and the lse of its rows with keys are checked as one set of extremes
    (on a GPU one read of the device, where each read waits for the queue): it must answer as the
    two checks do."""
    g = torch.Generator().manual_seed(4)
    out, lse = torch.randn(2, 3, 6, 4, generator=g), torch.randn(2, 3, 6, generator=g)
    lo = torch.tensor([[[0, 0, 1, 2, 5, 3]], [[0, 1, 1, 9, 4, 0]]])
    hi = torch.tensor([[[1, 2, 3, 4, 5, 6]], [[6, 6, 2, 9, 6, 6]]])  # rows (0, 4) and (1, 3) hold no key
    if case == "NaN out":
        out[1, 2, 3, 0] = float("nan")
    elif case == "inf out":
        out[0, 0, 5, 3] = -float("inf")
    elif case == "-inf lse, row with keys":
        lse[1, 1, 2] = -float("inf")
    elif case == "-inf lse, empty row":
        lse[0, 2, 4] = -float("inf")
    elif case == "NaN lse, row with keys":
        lse[0, 1, 0] = float("nan")
    elif case == "empty output":
        out = out[..., :0]
    two_checks = not numerics.all_finite(out) or numerics.keyed_rows_not_finite(lse, lo, hi)
    assert numerics.output_or_keyed_lse_not_finite(out, lse, lo, hi) == two_checks
    assert two_checks == (case not in ("finite", "-inf lse, empty row", "empty output"))
