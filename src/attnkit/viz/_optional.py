"""Optional dependencies of the viz extra, imported only when a feature needs them."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` or explain which extra provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"{feature} needs {module.split('.')[0]}: pip install 'attnkit[viz]'") from error
