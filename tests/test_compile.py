"""The core traces into a single graph under torch.compile (fullgraph raises on any break): under
compile, "auto" keeps to the fused path, structured masks in their dense form."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import masks


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(causal=True),
    dict(mask=torch.ones(6, 6, dtype=torch.bool).tril()),
    dict(return_weights=True),
    dict(return_weights=True, causal=True, dropout=0.1),
    dict(dropout=0.1),  # eager "auto" sends this to attnkit's native kernel where it is built
    dict(mask=masks.sliding_window(3)),
    dict(mask=masks.causal() & masks.padding([4, 6])),
], ids=["plain", "causal", "mask", "weights", "weights-causal-dropout", "dropout", "window", "causal-padding"])
def test_attention_compiles_without_graph_breaks(kwargs):
    q = torch.randn(2, 4, 6, 8)
    kv = torch.randn(2, 2, 6, 8)
    compiled = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, **kwargs), fullgraph=True, backend="eager")
    result = compiled(q, kv, kv)
    if kwargs.get("dropout"):
        return
    expected = attnkit.attention(q, kv, kv, **kwargs)
    torch.testing.assert_close(result, expected)
