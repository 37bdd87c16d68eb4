"""Malformed calls fail before any backend runs, naming the argument and the shapes."""

from __future__ import annotations

import pytest
import torch

import attnkit

q3, k3, v3 = torch.randn(2, 5, 8), torch.randn(2, 7, 8), torch.randn(2, 7, 4)
q4, k4, v4 = torch.randn(2, 6, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 4)

BAD_CALLS = {
    "query not a tensor": (TypeError, r"query must be a torch.Tensor, got list", ([[1.0]], k3, v3), {}),
    "integer query": (TypeError, r"query must have a floating dtype.*torch.int64",
                      (torch.ones(2, 5, 8, dtype=torch.long), k3, v3), {}),
    "1-D key": (ValueError, r"key must have at least 2 dims.*\(8,\)", (q3, torch.randn(8), v3), {}),
    "rank mismatch": (ValueError, r"same number of dims.*query \(2, 5, 8\), key \(7, 8\)", (q3, k3[0], v3), {}),
    "Dk mismatch": (ValueError, r"key's last dim \(Dk\).*expected key \[\.\.\., Lk, 8\].*got key \(2, 7, 6\)",
                    (q3, torch.randn(2, 7, 6), v3), {}),
    "Lk mismatch": (ValueError, r"value must have as many rows \(Lk\) as key.*\[\.\.\., 7, Dv\].*got value \(2, 6, 4\)",
                    (q3, k3, torch.randn(2, 6, 4)), {}),
    "batch mismatch 3-D": (ValueError, r"leading dims must equal query's \(2,\).*got key \(3, 7, 8\)",
                           (q3, torch.randn(3, 7, 8), torch.randn(3, 7, 4)), {}),
    "batch mismatch 4-D": (ValueError, r"batch size must equal query's.*\[2, Hkv, Lk, Dk\].*key \(1, 3, 7, 8\)",
                           (q4, torch.randn(1, 3, 7, 8), torch.randn(1, 3, 7, 4)), {}),
    "heads not divisible": (ValueError, r"query's heads \(6\) to be a multiple of key/value's heads \(4\)",
                            (q4, torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 4)), {}),
    "key/value heads differ": (ValueError, r"key and value must have the same leading dims.*\(2, 3, 7, 8\).*\(2, 2, 7, 4\)",
                               (q4, k4, torch.randn(2, 2, 7, 4)), {}),
    "mixed dtypes": (TypeError, r"share one dtype.*query torch.float32, key torch.float64",
                     (q3, k3.double(), v3), {}),
    "mask does not broadcast": (ValueError, r"mask of shape \(5, 6\) does not broadcast.*\(2, 5, 7\)",
                                (q3, k3, v3), dict(mask=torch.ones(5, 6, dtype=torch.bool))),
    "mask too many dims": (ValueError, r"mask of shape \(1, 2, 5, 7\) does not broadcast",
                           (q3, k3, v3), dict(mask=torch.ones(1, 2, 5, 7, dtype=torch.bool))),
    "integer mask": (TypeError, r"mask must be bool.*torch.int64.*mask.bool\(\)",
                     (q3, k3, v3), dict(mask=torch.ones(5, 7, dtype=torch.long))),
    "mask not a tensor": (TypeError, r"mask must be None or a torch.Tensor", (q3, k3, v3), dict(mask=[[True]])),
    "negative dropout": (ValueError, r"dropout must be in \[0, 1\), got -0.1", (q3, k3, v3), dict(dropout=-0.1)),
    "dropout of one": (ValueError, r"dropout must be in \[0, 1\), got 1.0", (q3, k3, v3), dict(dropout=1.0)),
    "dropout not a number": (TypeError, r"dropout must be a float", (q3, k3, v3), dict(dropout="0.1")),
    "scale not a number": (TypeError, r"scale must be a real number", (q3, k3, v3), dict(scale="1")),
    "infinite scale": (ValueError, r"scale must be finite", (q3, k3, v3), dict(scale=float("inf"))),
    "causal not a bool": (TypeError, r"causal must be a bool, got int", (q3, k3, v3), dict(causal=1)),
    "generator not a Generator": (TypeError, r"generator must be a torch.Generator", (q3, k3, v3),
                                  dict(dropout=0.1, generator=3)),
    "unknown backend": (ValueError, r"unknown backend 'flash'; available: \('auto', 'reference', 'torch'",
                        (q3, k3, v3), dict(backend="flash")),
    "empty feature dim": (ValueError, r"Dk >= 1", (torch.randn(2, 5, 0), torch.randn(2, 7, 0), v3), {}),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_call_raises_a_clear_error(name):
    error, pattern, args, kwargs = BAD_CALLS[name]
    with pytest.raises(error, match=pattern):
        attnkit.attention(*args, **kwargs)


def test_meta_device_mismatch_is_reported():
    with pytest.raises(ValueError, match=r"one device.*query cpu, key meta"):
        attnkit.attention(q3, torch.empty(2, 7, 8, device="meta"), v3)


def test_float_mask_in_another_dtype_is_used_as_an_additive_bias():
    bias = torch.randn(5, 7, dtype=torch.float64)
    out = attnkit.attention(q3, k3, v3, mask=bias)
    torch.testing.assert_close(out, attnkit.attention(q3, k3, v3, mask=bias.float(), backend="reference"))


def test_weights_from_a_backend_that_cannot_return_them(monkeypatch):
    from attnkit import _backends

    weightless = _backends.Backend("weightless", lambda call: (call.query, None), "returns no weights")
    monkeypatch.setitem(_backends._REGISTRY, "weightless", weightless)
    with pytest.raises(ValueError, match=r"backend 'weightless' cannot return attention weights.*'reference'"):
        attnkit.attention(q3, k3, v3, backend="weightless", return_weights=True)


def test_backends_are_listed():
    assert attnkit.backends() == ("auto", "reference", "torch", "tiled")


def test_a_validated_call_holds_every_field_the_dataclass_declares() -> None:
    """make_call and with_fields build AttentionCall without its __init__ (for speed): the result
    must still hold exactly the declared fields, in order, and with_fields must act as replace."""
    from dataclasses import fields, replace

    from attnkit._call import AttentionCall, make_call, with_fields

    call = make_call(q4, k4, v4, mask=attnkit.masks.sliding_window(3), causal=False, scale=0.5, dropout=0.1,
                     generator=None, return_weights=False, softcap=20.0, sinks=torch.zeros(6))
    declared = [field.name for field in fields(AttentionCall)]
    assert list(call.__dict__) == declared
    rebuilt = AttentionCall(**{name: getattr(call, name) for name in declared})
    assert all(getattr(rebuilt, name) is getattr(call, name) for name in declared)
    seed = torch.tensor(7)
    changed, expected = with_fields(call, seed=seed, route="x"), replace(call, seed=seed, route="x")
    assert list(changed.__dict__) == declared
    assert all(getattr(changed, name) is getattr(expected, name) for name in declared)
    assert call.seed is None and call.route is None  # the original is untouched
    with pytest.raises(TypeError, match="no field 'routes'"):
        with_fields(call, routes=1)
    with pytest.raises(AttributeError):  # still frozen
        changed.scale = 1.0
