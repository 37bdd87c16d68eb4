"""The induction-head demo: a two-layer attention-only GPT learns in-context copying on random
tokens repeated twice, and attnkit finds the head that does it."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.models import induction


# tiny problems: one thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(one_thread):
    return induction.train_induction(induction.InductionConfig(steps=200))


@pytest.fixture(scope="module")
def tokens():
    return induction.repeated_tokens(64, 16, 64, torch.Generator().manual_seed(99))  # unseen sequences


def test_the_repeated_half_is_predicted_by_copying(trained, tokens):
    first, second = induction.half_losses(trained.model, tokens)
    # The first half is random: nothing beats ln(64) = 4.16 there. The second half is a copy.
    assert first > 0.9 * math.log(64)
    assert second < 0.1 * first


def test_one_head_is_an_induction_head(trained, tokens):
    prefix = induction.prefix_matching_scores(trained.model, tokens)
    copying = induction.copying_scores(trained.model)
    layer, head = induction.best_induction_head(prefix, copying)
    # Threshold: a uniform causal head gives the induction target 1 / (i + 1) <= 1/17 = 0.06 of a
    # second-half query's attention, a previous-token head ~0; 0.5 means the head puts the majority
    # of its attention on the one key an induction head must pick (8x chance).
    assert prefix[layer, head] > 0.5
    assert copying[layer, head] > 0.5  # its OV circuit raises the attended token's logit
    # It needs what layer 0 wrote about each position's previous token, so it sits in layer 1;
    # layer 0's heads do not match prefixes.
    assert layer == 1 and prefix[0].max() < 0.2


def test_scores_read_a_planted_pattern():
    """The scores on weights we construct: each second-half query looking exactly at its target."""
    model = induction.train_induction(induction.InductionConfig(steps=0)).model
    tokens = induction.repeated_tokens(2, 5, 64, torch.Generator().manual_seed(0))

    def planted(query, key, value, **kwargs):
        length = query.shape[-2]
        weights = torch.zeros(length, length)
        for i in range(length):
            weights[i, i - 5 + 1 if i >= 5 else 0] = 1.0
        weights = weights.expand(*query.shape[:2], length, length)
        return torch.zeros_like(query), weights

    model.set_attention_fn(planted)
    assert torch.equal(induction.prefix_matching_scores(model, tokens), torch.ones(2, 4))


def test_copying_score_of_an_identity_circuit_is_one():
    model = induction.train_induction(induction.InductionConfig(steps=0, vocab_size=16, hidden_size=16,
                                                                num_heads=1, num_layers=1)).model
    with torch.no_grad():  # embedding, value, output and unembedding all identity: OV = I
        for weight in (model.embed_tokens.weight, model.layers[0].self_attn.v_proj.weight,
                       model.layers[0].self_attn.out_proj.weight, model.lm_head.weight):
            weight.copy_(torch.eye(16))
        model.layers[0].self_attn.out_proj.weight.mul_(-1)
    assert induction.copying_scores(model)[0, 0] == pytest.approx(-1.0)


def test_show_draws_the_trained_heads(trained, tmp_path, monkeypatch, capsys):
    pytest.importorskip("numpy")
    from attnkit import show as show_module
    from attnkit.cli import main

    monkeypatch.setattr(show_module, "train_induction", lambda: trained)
    assert main(["show", "--model", "induction", "--no-images", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "<- induction head" in out and "repeated half" in out
    assert (tmp_path / "attention.html").exists()
    record, _, (layer, head) = show_module.induction_record(trained)
    weights = record.attentions[layer, head]  # [T, T]: the stripe half - 1 below the diagonal
    stripe = torch.stack([weights[i, i - 15] for i in range(16, 32)])
    assert stripe.mean() > 0.5
