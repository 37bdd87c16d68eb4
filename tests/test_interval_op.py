"""The tiled backend as one PyTorch custom op (``attnkit::interval_attention``): traced by
``torch.compile`` without graph breaks or a dense mask, transformed by ``torch.func``, right under
second-order autograd and ``saved_tensors_hooks``, for any rank, with bias gradients; checked
against the reference backend (and, through it, the float64 oracle the other files use)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.func import grad, jacrev, vmap

import attnkit
from attnkit import masks
from attnkit._backends import auto_runs, interval_op, native, tiled_plan
from attnkit._call import make_call
from conftest import tiled_kernel
from oracle import output_and_gradients

MASKS = {
    "window": masks.sliding_window(5),
    "documents & causal": masks.document([7, 9, 8]) & masks.causal(),
    "causal & padding": masks.causal() & masks.padding([24, 13]),
}
# fp32 against fp32: every path sums the same few O(1) products in another order
CLOSE = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(params=["native", "pytorch"])
def kernel(request):
    """Each test runs on attnkit's native kernel (where built) and on PyTorch's kernels per block."""
    with tiled_kernel(request.param):
        yield request.param


def _qkv(batch=2, heads=4, kv_heads=2, length=24, dim=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, length, dim, generator=g, dtype=dtype),
            torch.randn(batch, kv_heads, length, dim, generator=g, dtype=dtype),
            torch.randn(batch, kv_heads, length, dim, generator=g, dtype=dtype))


# -- torch.compile ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MASKS))
def test_compile_traces_one_op_and_no_dense_mask(name, kernel):
    """fullgraph: no graph break; the graph holds the op and nothing of size Lq x Lk."""
    q, k, v = (t.requires_grad_() for t in _qkv())
    mask = MASKS[name]
    explanation = torch._dynamo.explain(lambda q, k, v: attnkit.attention(q, k, v, mask=mask))(q, k, v)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    nodes = list(explanation.graphs[0].graph.nodes)
    assert any("autograd_function_apply" in str(n.target) for n in nodes)
    for node in nodes:
        values = node.meta.get("example_value")
        for value in values if isinstance(values, tuple) else (values,):
            if isinstance(value, torch.Tensor):
                assert value.shape[-2:] != (24, 24), f"{node.target} builds an Lq x Lk tensor"


@pytest.mark.parametrize("name", list(MASKS))
def test_compiled_runs_the_eager_kernels_forward_and_backward(name, kernel, monkeypatch):
    """The op picks its kernel at run time from the data, so compiled and eager run the same ones,
    forward and backward: the forward equal to the last bit, the gradients to rounding (the
    compiled graph computes the upstream gradient in its own order)."""
    from attnkit._backends import policy

    chosen = []
    real = policy.kernel_for
    monkeypatch.setattr(policy, "kernel_for", lambda *a, **k: chosen.append(real(*a, **k)) or chosen[-1])
    mask = MASKS[name]

    def loss(q, k, v):
        return attnkit.attention(q, k, v, mask=mask).square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    inputs = [t.requires_grad_() for t in _qkv()]
    eager_loss = loss(*inputs)
    eager_grads = torch.autograd.grad(eager_loss, inputs)
    eager_kernels, chosen[:] = list(chosen), []
    compiled_loss = compiled(*inputs)
    compiled_grads = torch.autograd.grad(compiled_loss, inputs)
    # the forward chooses once and the backward runs what it ran (eager asks once more, in the
    # autograd backward, only where the kernel choice could be off the native kernel)
    assert eager_kernels[0] == chosen[0] and len(chosen) == 1
    assert torch.equal(eager_loss, compiled_loss)
    for a, b in zip(eager_grads, compiled_grads):
        torch.testing.assert_close(a, b, **CLOSE)


def test_auto_makes_the_same_kernel_choice_compiled_and_eager():
    """A short mask runs the fused kernel densely, a long sparse one stays sparse: in both cases
    the compiled result is the eager one bit for bit (inductor this time)."""
    chosen = []
    for length, mask in ((32, masks.sliding_window(4)), (512, masks.sliding_window(16))):
        q, k, v = _qkv(batch=1, length=length)
        chosen.append(auto_runs(make_call(q, k, v, mask=mask, causal=False, scale=None, dropout=0.0,
                                          generator=None, return_weights=False)))
        compiled = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, mask=mask), fullgraph=True)
        assert torch.equal(compiled(q, k, v), attnkit.attention(q, k, v, mask=mask)), chosen[-1]
    assert chosen[0] == "tiled:dense" and chosen[1] != "tiled:dense"


def test_opcheck_schema_fake_kernel_and_autograd_registration():
    """PyTorch's own checker for custom ops: schema, fake (meta) kernel, autograd registration,
    dynamic shapes under AOT dispatch; in bf16 too, where the op returns the output's residual."""
    q, k, v = _qkv(batch=1, length=8)
    lo, hi = torch.zeros(1, 1, 8, dtype=torch.long), torch.arange(1, 9)[None, None]  # [S, R, Lq]
    bias = torch.randn(1, 1, 8, 8, requires_grad=True)
    slopes, sinks = torch.tensor([0.5]), torch.tensor([0.3], requires_grad=True)
    half = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    for args in ((q.requires_grad_(), k, v, lo, hi, None, None, None, 0.5, None, 0.0, None, True, False, "", True),
                 (q, k, v, lo, hi, bias, None, None, 0.5, None, 0.0, None, False, True, "", False),
                 (q, k, v, lo, hi, None, slopes, sinks, 0.5, 3.0, 0.0, None, False, False, "", True),
                 (*half, lo, hi, None, None, sinks, 0.5, None, 0.0, None, False, False, "", True),
                 (*half, lo, hi, None, None, None, 0.5, None, 0.0, None, False, False, "blocks", True)):
        results = torch.library.opcheck(torch.ops.attnkit.interval_attention.default, args)
        assert set(results.values()) == {"SUCCESS"}, results


