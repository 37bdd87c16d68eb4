"""The example notebooks as pages with their outputs.

examples/*.ipynb are committed without outputs. At build time they are copied to docs/notebooks/
(gitignored) and executed, all at once, each in its own Jupyter kernel running this interpreter
(as tests/test_notebooks.py runs them): their time is mostly importing torch, which two cores
share better than one after the other. The kernels start as soon as this extension loads, and run
while Sphinx imports attnkit and reads the other pages (the notebooks are read last); myst-nb then
renders the executed notebook (``nb_execution_mode = "off"``: it executes nothing itself).

An executed notebook is kept in ``<doctrees>/executed-notebooks/`` under a key made of everything its
outputs depend on (the notebook, attnkit's sources, the interpreter and the torch version), so a
build after one where nothing changed does not run the kernels again. A notebook that fails to
run is a build warning (an error under ``-W``) naming the notebook and the error.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging as pylogging
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from sphinx.application import Sphinx
from sphinx.util import logging

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SOURCES = ROOT / "src" / "attnkit"
FOLDER = "notebooks"
KERNEL = "attnkit-docs"
TIMEOUT = 300  # seconds per cell: generous, for a loaded machine
# nbclient's and jupyter_client's notes (starting a kernel, closing its sockets) are not the
# build's business; a cell's error reaches the build as the exception it raises.
QUIET = pylogging.getLogger("attnkit.docs.notebooks")
QUIET.setLevel(pylogging.ERROR)
QUIET.propagate = False


def _sources_digest() -> str:
    """A digest of what the notebooks' outputs depend on besides themselves."""
    from importlib.metadata import version  # not torch itself: the kernels start before it loads

    digest = hashlib.sha256(f"{sys.version}|{version('torch')}".encode())
    for path in sorted(SOURCES.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(SOURCES)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


class Runs:
    """The notebooks being executed in a background thread, and their results."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.results: dict[str, tuple[str | None, BaseException | None]] = {}
        self.thread: threading.Thread | None = None
        self.started = 0.0
        self.elapsed = 0.0

    def start(self, names: list[str], keys: dict[str, str]) -> None:
        self.started = time.perf_counter()
        self.thread = threading.Thread(target=self._run, args=(names, keys), name="notebooks", daemon=True)
        self.thread.start()

    def _run(self, names: list[str], keys: dict[str, str]) -> None:
        try:
            asyncio.run(self._execute_all(names, keys))
        except BaseException as error:  # noqa: BLE001 (reported per notebook)
            for name in names:
                self.results.setdefault(name, (None, error))
        self.elapsed = time.perf_counter() - self.started

    async def _execute_all(self, names: list[str], keys: dict[str, str]) -> None:
        import nbclient
        import nbformat
        from jupyter_client.kernelspec import KernelSpecManager
        from jupyter_client.manager import AsyncKernelManager

        with tempfile.TemporaryDirectory(prefix="attnkit-docs-kernels-") as directory:
            spec = Path(directory) / KERNEL
            spec.mkdir()
            (spec / "kernel.json").write_text(json.dumps({
                # The kernel's own log only for errors (not its start-up notes on every build).
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
                         "--IPKernelApp.log_level=ERROR"],
                "display_name": "attnkit docs (this interpreter)", "language": "python",
            }))
            specs = KernelSpecManager(kernel_dirs=[directory])

            async def run(name: str) -> None:
                notebook = nbformat.read(EXAMPLES / f"{name}.ipynb", as_version=4)
                kernelspec = dict(notebook.metadata.get("kernelspec", {}))
                manager = AsyncKernelManager(kernel_name=KERNEL, kernel_spec_manager=specs, log=QUIET)
                client = nbclient.NotebookClient(notebook, km=manager, timeout=TIMEOUT, log=QUIET,
                                                 resources={"metadata": {"path": str(EXAMPLES)}})
                try:
                    await client.async_execute()
                except Exception as error:  # noqa: BLE001 (reported for this notebook)
                    self.results[name] = (None, error)
                    return
                if kernelspec:
                    notebook.metadata["kernelspec"] = kernelspec  # what a reader's Jupyter starts
                text = nbformat.writes(notebook)
                self.cache.mkdir(parents=True, exist_ok=True)
                (self.cache / f"{keys[name]}.ipynb").write_text(text, encoding="utf-8")
                self.results[name] = (text, None)

            await asyncio.gather(*(run(name) for name in names))

    def result(self, name: str) -> tuple[str | None, BaseException | None]:
        if name not in self.results and self.thread is not None:
            self.thread.join()
        return self.results.get(name, (None, RuntimeError(f"{name} was never executed")))


def _key(name: str, digest: str) -> str:
    text = (EXAMPLES / f"{name}.ipynb").read_bytes()
    return f"{name}-{hashlib.sha256(text + digest.encode()).hexdigest()[:20]}"


def start(app: Sphinx) -> None:
    """Copy examples/*.ipynb to docs/notebooks/ (only what changed, so that unchanged pages are not
    re-read) and start executing every notebook whose executed form is not cached, at once: this
    runs while Sphinx loads (it imports torch and transformers too) and reads the other pages."""
    folder = Path(app.srcdir) / FOLDER
    folder.mkdir(exist_ok=True)
    names = sorted(path.stem for path in EXAMPLES.glob("*.ipynb"))
    for name in names:
        source, target = EXAMPLES / f"{name}.ipynb", folder / f"{name}.ipynb"
        if not target.exists() or target.read_bytes() != source.read_bytes():
            shutil.copyfile(source, target)
    for stale in folder.glob("*.ipynb"):
        if stale.stem not in names:
            stale.unlink()
    runs = Runs(Path(app.doctreedir) / "executed-notebooks")
    app.attnkit_notebooks = runs  # type: ignore[attr-defined]
    digest = _sources_digest()
    keys = {name: _key(name, digest) for name in names}
    to_run = []
    for name in names:
        cached = runs.cache / f"{keys[name]}.ipynb"
        if cached.exists():
            runs.results[name] = (cached.read_text(encoding="utf-8"), None)
        else:
            to_run.append(name)
    if to_run:
        logger.info("executing %d notebooks in the background: %s", len(to_run), ", ".join(to_run))
        runs.start(to_run, keys)


def read_notebooks_last(app: Sphinx, env, docnames: list[str]) -> None:
    """Read the notebooks after every other page, while their kernels run."""
    notebooks = [name for name in docnames if name.startswith(f"{FOLDER}/")]
    docnames[:] = [name for name in docnames if name not in notebooks] + notebooks


def executed_source(app: Sphinx, docname: str, source: list[str]) -> None:
    """Replace a notebook's committed source (no outputs) by the executed one."""
    if not docname.startswith(f"{FOLDER}/"):
        return
    runs: Runs = app.attnkit_notebooks  # type: ignore[attr-defined]
    name = docname.split("/", 1)[1]
    # Its outputs depend on attnkit: an incremental build re-reads (and re-runs) it when that changes.
    for path in sorted(SOURCES.rglob("*.py")):
        app.env.note_dependency(str(path))
    text, error = runs.result(name)
    if error is not None:
        logger.warning("notebook %s did not run: %s", name, error, location=docname,
                       type="attnkit", subtype="notebook")
        return
    source[0] = text


def report_time(app: Sphinx, exception: BaseException | None) -> None:
    runs: Runs = getattr(app, "attnkit_notebooks", None)
    if runs is not None and runs.thread is not None:
        runs.thread.join()
        logger.info("notebooks executed in %.1f s", runs.elapsed)


def setup(app: Sphinx) -> dict:
    # Listed first in conf.py's extensions: the kernels start before the other extensions load.
    start(app)
    app.connect("env-before-read-docs", read_notebooks_last)
    app.connect("source-read", executed_source)
    app.connect("build-finished", report_time)
    return {"parallel_read_safe": False, "parallel_write_safe": True}
