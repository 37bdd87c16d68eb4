"""Training: packing, the schedule, bit-exact resume, determinism, and the CLI end to end (tiny)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from attnkit.cli import main  # noqa: E402
from attnkit.training import TrainConfig, batch_order, learning_rate, pack_documents, pad_documents, train  # noqa: E402
from attnkit.training.corpus import python_reference_sections, split_documents  # noqa: E402


# tiny problems: one thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, vocab_size=300,
            seq_len=32, batch_size=4, max_documents=8, eval_rows=4, sample_tokens=0)


def test_packing_lays_documents_end_to_end_with_their_labels():
    rows = pack_documents([[1, 2, 3, 4], [5, 6], [7, 8, 9]], 4, pad_token_id=0)
    assert rows.inputs.tolist() == [[1, 2, 3, 5], [7, 8, 0, 0]]
    assert rows.targets.tolist() == [[2, 3, 4, 6], [8, 9, -100, -100]]
    assert rows.doc_ids.tolist() == [[0, 0, 0, 1], [2, 2, 3, 3]]
    assert rows.real_tokens == 6


def test_padding_puts_one_document_per_row():
    rows = pad_documents([[1, 2, 3, 4], [5, 6]], 8)
    assert rows.inputs.tolist() == [[1, 2, 3], [5, 0, 0]]
    assert rows.targets.tolist() == [[2, 3, 4], [6, -100, -100]]


def test_batch_order_walks_seeded_epochs():
    steps = torch.cat([batch_order(10, 4, step, seed=3) for step in range(5)])
    assert sorted(steps[:10].tolist()) == list(range(10)) and sorted(steps[10:20].tolist()) == list(range(10))
    assert torch.equal(batch_order(10, 4, 2, seed=3), steps[8:12])


def test_schedule_warms_up_then_decays_by_cosine():
    config = TrainConfig(steps=110, warmup_steps=10, learning_rate=1.0, min_learning_rate=0.1)
    assert learning_rate(0, config) == pytest.approx(0.1) and learning_rate(9, config) == pytest.approx(1.0)
    assert learning_rate(60, config) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert learning_rate(110, config) == pytest.approx(0.1)


def test_the_corpus_is_prose_split_into_documents():
    sections = python_reference_sections()
    train_docs, validation = split_documents(sections)
    assert len(sections) > 100 and 0 < len(validation) < len(train_docs)
    assert any(section.startswith('The "for" statement') for section in sections)


def test_resume_continues_bit_for_bit_and_runs_are_deterministic(tmp_path):
    """Attention dropout is on, so the dropout generator's state must be restored too."""
    config = dict(TINY, steps=6, warmup_steps=2, eval_interval=3, checkpoint_interval=100, attention_dropout=0.1)
    state = torch.get_rng_state()
    whole = train(TrainConfig(out=str(tmp_path / "whole"), **config), quiet=True)
    assert torch.equal(torch.get_rng_state(), state)  # the seed alone drives the run
    train(TrainConfig(out=str(tmp_path / "split"), **config), until=3, quiet=True)
    resumed = train(TrainConfig(out=str(tmp_path / "split"), **config), resume=True, quiet=True)
    assert resumed.losses == whole.losses and resumed.evals == whole.evals and len(whole.losses) == 6
    for (name, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    again = train(TrainConfig(out=str(tmp_path / "again"), **config), quiet=True)
    assert again.losses == whole.losses


def test_resume_refuses_other_settings(tmp_path):
    train(TrainConfig(out=str(tmp_path), **dict(TINY, steps=2)), quiet=True)
    with pytest.raises(ValueError, match="seq_len"):
        train(TrainConfig(out=str(tmp_path), **dict(TINY, steps=4, seq_len=16)), resume=True, quiet=True)


def test_cli_trains_then_generates(tmp_path, capsys):
    out = tmp_path / "gpt"
    assert main(["train", "--size", "tiny", "--steps", "3", "--eval-interval", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "validation loss" in printed.out and "tok/s" in printed.err
    assert {p.name for p in (out / "model").iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert main(["generate", "The", "A longer prompt", "--model", str(out / "model"), "--max-new-tokens", "5",
                 "--top-k", "5", "--seed", "1"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("The") and "A longer prompt" in first
    main(["generate", "The", "A longer prompt", "--model", str(out / "model"), "--max-new-tokens", "5",
          "--top-k", "5", "--seed", "1"])
    assert capsys.readouterr().out == first
    assert main(["train", "--size", "tiny", "--steps", "4", "--out", str(out), "--resume"]) == 0
    pytest.importorskip("numpy")
    report = tmp_path / "report"
    assert main(["show", "The for statement", "--model", str(out / "model"), "--no-images", "--out", str(report)]) == 0
    assert "layer 1:" in capsys.readouterr().out and (report / "attention.html").exists()


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "no/such/dir"], "does not exist"),
    (["train", "--out", "{tmp}/nothing", "--resume", "--size", "tiny"], "no checkpoint"),
    (["generate", "--temperature", "-1", "--model", "{tmp}"], "temperature"),
    # a KV cache for 10**15 tokens: the allocator's refusal, named, not a traceback
    (["generate", "x", "--max-new-tokens", str(10**15), "--model", "{tmp}"], "KVCache: keys [1, 1, 1000000000000"),
    # rows longer than the training text, refused before packing builds them (it was killed for memory)
    (["train", "--size", "tiny", "--seq-len", str(10**9), "--out", "{tmp}/gpt"], "seq_len 1,000,000,000 is longer"),
])
def test_cli_errors_are_one_line(argv, message, tmp_path, capsys):
    if "{tmp}" in argv:  # a model to generate with
        from attnkit.models.gpt import GPT, GPTConfig
        from attnkit.models.llama_export import save_llama
        from attnkit.training.corpus import train_tokenizer
        save_llama(GPT(GPTConfig(vocab_size=300, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, intermediate_size=16)), tmp_path,
                   train_tokenizer(["some text here"] * 3, 300))
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "gpt").exists()  # a refused run writes nothing


def test_a_packed_batch_scores_each_document_as_if_alone():
    """The trainer's loss on packed rows (documents split across rows included) equals the
    loss of every piece run alone: packing, labels and positions agree with the model."""
    from attnkit.models.gpt import GPT, GPTConfig
    from attnkit.training.trainer import row_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, intermediate_size=32)).double().eval()
    docs = [torch.randint(0, 50, (n,)).tolist() for n in (7, 30, 2, 12, 5)]
    rows = pack_documents(docs, 16)
    total, count = 0.0, 0
    for r in range(len(rows)):  # every run of equal labels with real targets, alone
        for label in rows.doc_ids[r].unique_consecutive():
            where = (rows.doc_ids[r] == label) & (rows.targets[r] != -100)
            if where.any():
                logits = model(rows.inputs[r][where][None])[0]
                total += torch.nn.functional.cross_entropy(logits, rows.targets[r][where], reduction="sum")
                count += int(where.sum())
    torch.testing.assert_close(row_loss(model, rows), total / count, atol=1e-12, rtol=1e-12)


def test_training_learns(tmp_path):
    result = train(TrainConfig(out=str(tmp_path), **dict(TINY, steps=40, eval_interval=40, learning_rate=1e-2,
                                                         warmup_steps=5)), quiet=True)
    first, last = result.losses[0][1], sum(loss for _, loss in result.losses[-5:]) / 5
    assert first > math.log(300) - 0.5 and last < first - 1.0, (first, last)