# -- autograd ---------------------------------------------------------------------------------------


def _reference(q, k, v, mask, **kwargs):
    return attnkit.attention(q, k, v, mask=mask, backend="reference", **kwargs)


def test_torch_func_grad_vmap_and_jacrev_match_the_reference(kernel):
    mask = masks.sliding_window(4) & masks.padding([20, 11])
    q, k, v = _qkv()

    def loss(backend):
        return lambda q: attnkit.attention(q, k, v, mask=mask, backend=backend).square().sum()

    torch.testing.assert_close(grad(loss("tiled"))(q), grad(loss("reference"))(q), **CLOSE)
    stacked = torch.stack([q, q * 0.5, -q])
    run = lambda backend: vmap(lambda x: attnkit.attention(x, k, v, mask=mask, backend=backend))(stacked)  # noqa: E731
    torch.testing.assert_close(run("tiled"), run("reference"), **CLOSE)
    small = q[:, :, :5]
    window = masks.sliding_window(3)
    jacobian = jacrev(lambda x: attnkit.attention(x, x, x, mask=window, backend="tiled"))(small)
    expected = jacrev(lambda x: attnkit.attention(x, x, x, mask=window, backend="reference"))(small)
    torch.testing.assert_close(jacobian, expected, **CLOSE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_of_vmap_matches_a_loop_of_backwards(kernel, dtype):
    """torch.func.grad over vmap(f): the op's batched backward runs while its inputs still track the
    grad level (the op's autograd layer then built an autograd.Function that functorch refused),
    and in half precision it reads the output's residual as a plain backward does."""
    mask = masks.document([9, 11]) & masks.causal()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 2, 20, 32, generator=g).to(dtype) for _ in range(3))

    def loss(x, key, value):
        return attnkit.attention(x[None], key[None], value[None], mask=mask, backend="tiled").float().square().sum()

    got = grad(lambda x: vmap(loss)(x, k, v).sum())(q)
    expected = []
    for i in range(3):
        leaf = q[i].clone().requires_grad_()
        loss(leaf, k[i], v[i]).backward()
        expected.append(leaf.grad)
    assert torch.equal(got, torch.stack(expected))


def _masked_reference(query, key, value, allowed):
    """Plain float64 attention written out here (no attnkit code), for transforms of any order."""
    scores = (query @ key.transpose(-1, -2) / query.shape[-1] ** 0.5).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ value


