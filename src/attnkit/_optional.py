"""Optional dependencies, imported only when a feature needs them: the one place that says which
extra to install when one is missing (the core needs torch alone)."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, feature: str, extra: str = "viz") -> ModuleType:
    """Import ``module``, or raise an ``ImportError`` naming ``feature`` and the ``attnkit[extra]``
    that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{feature} needs the '{module.split('.')[0]}' package: "
                          f"pip install 'attnkit[{extra}]'") from None
