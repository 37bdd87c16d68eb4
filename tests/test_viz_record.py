"""AttentionRecord: the renderer's input, validated; padded batches split into sentences."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from viz_data import attention_like, words

import attnkit
from attnkit import toy
from attnkit.viz import AttentionRecord, records_from_batch


def test_record_normalises_its_fields():
    weights = attention_like(2, 3, 5, causal=True).double()
    record = AttentionRecord("text", tuple(words(5)), weights, model="m")
    assert record.tokens == words(5)
    assert record.attentions.dtype == torch.float32
    assert record.layer_names == ["layer 0", "layer 1"]
    assert (record.num_layers, record.num_heads, record.num_tokens) == (2, 3, 5)
    assert torch.equal(record.head(1, 2), weights[1, 2].float())


def test_fully_masked_rows_of_zeros_are_accepted():
    weights = attention_like(1, 2, 4)
    weights[0, 1, 2] = 0
    AttentionRecord("t", words(4), weights)


@pytest.mark.parametrize(
    ("attentions", "tokens", "message"),
    [
        (torch.rand(2, 3, 4), 4, "expected \\[layers, heads, T, T\\]"),
        (torch.rand(1, 1, 4, 5), 4, "expected \\[layers, heads, T, T\\]"),
        (attention_like(1, 1, 4), 5, "expected T = len\\(tokens\\) = 5"),
        (torch.randn(1, 2, 4, 4), 4, "finite weights in \\[0, 1\\]"),
        (torch.full((1, 2, 4, 4), 0.125), 4, "row \\(layer 0, head 0, query 0\\) sums to"),  # rows sum to 0.5
        (torch.ones(1, 1, 3, 3, dtype=torch.int64), 3, "floating"),
        ([[1.0]], 1, "torch.Tensor"),
    ],
)
def test_malformed_weights_are_refused_with_a_clear_message(attentions, tokens, message):
    with pytest.raises((ValueError, TypeError), match=message):
        AttentionRecord("t", words(tokens), attentions)


def test_layer_names_and_head_indices_are_checked():
    with pytest.raises(ValueError, match="layer_names: got 1 names, expected one per layer \\(2\\)"):
        AttentionRecord("t", words(3), attention_like(2, 1, 3), layer_names=["only"])
    record = AttentionRecord("t", words(3), attention_like(2, 1, 3))
    with pytest.raises(ValueError, match="head: got 1, expected 0 <= head < 1"):
        record.head(0, 1)
    with pytest.raises(ValueError, match="layer: got -1"):
        record.head(-1, 0)


def test_records_from_batch_keeps_each_sentence_block_of_real_tokens():
    lengths = [7, 4]
    per_sentence = [attention_like(3, 2, 7, seed=0), attention_like(3, 2, 7, seed=1, padded=3)]
    batch = torch.stack(per_sentence)  # [B, layers, H, T, T]
    layers = [batch[:, layer] for layer in range(3)]  # what a model returns: per layer [B, H, T, T]
    tokens = [words(n) for n in lengths]
    records = records_from_batch(["a", "b"], tokens, layers, model="m")
    assert [r.num_tokens for r in records] == lengths
    assert torch.equal(records[1].attentions, per_sentence[1][:, :, :4, :4])
    assert records[0].model == "m" and records[1].text == "b"


def test_records_from_batch_refuses_weight_on_padding():
    batch = attention_like(1, 2, 6).unsqueeze(0)  # no key masked: "padding" got weight
    with pytest.raises(ValueError, match="sentence 0 gives non-zero weight to padded keys \\(positions >= 4\\)"):
        records_from_batch(["a"], [words(4)], [batch[:, 0]])


def test_toy_example_gives_a_one_layer_one_head_record_with_the_seed_numbers():
    x = toy.embeddings()
    _, weights = attnkit.attention(x, x, x, scale=1.0, return_weights=True)
    record = AttentionRecord("Your journey starts with one step", toy.TOKENS, weights[None, None], model="toy")
    assert (record.num_layers, record.num_heads, record.num_tokens) == (1, 1, 6)
    # Seed 002's printed softmax weights of the query 'journey'.
    printed = torch.tensor([0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581])
    torch.testing.assert_close(record.head(0, 0)[1], printed, atol=5e-5, rtol=0)


def test_the_core_and_the_record_need_neither_numpy_nor_matplotlib():
    # A fresh interpreter where both are unimportable: attnkit and the record still work, the
    # report, the notebook views and the exports name the extra to install. Jupyter is
    # unimportable too: the notebook views never need it (Jupyter calls them, not the reverse).
    program = """
import sys
for name in ("numpy", "matplotlib", "IPython", "ipykernel", "jupyter_client", "nbformat"):
    sys.modules[name] = None
import warnings; warnings.simplefilter("ignore")
import torch, attnkit, attnkit.viz as viz
record = viz.AttentionRecord("a b", ["a", "b"], torch.full((1, 1, 2, 2), 0.5))
view = viz.head_view(record.attentions, record.tokens)
for call in (lambda: viz.render_report(record), lambda: view._repr_mimebundle_(),
             lambda: viz.save_grid(record, "x.png")):
    try:
        call()
    except ImportError as error:
        print(error)
"""
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    assert result.stdout.splitlines() == [
        "the HTML report needs the 'numpy' package: pip install 'attnkit[viz]'",
        "the HTML report needs the 'numpy' package: pip install 'attnkit[viz]'",
        "image export needs the 'matplotlib' package: pip install 'attnkit[viz]'",
    ]
