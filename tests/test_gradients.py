"""Gradients: float64 gradcheck for every backend, and finite gradients where rows are empty."""

from __future__ import annotations

import pytest
import torch

import attnkit

BACKENDS = ["reference", "torch", "tiled"]


def _inputs(*shape_q, lk, dv, heads_kv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    *lead, lq, dk = shape_q
    kv_lead = list(lead)
    if heads_kv is not None:
        kv_lead[1] = heads_kv
    q = torch.randn(*lead, lq, dk, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(*kv_lead, lk, dk, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(*kv_lead, lk, dv, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, v


CONFIGS = {
    "plain-2d": dict(shape=(5, 4), lk=6, dv=3, kwargs={}),
    "causal-lq<lk": dict(shape=(2, 3, 4), lk=6, dv=5, kwargs=dict(causal=True)),
    "causal-lq>lk (empty rows)": dict(shape=(2, 7, 4), lk=3, dv=2, kwargs=dict(causal=True)),
    "gqa": dict(shape=(1, 4, 5, 3), lk=5, dv=2, heads_kv=2, kwargs=dict(causal=True)),
    "bool mask with empty row": dict(
        shape=(2, 4, 3), lk=5, dv=2,
        kwargs=dict(mask=torch.tensor([[True, False, True, False, True]] * 2 + [[False] * 5] + [[True] * 5]))),
    "additive mask": dict(
        shape=(2, 4, 3), lk=5, dv=2,
        kwargs=dict(mask=torch.randn(4, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64))),
    # 4-d inputs, one head per kv head and dv = dk: PyTorch's fused CPU kernel (others take its math path)
    "4-d causal": dict(shape=(1, 2, 5, 3), lk=5, dv=3, kwargs=dict(causal=True)),
    "4-d bool mask": dict(shape=(1, 2, 4, 3), lk=6, dv=3,
                          kwargs=dict(mask=torch.rand(4, 6, generator=torch.Generator().manual_seed(2)) < 0.7)),
    "decoding, gqa": dict(shape=(1, 4, 1, 3), lk=6, dv=2, heads_kv=2, kwargs=dict(causal=True)),
    "alibi": dict(shape=(1, 2, 4, 3), lk=4, dv=2, kwargs=dict(causal=True, alibi_slopes=torch.tensor([0.5, 0.25]))),
    "additive -inf row": dict(
        shape=(4, 3), lk=5, dv=2,
        kwargs=dict(mask=torch.tensor([[0.0] * 5, [float("-inf")] * 5, [0.5, -1.0, float("-inf"), 0, 0], [0.0] * 5],
                                      dtype=torch.float64))),
}


def _configured(backend, name):
    """``(attention on backend with CONFIGS[name]'s arguments, its float64 (q, k, v))``."""
    config = CONFIGS[name]
    inputs = _inputs(*config["shape"], lk=config["lk"], dv=config["dv"], heads_kv=config.get("heads_kv"))
    return (lambda q, k, v: attnkit.attention(q, k, v, backend=backend, **config["kwargs"])), inputs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradcheck(backend, name):
    fn, inputs = _configured(backend, name)
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradgradcheck(backend, name):
    """Second-order gradients (create_graph=True, then another backward: gradient penalties, MAML)
    on every backend and on whatever "auto" picks. SDPA's fused kernels have no derivative of their
    backward: "torch" and "auto"'s SDPA picks recompute by the reference formula there
    (second_order.py); the tiled op recomputes densely."""
    fn, inputs = _configured(backend, name)
    assert torch.autograd.gradgradcheck(fn, inputs)


@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradcheck_forward_mode_and_batched_gradients(backend, name):
    """gradcheck's other checks: forward-mode AD (jvp), output gradients batched by the older vmap
    (``is_grads_batched``: ``torch.autograd.functional.jacobian(vectorize=True)``; the op's backward
    read their values and failed) and batched tangents."""
    fn, inputs = _configured(backend, name)
    assert torch.autograd.gradcheck(fn, inputs, check_forward_ad=True, check_batched_grad=True,
                                    check_batched_forward_grad=True)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_sdpa_first_order_gradients_are_sdpas_own(backend):
    """The node that makes SDPA's output differentiable twice passes a first-order gradient straight
    to SDPA's own backward (the same bits as calling F.scaled_dot_product_attention)."""
    q, k, v = (t.float().detach().requires_grad_() for t in _inputs(1, 2, 8, 16, lk=8, dv=16))
    out = attnkit.attention(q, k, v, causal=True, backend=backend)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad(out, (q, k, v), up)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True),
                                   leaves, up)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_with_dropout_from_a_fixed_generator(backend):
    q, k, v = _inputs(2, 4, 3, lk=5, dv=2)

    def fn(q, k, v):
        g = torch.Generator().manual_seed(7)  # the same dropout pattern on every evaluation
        return attnkit.attention(q, k, v, dropout=0.3, generator=g, backend=backend)

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("backend", ["reference", "torch", "tiled", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("length", [6, 300])  # 300 makes PyTorch pick its tiled CPU kernel
@pytest.mark.parametrize("mask_kind", ["bool", "additive", "causal"])
def test_fully_masked_rows_give_zeros_and_finite_gradients(backend, dtype, length, mask_kind):
    g = torch.Generator().manual_seed(3)
    lq, lk = length, length // 2
    q = torch.randn(2, 2, lq, 16, generator=g).to(dtype).requires_grad_()
    k = torch.randn(2, 2, lk, 16, generator=g).to(dtype).requires_grad_()
    v = torch.randn(2, 2, lk, 8, generator=g).to(dtype).requires_grad_()
    empty = torch.zeros(lq, dtype=torch.bool)
    empty[: lq - lk] = True  # the rows causal leaves empty; masks below empty the same ones
    allowed = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    if mask_kind == "bool":
        kwargs = dict(mask=allowed)
    elif mask_kind == "additive":
        kwargs = dict(mask=torch.zeros(lq, lk, dtype=dtype).masked_fill(~allowed, float("-inf")))
    else:
        kwargs = dict(causal=True)
    out = attnkit.attention(q, k, v, backend=backend, **kwargs)
    assert torch.isfinite(out).all()
    assert (out[:, :, empty] == 0).all()
    assert (out[:, :, ~empty].abs().sum(-1) > 0).all()
    out.float().square().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, empty] == 0).all()
    _, weights = attnkit.attention(q, k, v, return_weights=True, backend=backend, **kwargs)
    assert (weights[:, :, empty] == 0).all()
    torch.testing.assert_close(weights[:, :, ~empty].float().sum(-1),
                               torch.ones(2, 2, int((~empty).sum())), atol=1e-2, rtol=0)


def test_guarded_path_for_kernels_that_do_not_zero_empty_rows(monkeypatch):
    """Off-CPU the torch backend guards empty rows itself; exercise that path here."""
    from attnkit._backends import fused

    monkeypatch.setattr(fused, "EMPTY_ROWS_GIVE_ZEROS", set())
    q, k, v = _inputs(2, 6, 4, lk=3, dv=2)
    mask = torch.tensor([[True, False, True], [False] * 3, [True] * 3, [False] * 3, [True, True, False], [False] * 3])
    for m in (mask, torch.zeros(6, 3, dtype=torch.float64).masked_fill(~mask, float("-inf"))):
        guarded = attnkit.attention(q, k, v, mask=m, backend="torch")
        reference = attnkit.attention(q, k, v, mask=m, backend="reference")
        torch.testing.assert_close(guarded, reference)
        assert (guarded[:, 1::2] == 0).all()
    assert torch.autograd.gradcheck(lambda q, k, v: attnkit.attention(q, k, v, mask=mask, backend="torch"), (q, k, v))


def test_no_keys_at_all_gives_zeros():
    q = torch.randn(2, 3, 4, requires_grad=True)
    k = torch.randn(2, 0, 4)
    v = torch.randn(2, 0, 5)
    out, weights = attnkit.attention(q, k, v, return_weights=True)
    assert out.shape == (2, 3, 5) and (out == 0).all() and weights.shape == (2, 3, 0)
    assert (attnkit.attention(q, k, v, backend="torch") == 0).all()