TWICE = {
    "hessian": torch.func.hessian,
    "jacrev(jacrev)": lambda f: jacrev(jacrev(f)),
    "jacfwd(jacfwd)": lambda f: torch.func.jacfwd(torch.func.jacfwd(f)),
    "grad(grad)": lambda f: grad(lambda x: grad(f)(x).sin().sum()),
}


@pytest.mark.parametrize("transform", list(TWICE))
@pytest.mark.parametrize("mask_kind", ["window", "causal", "none"])
@pytest.mark.parametrize("backend", ["tiled", "auto", "torch"])
def test_torch_func_transforms_that_differentiate_twice_match_plain_ops(transform, mask_kind, backend, kernel):
    """hessian and the nested jacobians and grads: the op's backward and forward-mode rule are
    kernels, which an outer level would take for constants (the tiled backend's jacrev(jacrev(f))
    gave second derivatives missing terms, silently), and SDPA's have no derivative at all: such
    transforms run the call in plain ops. The same mask object is used before, inside and after
    them (a cache filled inside a transform held tensors that later calls found escaped)."""
    q, k, v = (t[:1, :2, :6, :3].double() for t in _qkv())
    mask = {"window": masks.sliding_window(3), "causal": masks.causal(), "none": None}[mask_kind]
    allowed = torch.ones(6, 6, dtype=torch.bool) if mask is None else mask.dense(6, 6)
    attnkit.attention(q, k, v, mask=mask, backend=backend)  # fills the caches outside any transform

    def loss(fn):
        return lambda x: fn(x).square().sum()

    got = TWICE[transform](loss(lambda x: attnkit.attention(x, k, v, mask=mask, backend=backend)))(q)
    expected = TWICE[transform](loss(lambda x: _masked_reference(x, k, v, allowed)))(q)
    assert expected.abs().max() > 0
    torch.testing.assert_close(got, expected)
    after = attnkit.attention(q, k, v, mask=mask, backend=backend)  # nothing escaped into a cache
    torch.testing.assert_close(after, _masked_reference(q, k, v, allowed))


@pytest.mark.parametrize("backend", ["tiled", "auto", "torch"])
@pytest.mark.parametrize("api", ["torch.func.jvp", "forward_ad"])
@pytest.mark.parametrize("moving", ["query, key and value", "value alone"])
def test_forward_mode_ad_matches_the_reference(backend, api, moving, kernel):
    """jvp (forward-mode AD), through torch.func and through torch.autograd.forward_ad's dual
    tensors, with GQA, a structured mask, soft-capping, ALiBi and sinks: the output's tangent and
    the lse's equal the reference backend's (plain ops, float64). SDPA has no forward-mode rule:
    such calls take the materialised formula; the op's rule recomputes densely. With the value
    alone moving, the lse does not move (the rule asked autograd for its gradient and failed)."""
    from torch.autograd import forward_ad

    q, k, v = (t[:, :, :10].double() for t in _qkv())
    tangents = tuple(torch.randn_like(t) for t in (q, k, v))
    if moving == "value alone":
        tangents = (torch.zeros_like(q), torch.zeros_like(k), tangents[2])
    options = dict(mask=masks.sliding_window(4) & masks.padding([10, 7]), softcap=3.0,
                   alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64),
                   sinks=torch.tensor([0.1, -0.2, 0.3, 0.0], dtype=torch.float64))
    if backend == "torch":
        options = dict(mask=options["mask"])  # SDPA's route: its own inputs

    def run(name, *inputs):
        return attnkit.attention(*inputs, backend=name, **options)

    if api == "torch.func.jvp":
        _, got = torch.func.jvp(lambda *x: run(backend, *x), (q, k, v), tangents)
    elif moving == "value alone":
        with forward_ad.dual_level():
            got = forward_ad.unpack_dual(run(backend, q, k, forward_ad.make_dual(v, tangents[2]))).tangent
    else:
        with forward_ad.dual_level():
            out = run(backend, *(forward_ad.make_dual(p, t) for p, t in zip((q, k, v), tangents)))
            got = forward_ad.unpack_dual(out).tangent
    _, expected = torch.func.jvp(lambda *x: run("reference", *x), (q, k, v), tangents)
    torch.testing.assert_close(got, expected)
    if backend == "tiled":  # the lse's tangent, without the score modifiers: a plain logsumexp
        mask = options["mask"]
        allowed = mask.dense(10, 10, ndim=4)

        def lse_by_plain_ops(query, key, value):
            scores = query @ key.repeat_interleave(2, 1).transpose(-1, -2) / query.shape[-1] ** 0.5
            return scores.masked_fill(~allowed, float("-inf")).logsumexp(-1)

        _, got = torch.func.jvp(lambda *x: attnkit.attention(*x, mask=mask, backend="tiled", return_lse=True)[1],
                                (q, k, v), tangents)
        torch.testing.assert_close(got, torch.func.jvp(lse_by_plain_ops, (q, k, v), tangents)[1])


