"""Private PyTorch APIs live in one module, ``attnkit._torch_private``, checked against the torch
releases the suite runs on; pyproject admits exactly those releases."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from attnkit import _torch_private

SOURCE = Path(__file__).resolve().parent.parent / "src" / "attnkit"
PRIVATE = re.compile(r"\btorch\._[A-Za-z]|\._schema\b|_qkv_same_embed_dim|_GLIBCXX_USE_CXX11_ABI\b(?!=)")


def test_no_other_module_touches_a_private_torch_api():
    offenders = []
    for path in sorted(SOURCE.rglob("*.py")):
        if path.name == "_torch_private.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if PRIVATE.search(line.split("#")[0]):
                offenders.append(f"{path.relative_to(SOURCE)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_pyproject_admits_the_tested_torch_releases_only():
    text = (SOURCE.parent.parent / "pyproject.toml").read_text()
    (spec,) = re.findall(r'"torch([^"]*)"', text.split("[project.optional-dependencies]")[0])
    low, high = re.fullmatch(r">=(\d+)\.(\d+),<(\d+)\.(\d+)", spec).groups()[:2], \
        re.fullmatch(r">=(\d+)\.(\d+),<(\d+)\.(\d+)", spec).groups()[2:]
    admitted = {(int(low[0]), minor) for minor in range(int(low[1]), int(high[1]))} if low[0] == high[0] else None
    assert admitted == set(_torch_private.TESTED)
    assert _torch_private.supported() == (_torch_private.torch_release() in _torch_private.TESTED)
    assert _torch_private.torch_release() == tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def test_outside_the_tested_releases_the_private_kernels_are_not_used(monkeypatch):
    monkeypatch.setattr(_torch_private, "TESTED", ((1, 0),))
    assert not _torch_private.supported() and _torch_private.flash_cpu_ops() is None


def test_an_eager_program_never_loads_dynamo_or_sympy():
    """Custom ops wrap their implementations so that the first call imports torch._dynamo, and
    torch.broadcast_shapes imports sympy: together ~3 s on the first call of a structured mask
    (8x a sliding-window call at L = 16384). Eager attention, forward and backward, on every
    path (native kernel or PyTorch's), loads neither."""
    import subprocess
    import sys

    program = """
import sys, torch, attnkit
from attnkit import masks
q = torch.randn(1, 2, 300, 16, requires_grad=True)
for mask in (masks.sliding_window(32), masks.document([100, 200]) & masks.causal()):
    attnkit.attention(q, q, q, mask=mask, backend="tiled").sum().backward()
    with attnkit._backends.native.turned_off():
        attnkit.attention(q, q, q, mask=mask, backend="tiled", dropout=0.1).sum().backward()
print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
"""
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
