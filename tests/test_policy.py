"""What "auto" runs (``attnkit._backends.policy``): device first, a backend's declared support
respected, an explicit backend never silently replaced (its two documented exceptions hold)."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import masks, trace
from attnkit._backends import Backend, auto_runs, backends, choose, native, register_backend, _REGISTRY
from attnkit._call import make_call


def _call(device="cpu", mask=None, dropout=0.0, **kwargs):
    q = torch.empty(1, 8, 4096, 64, device=device)
    return make_call(q, q, q, mask=mask, causal=False, scale=None, dropout=dropout, generator=None,
                     return_weights=False, **kwargs)


def test_on_a_device_where_attnkit_was_not_measured_auto_runs_pytorchs_kernels():
    """The meta device stands for any device but the CPU: structured masks and dropout, which go
    to attnkit's kernels on the CPU, go to "torch" there."""
    for kwargs in (dict(mask=masks.sliding_window(256)), dict(dropout=0.1), dict(mask=masks.document([2048] * 2))):
        assert choose(_call(**kwargs)).backend == "tiled", kwargs
        assert choose(_call("meta", **kwargs)).backend == "torch", kwargs
    assert choose(_call("meta", return_lse=True)).backend == "tiled"  # the one backend with an lse
    out = attnkit.attention(*(torch.empty(1, 2, 64, 8, device="meta") for _ in range(3)), mask=masks.causal())
    assert out.device.type == "meta" and out.shape == (1, 2, 64, 8)


def test_a_backend_runs_only_on_the_devices_it_declares():
    register_backend(Backend("cuda-only", lambda call: (call.query, None), "test backend", devices=frozenset({"cuda"})))
    try:
        assert "cuda-only" in backends()
        q = torch.randn(2, 3, 4)
        with pytest.raises(ValueError, match=r"backend 'cuda-only' runs on \['cuda'\], the inputs are on 'cpu'"):
            attnkit.attention(q, q, q, backend="cuda-only")
    finally:
        del _REGISTRY["cuda-only"]


def test_explicit_backends_are_kept_and_the_two_documented_exceptions_change_nothing():
    """A named backend runs, or the call fails saying why; it is replaced only where that cannot
    change the result: no keys at all (every row is zeros), and while a trace records (the
    reference formula, the one that reports its steps, gives the same numbers)."""
    q = torch.randn(1, 2, 5, 4)
    empty = q[:, :, :0]
    for name in ("reference", "torch", "tiled"):
        assert torch.equal(attnkit.attention(q, empty, empty, backend=name), torch.zeros(1, 2, 5, 4))
    k = torch.randn(1, 2, 7, 4)
    with pytest.raises(ValueError, match="backend 'torch' cannot return the log-sum-exp"):
        attnkit.attention(q, k, k, backend="torch", return_lse=True)
    expected = attnkit.attention(q, k, k, mask=masks.causal(), backend="tiled")
    with trace.record() as recording:
        traced = attnkit.attention(q, k, k, mask=masks.causal(), backend="tiled")
    assert "weights" in recording.calls[0].names
    torch.testing.assert_close(traced, expected)


def test_auto_runs_names_the_kernel_the_op_picks():
    assert auto_runs(_call(mask=masks.sliding_window(256))) in ("tiled:native", "tiled:blocks")
    kernel_serves = native.serves("cpu", torch.float32, False)
    # nothing to skip: the native kernel still beat SDPA over the mask as a tensor
    assert auto_runs(_call(mask=masks.padding([4096]))) == ("tiled:native" if kernel_serves else "tiled:dense")
    short = torch.empty(1, 8, 64, 64)  # below NATIVE_MIN_PAIRS: the fused kernel over the dense mask
    assert auto_runs(make_call(short, short, short, mask=masks.sliding_window(16), causal=False, scale=None,
                               dropout=0.0, generator=None, return_weights=False)) == "tiled:dense"
    assert auto_runs(_call()) == ("tiled:native" if kernel_serves else "torch")


@pytest.mark.parametrize("mask", [None, masks.causal()])
def test_a_decoding_step_under_causal_reaches_sdpa_with_no_mask(monkeypatch, mask):
    # Bottom-right causal gives one query row every key: building a [1, Lk] mask for it made
    # SDPA take its masked path on every generated token (0.95x transformers' sdpa in generate()),
    # which packs a GQA step's query heads into rows over their key/value head: so does attnkit.
    import torch.nn.functional as F

    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("attn_mask"), tuple(args[0].shape)))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    query, key, value = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    out = attnkit.attention(query, key, value, mask=mask, causal=mask is None)
    expected = attnkit.attention(query, key, value, backend="reference")  # one row: every key
    # and as [B, Hkv, G, D]: SDPA's GQA path took 1.7x the time of the packed rows
    assert seen == [(None, (2, 2, 2, 16))]
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("mask_shape", [None, (2, 1, 1, 9), (9,), (2, 4, 1, 9)])
def test_a_gqa_decoding_step_equals_the_reference_whichever_mask(mask_shape):
    # One query row per head runs as [B, Hkv, G, D] over the shared key/value head where the mask is
    # the same for every head; a per-head mask keeps SDPA's GQA path. Both against float64.
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 1, 16, generator=generator, dtype=torch.float64)
    key, value = (torch.randn(2, 2, 9, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    mask = None if mask_shape is None else torch.rand(mask_shape, generator=generator) < 0.7
    got = attnkit.attention(*(t.float() for t in (query, key, value)), mask=mask, causal=True)
    expected = attnkit.attention(query, key, value, mask=mask, causal=True, backend="reference")
    torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask", [masks.padding([5, 9]), masks.key_ranges(torch.tensor([[3], [0]]), torch.tensor([[9], [6]])),
                                  masks.sliding_window(4) & masks.padding([9, 7])],
                         ids=["right padding", "left padding", "window and padding"])
def test_a_decoding_step_with_a_structured_mask_runs_sdpa_on_its_one_row(monkeypatch, mask):
    # One query row's mask is one row of keys per sequence: SDPA with it ([B, 1, 1, Lk], packed GQA)
    # took 0.26 ms a call where the op's planning took 1.1 ms (left-padded batch, generate()).
    import torch.nn.functional as F

    from oracle import oracle_attention

    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((tuple(kwargs["attn_mask"].shape), tuple(args[0].shape)))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 1, 16, generator=generator, dtype=torch.float64)
    key, value = (torch.randn(2, 2, 9, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    call = make_call(query.float(), key.float(), value.float(), mask=mask, causal=False, scale=None, dropout=0.0,
                     generator=None, return_weights=False)
    assert choose(call).backend == "torch"
    got = attnkit.attention(query.float(), key.float(), value.float(), mask=mask)
    assert seen == [((2, 1, 1, 9), (2, 2, 2, 16))]
    expected, _ = oracle_attention(query, key, value, mask=mask.dense(1, 9))
    torch.testing.assert_close(got, expected.float(), atol=1e-6, rtol=0)
