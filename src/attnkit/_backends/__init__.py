"""The backend registry: named implementations of one attention semantics.

A backend is a function from a validated :class:`~attnkit._call.AttentionCall` to
``(output, weights or None)``. Every backend implements the same contract (masks with
True = may attend, bottom-right causal, zeros for rows with no key, dropout on the
weights), so they are interchangeable and the test suite checks each against one oracle.
``"auto"`` is not a backend but a choice made per call by :func:`choose`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .._call import AttentionCall

__all__ = ["Backend", "register_backend", "get_backend", "backends", "choose"]

# Returns (output, weights or None), or (output, weights or None, lse) from backends that
# declare returns_lse (the lse is used when the call asks for it).
BackendFn = Callable[[AttentionCall], tuple[Tensor, ...]]


@dataclass(frozen=True)
class Backend:
    """A named attention implementation and what it can do."""

    name: str
    run: BackendFn
    summary: str
    returns_weights: bool = False
    returns_lse: bool = False
    structured: bool = False  # understands structured masks; others receive call.densified()


_REGISTRY: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Make ``backend`` selectable by name in ``attention(..., backend=name)``."""
    if backend.name == "auto":
        raise ValueError("'auto' is reserved for automatic selection")
    _REGISTRY[backend.name] = backend


def backends() -> tuple[str, ...]:
    """Names accepted by ``attention(..., backend=...)``: ``"auto"`` then every registered backend."""
    return ("auto", *_REGISTRY)


def get_backend(name: str) -> Backend:
    """The registered backend called ``name`` (not ``"auto"``); a clear error for unknown names."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, one of {backends()}, got {type(name).__name__}")
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; available: {backends()}") from None


def choose(call: AttentionCall) -> Backend:
    """What ``backend="auto"`` runs: tiled for the log-sum-exp, a structured mask where skipping
    blocks pays, or dropout where attnkit's native kernel runs (see ``tiled.profits``), else the
    fused kernel (with weights, its materialised fused-op path). Under ``torch.compile`` only the
    log-sum-exp goes tiled: that backend plans and calls its kernels eagerly, which would break
    the graph, while the fused path traces (a structured mask in its dense form)."""
    if call.return_lse or (not torch.compiler.is_compiling() and _tiled.profits(call)):
        return _REGISTRY["tiled"]
    return _REGISTRY["torch"]


def resolve(name: str, call: AttentionCall) -> Backend:
    """The backend that will run ``call`` when the user asked for ``name``."""
    backend = choose(call) if name == "auto" else get_backend(name)
    if call.return_weights and not backend.returns_weights:
        capable = [b.name for b in _REGISTRY.values() if b.returns_weights]
        raise ValueError(
            f"backend {backend.name!r} cannot return attention weights; use return_weights=False, "
            f"or backend 'auto' or one of {capable}"
        )
    if call.return_lse and not backend.returns_lse:
        capable = [b.name for b in _REGISTRY.values() if b.returns_lse]
        raise ValueError(
            f"backend {backend.name!r} cannot return the log-sum-exp; use return_lse=False, "
            f"or backend 'auto' or one of {capable}"
        )
    return backend


from . import reference as _reference  # noqa: E402  (registration needs the registry above)
from . import fused as _fused  # noqa: E402
from . import tiled as _tiled  # noqa: E402

register_backend(
    Backend("reference", _reference.reference_attention,
            "the readable formula: scores, scale, mask, softmax, dropout, weighted sum", returns_weights=True)
)
register_backend(
    Backend("torch", _fused.torch_attention,
            "PyTorch's fused F.scaled_dot_product_attention; weights via baddbmm + in-place softmax",
            returns_weights=True)
)
register_backend(
    Backend("tiled", _tiled.tiled_attention,
            "block-sparse: per query block, only the keys the mask allows, through the fused kernel",
            returns_weights=True, returns_lse=True, structured=True)
)
