"""The layers reproduce the seed notebooks' printed numbers and shapes."""

from __future__ import annotations

import torch
from torch import nn

import seed002_printed
from attnkit import toy
from attnkit.nn import HeadList, MultiHeadAttention, SelfAttention, StackedHeads

PRINTED = dict(atol=5e-5, rtol=0)  # the notebooks print 4 decimals


# --- seed 002: "coding attention mechanism" --------------------------------------------------
def _seed002_weights():
    torch.manual_seed(123)
    return [torch.rand(3, 2) for _ in range(3)]  # W_query, W_key, W_value, used as x @ W


def test_seed002_trainable_head_gives_the_printed_context_and_causal_weights():
    w_query, w_key, w_value = _seed002_weights()
    torch.testing.assert_close(w_key, torch.tensor([[0.1366, 0.1025], [0.1841, 0.7264], [0.3153, 0.6871]]),
                               **PRINTED)
    inputs = toy.embeddings()
    head = SelfAttention.from_weights(w_query.T, w_key.T, w_value.T)  # seed 002 writes x @ W
    torch.testing.assert_close(head(inputs), seed002_printed.TRAINABLE_CONTEXT, **PRINTED)

    causal_head = SelfAttention.from_weights(w_query.T, w_key.T, w_value.T, causal=True)
    _, weights = causal_head(inputs, need_weights=True)
    torch.testing.assert_close(weights, seed002_printed.CAUSAL_WEIGHTS, **PRINTED)
    # The causal class of seed 002 runs on a batch of two copies of the inputs.
    batch = torch.stack((inputs, inputs))
    assert causal_head(batch).shape == (2, 6, 2)


def test_seed002_linear_head_starts_from_the_same_weights_as_selfattention_v2():
    torch.manual_seed(123)
    head = SelfAttention(3, 2, qkv_bias=False)
    torch.testing.assert_close(head(toy.embeddings()), torch.tensor(
        [[-0.5337, -0.1051], [-0.5323, -0.1080], [-0.5323, -0.1079], [-0.5297, -0.1076], [-0.5311, -0.1066],
         [-0.5299, -0.1081]]), **PRINTED)


def test_seed002_split_multi_head_class_gives_the_printed_outputs():
    # Seed 002's MultiHeadAttention(d_in=3, d_out=2, num_heads=2): three bias-free Linear(3, 2)
    # split into two heads of size 1, causal, then out_proj = Linear(2, 2), built after
    # torch.manual_seed(123) in this order.
    torch.manual_seed(123)
    seed_layers = [nn.Linear(3, 2, bias=False) for _ in range(3)] + [nn.Linear(2, 2)]
    ours = MultiHeadAttention(3, 2, head_dim=1, out_dim=2, causal=True)
    with torch.no_grad():
        for linear, seed_linear in zip((ours.q_proj, ours.k_proj, ours.v_proj, ours.out_proj), seed_layers):
            linear.weight.copy_(seed_linear.weight)
            linear.bias.copy_(seed_linear.bias if seed_linear.bias is not None else torch.zeros(2))
    batch = torch.stack((toy.embeddings(), toy.embeddings()))
    output = ours(batch)
    assert output.shape == (2, 6, 2)
    printed = torch.tensor([[0.3190, 0.4858], [0.2943, 0.3897], [0.2856, 0.3593], [0.2693, 0.3873],
                            [0.2639, 0.3928], [0.2575, 0.4028]])
    torch.testing.assert_close(output, torch.stack((printed, printed)), **PRINTED)


# --- seed 001: "Pay Attention" ---------------------------------------------------------------
def _seed001():
    """Re-run the notebook's random draws in its order: embedding, W_q, W_k, W_v, then the word."""
    sentence = "the quick brown fox jumps over a lazy dog".split()
    index = {word: i for i, word in enumerate(sorted(sentence))}
    torch.manual_seed(0)
    embed = nn.Embedding(len(sentence), 16)
    embedded = embed(torch.tensor([index[w] for w in sentence])).detach()
    w_q, w_k, w_v = torch.randn(24, 16), torch.randn(24, 16), torch.randn(28, 16)
    position = torch.randint(0, len(sentence), (1,)).item()
    return embedded, w_q, w_k, w_v, position


def test_seed001_single_head_context_vector_and_shapes():
    embedded, w_q, w_k, w_v, position = _seed001()
    torch.testing.assert_close(embedded[0, :4], torch.tensor([-0.88338, -0.41891, -0.80483, 0.56561]), atol=5e-5,
                               rtol=0)
    assert position == 1
    head = SelfAttention.from_weights(w_q, w_k, w_v)  # seed 001 writes W @ x: nn.Linear's layout
    assert head.k_proj(embedded).shape == (9, 24) and head.v_proj(embedded).shape == (9, 28)

    # The notebook attends from one word to the whole sentence: one query row, cross-attention form.
    context, weights = head(embedded[position:position + 1], embedded, need_weights=True)
    assert context.shape == (1, 28)
    torch.testing.assert_close(weights[0], torch.tensor(
        [4.2897e-13, 5.9736e-20, 2.8606e-13, 8.8403e-27, 1.8719e-21, 6.5893e-27, 1.0000e+00, 1.4951e-15, 5.9031e-09]),
        rtol=2e-4, atol=0)
    torch.testing.assert_close(context[0], torch.tensor(
        [-6.1658, 3.3317, -1.4784, 3.0280, -3.0778, -1.9382, 3.2093, 2.9632, 4.7867, 2.5697, -1.9187, -0.8907,
         3.5392, -0.1726, -2.6539, 5.6142, -1.1907, 2.2681, -6.4134, 2.0330, 3.2004, -8.4279, -5.9757, -6.8775,
         3.2998, 4.7060, -3.5087, 5.1399]), atol=2e-4, rtol=0)  # 4 decimals of values up to ~9
    # Self-attention over the sentence gives the same row for that word.
    torch.testing.assert_close(head(embedded)[position], context[0])


def test_seed001_three_stacked_heads_and_cross_attention_shapes():
    embedded, *_ = _seed001()
    heads = StackedHeads(16, 24, 3, d_v=28)
    assert tuple(heads.w_query.shape) == (3, 24, 16) and tuple(heads.w_value.shape) == (3, 28, 16)
    context = heads(embedded)
    assert context.shape == (9, 3 * 28)
    assert context[1].view(3, 28).shape == (3, 28)  # one word: three heads of 28

    head = SelfAttention(16, 24, 28)
    other_sentence = torch.rand(8, 16)
    context, weights = head(embedded[1:2], other_sentence, need_weights=True)
    assert weights.shape == (1, 8) and context.shape == (1, 28)


# --- seed 000: multi-head attention as a list of heads -----------------------------------------
def test_seed000_multi_head_shapes():
    toy_encodings = torch.tensor([[[0.0, 0.1, 0.2, 0.3], [1.0, 1.1, 1.2, 1.3], [2.0, 2.1, 2.2, 2.3]]])
    listed = HeadList(4, 2, num_heads=2, qkv_bias=True, out_dim=4)  # seed 000: d_model=4, 2 heads of 2
    for layer in (listed, MultiHeadAttention.from_heads(listed), MultiHeadAttention(4, 2)):
        output, weights = layer(toy_encodings, need_weights=True)
        assert output.shape == (1, 3, 4)
        assert weights.shape == (1, 2, 3, 3)
