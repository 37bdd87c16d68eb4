"""``attnkit explain``: the seed 002 walkthrough, golden against the notebook's printed numbers."""

from __future__ import annotations

import subprocess
import sys

from attnkit.cli import main


def test_explain_prints_each_step_with_the_seed_numbers(capsys):
    assert main(["explain"]) == 0
    text = capsys.readouterr().out
    for step in ("inputs [6, 3]", "scores [6, 6]", "weights [6, 6]", "context [6, 3]"):
        assert step in text
    # Seed 002: scores of 'journey', its softmax weights and its context vector.
    assert "journey   0.9544  1.4950  1.4754  0.8434  0.7070  1.0865" in text
    assert "journey   0.1385  0.2379  0.2333  0.1240  0.1082  0.1581" in text
    assert "journey  0.4419 0.6515 0.5683" in text
    assert "'journey' attends most to 'journey' (0.2379)" in text
    assert "mask" not in text.split("Step")[3]


def test_explain_causal_shows_the_mask_and_masked_weights(capsys):
    assert main(["explain", "--causal"]) == 0
    text = capsys.readouterr().out
    assert "mask [6, 6]" in text and "masked_scores [6, 6]" in text
    assert "Your        True       .       .       .       .       ." in text
    assert "-inf" in text
    assert "'Your' attends most to 'Your' (1.0000)" in text


def test_python_dash_m_attnkit_runs():
    result = subprocess.run([sys.executable, "-m", "attnkit", "explain"], capture_output=True, text=True, check=True)
    assert "Reading the weights" in result.stdout
