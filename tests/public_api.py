"""attnkit's public API, enumerated from the package itself (never from a list kept by hand).

A public module is one whose dotted path has no part starting with ``_``. Its public names are its
``__all__`` where it has one, else every function and class it defines whose name does not start
with ``_``. A public class's public methods and properties are the ones it defines itself (not
inherited, not starting with ``_``; ``nn.Module``'s ``extra_repr`` hook aside): its constructor is
documented, with an example, by the class docstring. The API
reference (docs/reference) and the docstring tests (tests/test_docstrings.py) both use this.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from types import ModuleType

import attnkit

#: Modules that need an optional dependency to import; skipped where it is missing.
OPTIONAL = {"attnkit.integrations.transformers": "transformers"}


def public_modules() -> list[str]:
    """Every public module of attnkit, ``attnkit`` first, in a stable order."""
    names = ["attnkit"]
    for info in pkgutil.walk_packages(attnkit.__path__, "attnkit."):
        if not any(part.startswith("_") for part in info.name.split(".")[1:]):
            names.append(info.name)
    return sorted(set(names), key=lambda n: (n != "attnkit", n))


def importable(name: str) -> ModuleType | None:
    """The module, or None where its optional dependency is not installed."""
    needs = OPTIONAL.get(name)
    if needs is not None:
        try:
            importlib.import_module(needs)
        except ImportError:
            return None
    return importlib.import_module(name)


def public_names(module: ModuleType) -> list[str]:
    """The module's public names (see the module docstring)."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return sorted(name for name, obj in vars(module).items()
                  if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
                  and getattr(obj, "__module__", None) == module.__name__)


def public_members(cls: type) -> list[str]:
    """A public class's own public methods and properties."""
    names = []
    for name, obj in vars(cls).items():
        if name.startswith("_") or name == "extra_repr":
            continue
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if inspect.isfunction(obj) or isinstance(obj, property):
            names.append(name)
    return names


def public_objects() -> Iterator[tuple[str, object]]:
    """``(qualified name, object)`` of every public function, class, method and property, each
    once, under the first public module that lists it (``attnkit.attention`` before
    ``attnkit.core.attention``)."""
    seen: set[int] = set()
    for module_name in public_modules():
        module = importable(module_name)
        if module is None:
            continue
        for name in public_names(module):
            obj = getattr(module, name)
            if id(obj) in seen or inspect.ismodule(obj):
                continue
            if not (inspect.isfunction(obj) or inspect.isclass(obj) or callable(obj)):
                continue  # constants are documented by their module
            seen.add(id(obj))
            yield f"{module_name}.{name}", obj
            if inspect.isclass(obj):
                for member in public_members(obj):
                    yield f"{module_name}.{name}.{member}", vars(obj)[member]