@pytest.mark.parametrize("transform", ["jvp", "hessian"])
def test_the_flex_engine_hands_forward_mode_and_nested_transforms_to_the_op(transform):
    """FlexAttention has no forward-mode rule and its backward no derivative: under jvp or hessian
    the tiled backend's Flex engine (the GPU route's first; eager on the CPU) gives the call to the
    interval op, whose rule and plain ops handle them."""
    from attnkit._backends.tiled_plan import tuning

    q, k, v = (t[:1, :2, :6, :3].double() for t in _qkv())
    mask = masks.sliding_window(3)
    allowed = mask.dense(6, 6)

    def on(fn):
        return lambda x: fn(x, k, v).square().sum()

    def flex(x, key, value):
        with tuning(kernel="flex"):
            return attnkit.attention(x, key, value, mask=mask, backend="tiled")

    if transform == "jvp":
        direction = torch.randn_like(q)
        got = torch.func.jvp(lambda x: flex(x, k, v), (q,), (direction,))[1]
        expected = torch.func.jvp(lambda x: _masked_reference(x, k, v, allowed), (q,), (direction,))[1]
    else:
        got = torch.func.hessian(on(flex))(q)
        expected = torch.func.hessian(on(lambda x, key, value: _masked_reference(x, key, value, allowed)))(q)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("backend", ["tiled", "auto", "torch", "reference"])
def test_vmap_with_dropout_follows_its_randomness_flag(backend, kernel):
    """vmap(randomness="same"): every sample draws alike, so each equals its own call with the same
    generator (output and gradients, on the reference backend: the pattern is every backend's);
    the op folded samples into its batch, which gave each sample another pattern. "different":
    identical samples come out different (the op refused a per-sample seed; "torch" had no batching
    rule for its in-place softmax)."""
    q, k, v = (t[:, :2, :12].double().expand(3, -1, -1, -1, -1).clone() for t in _qkv(batch=1))
    q = q + torch.arange(3, dtype=torch.float64).view(3, 1, 1, 1, 1)  # samples of their own
    mask = masks.sliding_window(5)

    def call(name):
        return lambda a, b, c: attnkit.attention(a, b, c, mask=mask, dropout=0.3, backend=name,
                                                 generator=torch.Generator().manual_seed(7))

    def loss(name):
        return lambda a, b, c: call(name)(a, b, c).square().sum()

    got = vmap(call(backend), randomness="same")(q, k, v)
    grads = vmap(grad(loss(backend), argnums=(0, 1, 2)), randomness="same")(q, k, v)
    for index in range(3):
        sample = (q[index], k[index], v[index])
        torch.testing.assert_close(got[index], call("reference")(*sample))
        for got_grad, expected in zip(grads, grad(loss("reference"), argnums=(0, 1, 2))(*sample)):
            torch.testing.assert_close(got_grad[index], expected)
    same_inputs = (q[:1].expand(3, -1, -1, -1, -1), k, v)
    different = vmap(lambda a, b, c: attnkit.attention(a, b, c, mask=mask, dropout=0.3, backend=backend),
                     randomness="different")(*same_inputs)
    assert not torch.equal(different[0], different[1]) and not torch.equal(different[1], different[2])


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_gradient_penalties_get_the_reference_second_order_gradients(kernel, dropout):
    """create_graph=True then a second backward (a gradient penalty): the tiled backend's
    second-order gradients equal the reference's, dropout included (same pattern); never zero."""
    mask = masks.sliding_window(6) & masks.causal()

    def second_order(backend):
        q, k, v = (t.double().requires_grad_() for t in _qkv(length=16))
        out = attnkit.attention(q, k, v, mask=mask, backend=backend, dropout=dropout,
                                generator=torch.Generator().manual_seed(4))
        first = torch.autograd.grad(out.square().sum(), (q, k, v), create_graph=True)
        sum(g.square().sum() for g in first).backward()
        return q.grad, k.grad, v.grad

    for got, want in zip(second_order("tiled"), second_order("reference")):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want)


