"""The example notebooks executed once per test session, shared by the docs site's build and
tests/test_notebooks.py.

Both run each notebook top to bottom in a real Jupyter kernel of this interpreter; the docs build
(tests/test_docs_site.py, which runs first) keeps what it executed under a key of everything the
outputs depend on (docs/_ext/notebooks.py). test_notebooks.py reads those instead of running the
kernels again (26 s of the suite on 2 cores) where every notebook's key matches, and runs them
itself otherwise (alone, or after a failed build).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Where this session's docs build kept its executed notebooks (set by tests/test_docs_site.py).
directory: Path | None = None


def _docs_extension():
    spec = importlib.util.spec_from_file_location("attnkit_docs_notebooks", ROOT / "docs" / "_ext" / "notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cached(names: list[str]) -> dict[str, str] | None:
    """``name -> executed notebook (JSON text)`` from this session's docs build, or None unless every
    one of ``names`` is there under its current key."""
    if directory is None or not directory.is_dir():
        return None
    try:
        extension = _docs_extension()
    except ImportError:  # no sphinx: nothing was built
        return None
    digest = extension._sources_digest()
    found = {}
    for name in names:
        path = directory / f"{extension._key(name, digest)}.ipynb"
        if not path.exists():
            return None
        found[name] = path.read_text(encoding="utf-8")
    return found
