import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

# Small, deterministic property runs keep the suite well inside its time budget on 2 cores.
settings.register_profile("ci", max_examples=120, deadline=None, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@contextmanager
def tiled_kernel(name: str) -> Iterator[None]:
    """Run the tiled backend on ``"native"`` (attnkit's kernel; the test skips where it is not
    built) or ``"pytorch"`` (PyTorch's kernels block by block) inside the ``with``."""
    from attnkit._backends import native

    if name == "native":
        if not native.available():
            pytest.skip(f"native kernel: {native.why_unavailable()}")
        yield
    else:
        with native.turned_off():
            yield
