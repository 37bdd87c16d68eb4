"""attnkit: attention mechanisms for PyTorch, exact and verified, easy to look inside.

Boolean masks everywhere in attnkit mean **True = may attend**; ``causal`` is aligned
bottom-right; a query row with no key to attend gives zeros, never NaN.

Example:

    >>> import torch
    >>> import attnkit
    >>> q, k, v = (torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    >>> out, weights = attnkit.attention(q, k, v, causal=True, return_weights=True)
    >>> out.shape
    torch.Size([1, 2, 3, 8])
    >>> print(attnkit.masks.to_string(weights[0, 0] > 0))  # "#": the query attends the key
    # . .
    # # .
    # # #
"""

from . import masks, models, nn, trace
from ._backends import Backend, backends, register_backend
from .core import attention

__all__ = ["attention", "backends", "register_backend", "Backend", "masks", "models", "nn", "trace", "__version__"]
__version__ = "0.1.0"