def test_a_learned_bias_gets_the_reference_gradient(kernel):
    """A dense float mask is a differentiable input of the tiled op, explicit or under "auto" with
    return_lse, with the structured mask on top."""
    q, k, v = _qkv()
    for shape in ((24, 24), (1, 4, 24, 24), (2, 1, 24, 24)):
        bias = torch.randn(shape, requires_grad=True)
        out, lse = attnkit.attention(q, k, v, mask=bias, causal=True, backend="tiled", return_lse=True)
        (tiled_grad,) = torch.autograd.grad(out.square().sum() + lse.sum(), bias)
        _, auto_lse = attnkit.attention(q, k, v, mask=bias, causal=True, return_lse=True)
        (auto_grad,) = torch.autograd.grad(auto_lse.sum(), bias)
        expected_out = _reference(q, k, v, bias, causal=True)
        (expected,) = torch.autograd.grad(expected_out.square().sum(), bias)
        assert tiled_grad is not None and auto_grad is not None
        # lse = logsumexp of the scores: its gradient with respect to the bias is the weights
        _, weights = attnkit.attention(q, k, v, mask=bias.detach(), causal=True, backend="reference",
                                       return_weights=True)
        torch.testing.assert_close(tiled_grad, expected + _summed_like(weights, shape), **CLOSE)
        torch.testing.assert_close(auto_grad, _summed_like(weights, shape), **CLOSE)


def _summed_like(weights, shape):
    return weights.sum_to_size(shape)


def test_saved_tensors_go_through_saved_tensors_hooks(kernel):
    """Everything the backward needs is saved through save_for_backward: hooks that copy on pack
    see query, key and value, and an in-place change to the inputs after the forward does not
    reach the backward."""
    q, k, v = (t.requires_grad_() for t in _qkv())
    mask = masks.sliding_window(5)
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t.detach().clone()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        a, b, c = (t * 1.0 for t in (q, k, v))  # non-leaf inputs, so they can be changed in place
        out = attnkit.attention(a, b, c, mask=mask, backend="tiled")
    assert q.shape in packed and k.shape in packed
    with torch.no_grad():
        for t in (a, b, c):
            t.add_(1.0)
    got = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.autograd.grad(_reference(q, k, v, mask).square().sum(), (q, k, v))
    for x, y in zip(got, expected):
        torch.testing.assert_close(x, y, **CLOSE)


# -- any rank ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [2, 3, 4, 5, 6])
def test_every_rank_runs_tiled_with_lse_and_dropout(rank, kernel):
    """[..., L, D] with 0 to 4 leading dims: the tiled backend, its lse and dropout (the same
    pattern as the reference's) agree with the reference backend, forward and backward."""
    lead = (2, 3, 2, 1)[:rank - 2]
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(*lead, 12, 8, generator=g, requires_grad=True) for _ in range(3))
    mask = masks.sliding_window(4)
    for dropout in (0.0, 0.25):
        kwargs = dict(mask=mask, dropout=dropout)
        out, lse = attnkit.attention(q, k, v, backend="tiled", return_lse=True,
                                     generator=torch.Generator().manual_seed(9), **kwargs)
        expected = _reference(q, k, v, generator=torch.Generator().manual_seed(9), **kwargs)
        assert out.shape == (*lead, 12, 8) and lse.shape == (*lead, 12)
        torch.testing.assert_close(out, expected, **CLOSE)
        got = torch.autograd.grad(out.sum(), (q, k, v))
        want = torch.autograd.grad(expected.sum(), (q, k, v))
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, **CLOSE)
    weights_lse = torch.logsumexp((q @ k.transpose(-1, -2) / 8**0.5).masked_fill(~mask.dense(12, 12), float("-inf")), -1)
    torch.testing.assert_close(lse, weights_lse, **CLOSE)


