"""The seed notebooks' printed numbers are a specification: attnkit reproduces them."""

from __future__ import annotations

import math

import torch

import attnkit
import seed002_printed
from attnkit import toy, trace

# --- seed 000: the worked scaled dot-product example (it divides by sqrt(4) for 3-d vectors) ---
TEMP_K = torch.tensor([[10, 0, 0], [0, 10, 0], [0, 0, 10], [0, 0, 10]], dtype=torch.float32)
TEMP_V = torch.tensor([[1, 0, 1], [10, 0, 2], [100, 5, 0], [1000, 6, 0]], dtype=torch.float32)
SEED000_SCALE = 1 / math.sqrt(4)


def test_seed000_single_query():
    query = torch.tensor([[0, 10, 0]], dtype=torch.float32)
    for backend in ("reference", "auto"):
        out, weights = attnkit.attention(query, TEMP_K, TEMP_V, scale=SEED000_SCALE, return_weights=True,
                                         backend=backend)
        # Printed: (tensor([[1.0000e+01, 2.1216e-21, 2.0000e+00]]),
        #           tensor([[1.9287e-22, 1.0000e+00, 1.9287e-22, 1.9287e-22]]))
        torch.testing.assert_close(out, torch.tensor([[10.0, 2.1216e-21, 2.0]]), rtol=1e-4, atol=0)
        torch.testing.assert_close(weights, torch.tensor([[1.9287e-22, 1.0, 1.9287e-22, 1.9287e-22]]),
                                   rtol=1e-4, atol=0)
    fused = attnkit.attention(query, TEMP_K, TEMP_V, scale=SEED000_SCALE, backend="torch")
    torch.testing.assert_close(fused, torch.tensor([[10.0, 0.0, 2.0]]), rtol=1e-6, atol=1e-6)


def test_seed000_three_queries_rounded_weights():
    query = torch.tensor([[0, 10, 0], [0, 0, 10], [10, 10, 0]], dtype=torch.float32)
    _, weights = attnkit.attention(query, TEMP_K, TEMP_V, scale=SEED000_SCALE, return_weights=True)
    expected = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5], [0.5, 0.5, 0.0, 0.0]])
    assert torch.equal(torch.round(weights, decimals=3), expected)


# --- seed 002: weightless self-attention on "Your journey starts with one step" ---
SEED002_SCORES_ROW_2 = [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865]
SEED002_WEIGHTS = [
    [0.2098, 0.2006, 0.1981, 0.1242, 0.1220, 0.1452],
    [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581],
    [0.1390, 0.2369, 0.2326, 0.1242, 0.1108, 0.1565],
    [0.1435, 0.2074, 0.2046, 0.1462, 0.1263, 0.1720],
    [0.1526, 0.1958, 0.1975, 0.1367, 0.1879, 0.1295],
    [0.1385, 0.2184, 0.2128, 0.1420, 0.0988, 0.1896],
]
SEED002_CONTEXT = [
    [0.4421, 0.5931, 0.5790],
    [0.4419, 0.6515, 0.5683],
    [0.4431, 0.6496, 0.5671],
    [0.4304, 0.6298, 0.5510],
    [0.4671, 0.5910, 0.5266],
    [0.4177, 0.6503, 0.5645],
]
PRINTED = dict(atol=5e-5, rtol=0)  # the notebooks print 4 decimals


def test_seed002_weightless_self_attention():
    inputs = toy.embeddings()
    with trace.record() as recorded:
        context, weights = attnkit.attention(inputs, inputs, inputs, scale=1.0, return_weights=True)
    scores = recorded[0]["scores"]
    torch.testing.assert_close(scores[1], torch.tensor(SEED002_SCORES_ROW_2), **PRINTED)
    torch.testing.assert_close(weights, torch.tensor(SEED002_WEIGHTS), **PRINTED)
    torch.testing.assert_close(context, torch.tensor(SEED002_CONTEXT), **PRINTED)
    fused = attnkit.attention(inputs, inputs, inputs, scale=1.0, backend="torch")
    torch.testing.assert_close(fused, torch.tensor(SEED002_CONTEXT), **PRINTED)


def _seed002_projections():
    torch.manual_seed(123)
    w_query, w_key, w_value = (torch.rand(3, 2) for _ in range(3))
    return w_query, w_key, w_value


def test_seed002_trainable_projections_and_causal_weights():
    w_query, w_key, w_value = _seed002_projections()
    torch.testing.assert_close(w_query, torch.tensor([[0.2961, 0.5166], [0.2517, 0.6886], [0.0740, 0.8665]]),
                               **PRINTED)
    inputs = toy.embeddings()
    query, key, value = inputs @ w_query, inputs @ w_key, inputs @ w_value
    context = attnkit.attention(query, key, value)  # default scale 1/sqrt(d_k = 2)
    torch.testing.assert_close(context, seed002_printed.TRAINABLE_CONTEXT, **PRINTED)
    _, causal_weights = attnkit.attention(query, key, value, causal=True, return_weights=True)
    torch.testing.assert_close(causal_weights, seed002_printed.CAUSAL_WEIGHTS, **PRINTED)
