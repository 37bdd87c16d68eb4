"""Docstrings are the single source of the API reference: every public function, class, method and
property (enumerated from the package by tests/public_api.py) has one with a short example, and
every example runs here as a doctest."""

from __future__ import annotations

import doctest
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from public_api import importable, public_modules, public_objects

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _docstring(obj: object) -> str:
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        return obj.__doc__ or ""
    return inspect.getdoc(obj) or ""


@pytest.mark.parametrize("module_name", public_modules())
def test_the_examples_of_each_public_module_run(module_name, tmp_path, monkeypatch):
    module = importable(module_name)
    if module is None:
        pytest.skip(f"{module_name} needs an optional dependency")
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    state = torch.random.get_rng_state()
    try:
        for test in finder.find(module, module_name):
            runner.run(test)
    finally:
        torch.random.set_rng_state(state)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{results.failed} of {results.attempted} examples in {module_name} failed (see above)"


def test_every_public_object_has_a_docstring_with_an_example():
    missing = [name for name, obj in public_objects() if ">>>" not in _docstring(obj)]
    assert not missing, f"{len(missing)} public names have no example in their docstring: {missing}"


def _defined_privately(obj: object) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return any(part.startswith("_") for part in module.split(".")[1:])


def test_the_examples_of_public_names_defined_in_private_modules_run():
    """``attnkit.Backend``, ``attnkit.register_backend`` and the layers' shared settings live in
    private modules, whose doctests the per-module test does not collect. They run here, in a fresh
    interpreter: ``register_backend``'s example registers a backend for good."""
    names = [name for name, obj in public_objects() if _defined_privately(obj)]
    assert names, "expected some public names defined in private modules (attnkit.Backend, ...)"
    script = f"""
import doctest, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from public_api import public_objects
from test_docstrings import _defined_privately, FLAGS
finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=FLAGS)
for name, obj in public_objects():
    if _defined_privately(obj):
        target = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
        for test in finder.find(target, name):
            runner.run(test)
result = runner.summarize(verbose=False)
sys.exit(1 if result.failed or not result.attempted else 0)
"""
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-2000:]
