"""The API reference, generated at build time from tests/public_api.py (never from a list kept by
hand): one page per public module under docs/reference/ (gitignored), with an autodoc entry for
each of its public names, and classes with their public members.

An object is documented in full once, under the first public module that lists it (the name
``public_objects()`` gives it: ``attnkit.attention``, not ``attnkit.core.attention``). The other
modules that export it list it too, as a short entry pointing there, so that every public name of
every public module is in the reference, in its search index and in ``objects.inv``.
"""

from __future__ import annotations

import inspect
import sys
import typing
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import make_id

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import public_api  # noqa: E402  (tests/public_api.py: the enumeration of the public API)

FOLDER = "reference"


def _title(text: str, underline: str = "=") -> list[str]:
    return [text, underline * len(text), ""]


def _kind(obj: object) -> str:
    if inspect.isclass(obj):
        return "class"
    if inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.ismethod(obj):
        return "function"
    return "data"  # a constant, or another callable (a typing alias such as ``Fact``)


def members(cls: type) -> list[str]:
    """A class's public members (tests/public_api.py), then those it inherits from attnkit's own
    classes (``MultiHeadAttention.from_torch`` comes from a mixin), not from ``nn.Module``."""
    names = list(public_api.public_members(cls))
    for base in cls.__mro__[1:]:
        if base.__module__.split(".")[0] == "attnkit":
            names += [name for name in public_api.public_members(base) if name not in names]
    return names


def shadowed(module_name: str) -> bool:
    """Whether the parent package exports another object under this module's dotted name
    (``attnkit.viz.progress`` is a function of ``attnkit.viz`` and a module)."""
    parent_name, _, name = module_name.rpartition(".")
    parent = sys.modules.get(parent_name)
    return parent is not None and not inspect.ismodule(getattr(parent, name, None)) and hasattr(parent, name)


def module_page(module_name: str, module, canonical: dict[int, str]) -> str:
    """The reStructuredText of one module's reference page."""
    lines = _title(f"``{module_name}``")
    if shadowed(module_name):
        # Python's domain keys objects by dotted name alone: the function keeps the name for
        # :func: and the module is noted as a module only (:mod:, the module index, objects.inv).
        lines += [f".. attnkit-module:: {module_name}", "",
                  f".. automodule:: {module_name}", "   :no-members:", "   :no-index:", ""]
    else:
        lines += [f".. automodule:: {module_name}", "   :no-members:", ""]
    lines += [f".. currentmodule:: {module_name}", ""]
    names = public_api.public_names(module)
    submodules = [getattr(module, name).__name__ for name in names if inspect.ismodule(getattr(module, name))]
    if submodules:
        lines += ["Submodules: " + ", ".join(f":mod:`{name}`" for name in submodules) + ".", ""]
    # A line of links to every name first: the pages' tables of contents leave objects out (conf.py).
    kinds: dict[str, list[str]] = {"Classes": [], "Functions": [], "Data": []}
    for name in names:
        obj = getattr(module, name)
        if not inspect.ismodule(obj):
            kind = _kind(obj)
            role = {"class": "class", "function": "func"}.get(kind, "data")
            kinds[{"class": "Classes", "function": "Functions"}.get(kind, "Data")].append(f":py:{role}:`{name}`")
    listed = [f"**{title}:** " + ", ".join(links) for title, links in kinds.items() if links]
    if listed:
        lines += ["; ".join(listed) + ".", ""]
    for name in names:
        obj = getattr(module, name)
        full = f"{module_name}.{name}"
        if inspect.ismodule(obj):
            continue
        kind = _kind(obj)
        first = canonical.get(id(obj))
        if kind == "data" and not callable(obj):
            lines += [f".. autodata:: {full}", "   :no-value:", ""]
            continue
        if first is not None and first != full:
            role = {"class": "class", "function": "func"}.get(kind, "obj")
            lines += [f".. py:{kind}:: {name}", "   :no-index-entry:", "",
                      f"   The same {'class' if kind == 'class' else 'object'} as :{role}:`{first}`, "
                      f"documented there.", ""]
            continue
        if kind == "class":
            names_ = members(obj)
            lines += [f".. autoclass:: {full}"]
            if names_:
                lines += [f"   :members: {', '.join(names_)}"]
            lines += [""]
        elif kind == "function":
            lines += [f".. autofunction:: {full}", ""]
        else:
            lines += [f".. autodata:: {full}", "   :no-value:", ""]
    return "\n".join(lines) + "\n"


def index_page(modules: list[str]) -> str:
    lines = _title("API reference")
    lines += ["Every public module of attnkit, and in each every public name, generated from the "
              "docstrings. A module or name whose path has a part starting with ``_`` is private.", ""]
    lines += [".. toctree::", "   :maxdepth: 1", ""]
    lines += [f"   {name}" for name in modules]
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    """Write only what changed, so that an incremental build re-reads only those pages."""
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def generate(app: Sphinx) -> None:
    folder = Path(app.srcdir) / FOLDER
    folder.mkdir(exist_ok=True)
    canonical = {id(obj): name for name, obj in public_api.public_objects()}
    written = []
    for module_name in public_api.public_modules():
        module = public_api.importable(module_name)
        if module is None:
            logger.warning("%s is not in the reference: %s is not installed (pip install -e '.[docs]')",
                           module_name, public_api.OPTIONAL[module_name], type="attnkit", subtype="reference")
            continue
        _write(folder / f"{module_name}.rst", module_page(module_name, module, canonical))
        written.append(module_name)
    _write(folder / "index.rst", index_page(written))
    keep = {f"{name}.rst" for name in written} | {"index.rst"}
    for stale in folder.glob("*.rst"):
        if stale.name not in keep:
            stale.unlink()


class ModuleTarget(SphinxDirective):
    """``.. attnkit-module:: NAME``: note NAME as a module (a link target, an entry of the module
    index and of objects.inv) without claiming the name among the domain's other objects."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        name = self.arguments[0]
        node_id = make_id(self.env, self.state.document, "module", name)
        target = nodes.target("", "", ids=[node_id], ismod=True)
        self.set_source_info(target)
        self.state.document.note_explicit_target(target)
        self.env.domains.python_domain.note_module(name=name, node_id=node_id, synopsis="",
                                                   platform="", deprecated=False)
        index = addnodes.index(entries=[("pair", f"module; {name}", node_id, "", None)])
        return [index, target]


def private_in_signature(app: Sphinx, env, node: addnodes.pending_xref, contnode: nodes.Element):
    """A signature's annotation that names a private attnkit type (``attnkit._call.AttentionCall``)
    or a module's type variable (``T``) shows the name without a link: those have no page, by
    design (tests/public_api.py). References written in docstrings are still all checked."""
    if node.get("refdomain") != "py":
        return None
    parent = node.parent
    while parent is not None and not isinstance(parent, addnodes.desc_signature):
        if isinstance(parent, addnodes.desc_content):
            return None
        parent = parent.parent
    if parent is None:
        return None
    target = node["reftarget"]
    module = node.get("py:module") or ""
    if any(part.startswith("_") for part in target.split(".")):
        return contnode
    for candidate in (target, f"{module}.{target}"):
        owner, _, name = candidate.rpartition(".")
        if owner in sys.modules and isinstance(getattr(sys.modules[owner], name, None), typing.TypeVar):
            return contnode
    return None


def setup(app: Sphinx) -> dict:
    app.add_directive("attnkit-module", ModuleTarget)
    app.connect("builder-inited", generate)
    app.connect("missing-reference", private_in_signature)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
