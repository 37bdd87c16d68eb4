"""attnkit.trace: every attention call's named intermediates, checked against the oracle."""

from __future__ import annotations

import math

import torch

import attnkit
from attnkit import trace
from oracle import oracle_attention


def test_direct_call_records_every_step_and_they_are_consistent():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 7, 8, generator=g), torch.randn(2, 2, 7, 3, generator=g)
    mask = torch.rand(5, 7, generator=g) < 0.7
    with trace.record() as recorded:
        out = attnkit.attention(q, k, v, mask=mask, causal=True)
    assert len(recorded) == 1
    call = recorded[0]
    assert call.layer is None and call.module is None
    assert call.names == ["queries", "keys", "values", "scores", "scaled_scores", "masked_scores", "weights", "output"]
    expected_out, expected_w = oracle_attention(q, k, v, mask=mask, causal=True)
    torch.testing.assert_close(call["weights"].double(), expected_w, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(call["output"], out)
    torch.testing.assert_close(call["scaled_scores"], call["scores"] / math.sqrt(8))
    assert call.head("weights", 3).shape == (2, 5, 7)
    torch.testing.assert_close(call.head("keys", 3), k[:, 1])  # GQA: query head 3 reads kv head 1


def test_recording_is_off_by_default_and_scoped():
    q = torch.randn(3, 4)
    with trace.record() as recorded:
        attnkit.attention(q, q, q)
        attnkit.attention(q, q, q, causal=True)
    attnkit.attention(q, q, q)
    assert [c.index for c in recorded] == [0, 1]
    assert "masked_scores" in recorded[1].steps and "masked_scores" not in recorded[0].steps
