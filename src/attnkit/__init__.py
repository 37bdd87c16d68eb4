"""attnkit: attention mechanisms for PyTorch, exact and verified, easy to look inside.

Boolean masks everywhere in attnkit mean **True = may attend**; ``causal`` is aligned
bottom-right; a query row with no key to attend gives zeros, never NaN.
"""

from . import masks, models, nn, trace
from ._backends import Backend, backends, register_backend
from .core import attention

__all__ = ["attention", "backends", "register_backend", "Backend", "masks", "models", "nn", "trace", "__version__"]
__version__ = "0.1.0"
