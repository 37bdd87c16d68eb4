import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

# attnkit's Triton kernel runs on CPU tensors through Triton's interpreter where there is no GPU
# (CI): the variable must be set before triton.jit decorates the kernels, i.e. before they are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton_interpreter
    except ImportError:  # no triton: its tests skip
        pass
    else:
        triton_interpreter.apply()

# Small, deterministic property runs keep the suite well inside its time budget on 2 cores.
settings.register_profile("ci", max_examples=120, deadline=None, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


# `make test` runs the suite on two workers (pytest-xdist, `-n 2`): most of it is single-threaded
# Python (hypothesis, Triton's interpreter, subprocesses, the docs build), so one process left a
# core idle. A worker takes whole test files, so a module's fixtures (a built site, a loaded model)
# are set up once, not once per worker; the docs site's file and test_notebooks.py travel together,
# in that order, so the notebooks the site's build executed are reused (tests/executed_notebooks.py).
_RUN_TOGETHER = {"tests/test_docs_site.py": "notebooks", "tests/test_notebooks.py": "notebooks"}
# Files of independent cases with no module fixtures, which the GPU session runs alone on 8 workers
# (benchmarks/cuda_session.sh): scheduled as whole files, test_cuda.py's 336 cases ran on one worker
# and reached 63% in 290 s on an H100, where 8 workers had run them all in 128 s.
_ONE_TEST_EACH = {"tests/test_cuda.py", "tests/test_triton_kernel.py", "tests/test_nonfinite.py"}


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: without it, unused
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class WholeFiles(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path in _ONE_TEST_EACH:
                return nodeid
            return _RUN_TOGETHER.get(path, path)

    return WholeFiles(config, log)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for a module of tiny problems (``pytestmark = pytest.mark.usefixtures(
    "one_thread")``): cut into many small kernel calls, they run fastest on one thread, which does
    not stall at every call's thread barrier (measured: up to 10x slower on two threads when other
    jobs share the machine's cores); results do not depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