# -- state ------------------------------------------------------------------------------------------


def test_tuning_is_local_to_a_thread():
    """tiled_plan.tuning changes the settings of this thread only."""
    import threading

    seen = {}
    entered, release = threading.Event(), threading.Event()

    def other():
        entered.wait()
        seen["other"] = tiled_plan.settings().block_size
        release.set()

    thread = threading.Thread(target=other)
    thread.start()
    with tiled_plan.tuning(block_size=3):
        entered.set()
        release.wait()
        seen["inside"] = tiled_plan.settings().block_size
    thread.join()
    assert seen == {"other": tiled_plan.Settings().block_size, "inside": 3}
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        with tiled_plan.tuning(block_size=0):
            pass
    with pytest.raises(TypeError, match="unknown setting 'blocks'"):
        with tiled_plan.tuning(blocks=4):
            pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lse", [False, True])
def test_rows_of_two_key_ranges_match_float64(dtype, lse):
    """A window or the first 15 tokens: each row attends two ranges of keys, and the native kernel
    runs one backward per range from the merged output and lse. A range's weights then sum to less
    than 1, so anything it takes from them alone in place of the merged output (FlashAttention's
    row term) is wrong: gradients, with and without the lse's, against float64."""
    mask = (masks.sliding_window(7) | masks.padding([15])) & masks.causal()
    assert mask.row_ranges(100, 100)[0].shape[1] == 2  # two ranges a row
    g = torch.Generator().manual_seed(4)
    q, k, v, grad_out = (torch.randn(1, 2, 100, 32, generator=g).to(dtype).float() for _ in range(4))
    weights = torch.randn(1, 2, 100, generator=g)

    def ours(a, b, c):
        with tiled_kernel("native"), tiled_plan.tuning(kernel="native"):
            return attnkit.attention(a, b, c, mask=mask, backend="tiled", return_lse=True)

    def reference(a, b, c):
        with tiled_plan.tuning(kernel="blocks"):  # PyTorch's kernels block by block: the lse too
            return attnkit.attention(a, b, c, mask=mask, backend="tiled", return_lse=True)

    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    lse_weight = weights if lse else None
    got = output_and_gradients(ours, (q, k, v), grad_out, dtype, lse_weight)
    want = output_and_gradients(reference, (q, k, v), grad_out, torch.float64, lse_weight)
    for what, got, want in zip(("output", "dq", "dk", "dv"), got, want):
        assert (got.double() - want).abs().max().item() <= tolerance, (what, (got.double() - want).abs().max().item())


@pytest.mark.parametrize("kernel", ["native", "blocks"])
def test_the_backward_of_key_segments_from_the_whole_output_sums_to_the_whole(kernel):
    """attnkit.distributed's ring backward: each rank's call takes a segment of the keys with the
    whole call's output and lse (and grad_out). The segments' query gradients add up to the whole
    call's, so no kernel may take the row term from a segment's own weights (they sum to < 1)."""
    from attnkit._backends.interval_inputs import IntervalInputs

    g = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(1, 2, 256, 32, generator=g) for _ in range(4))
    lo, hi = (t.reshape(1, 1, 256).contiguous() for t in masks.causal().row_ranges(256, 256))
    with tiled_kernel("native") if kernel == "native" else contextlib.nullcontext():
        whole = IntervalInputs(q, k, v, lo, hi, scale=32 ** -0.5, kernel=kernel)
        out, lse, ran, _ = interval_op.forward_op(whole)
        dq_whole = interval_op.backward_op(grad_out, None, out, lse, ran, whole)[0]
        dq = torch.zeros_like(q)
        for a, b in ((0, 128), (128, 256)):
            segment = IntervalInputs(q, k[:, :, a:b].contiguous(), v[:, :, a:b].contiguous(),
                                     (lo - a).clamp(0, b - a).contiguous(), (hi - a).clamp(0, b - a).contiguous(),
                                     scale=32 ** -0.5, kernel=kernel)
            dq += interval_op.backward_op(grad_out, None, out, lse, None, segment)[0]
    torch.testing.assert_close(dq, dq_whole, rtol=1e-4, atol=1e-4)
