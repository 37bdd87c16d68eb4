"""The backend registry: named implementations of one attention semantics.

A backend is a function from a validated :class:`~attnkit._call.AttentionCall` to
``(output, weights or None[, lse])``, with a declaration of what it supports. Every backend
implements the same contract (masks with True = may attend, bottom-right causal, zeros for rows
with no key, dropout on the weights with attnkit's one pattern, masked-out pairs never read), so
they are interchangeable and the test suite checks each against one oracle. ``"auto"`` is not a
backend but a choice made once per call by :mod:`.policy`: a :class:`Route` (backend, and for the
tiled backend its kernel), kept on the call (``AttentionCall.route``) for the backend to follow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import Tensor

from .._call import AttentionCall

__all__ = ["Backend", "Route", "register_backend", "get_backend", "backends", "choose", "auto_runs", "resolve"]

# Returns (output, weights or None), or (output, weights or None, lse) from backends that
# declare returns_lse (the lse is used when the call asks for it).
BackendFn = Callable[[AttentionCall], tuple[Tensor, ...]]
# (call, output, lse, grad_output, grad_lse or None) -> (grad_query, grad_key, grad_value).
GradientsFn = Callable[[AttentionCall, Tensor, Tensor, Tensor, "Tensor | None"], tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class Backend:
    """A named attention implementation and what it supports.

    ``name``: what ``attention(..., backend=name)`` selects it by. ``run``: the implementation, a
    function of one validated call (``attnkit._call.AttentionCall``: ``query [..., Lq, Dk]``,
    ``key [..., Lk, Dk]``, ``value [..., Lk, Dv]``, ``mask``, ``causal``, ``scale``, ``dropout``, ...)
    returning ``(output [..., Lq, Dv], weights [..., Lq, Lk] or None)``, or with ``returns_lse``
    ``(output, weights or None, lse [..., Lq])``. ``summary``: one line for listings.
    ``returns_weights`` / ``returns_lse``: it can return the weights / the log-sum-exp.
    ``structured``: it reads structured masks (others receive the call densified,
    ``AttentionCall.densified()``: the mask as a dense boolean tensor).
    ``devices``: the device types it runs on (None: any device PyTorch runs on).
    ``gradients`` (optional, for backends that return the lse): the gradients of query, key and
    value of a call from the output and lse the backend returned for it and their gradients,
    without recomputing the forward (``attnkit.distributed``'s Ulysses runs its backward by
    groups of heads with it).
    Every backend takes any rank ``[..., L, D]``, dense boolean and additive masks, causal,
    GQA (4-D), dropout with a generator, and is differentiable. Register one with
    :func:`attnkit.register_backend`.

    Example:

        A sketch that handles only plain calls (a real backend implements the whole contract):

        >>> import attnkit
        >>> def plain(call):
        ...     if call.mask is not None or call.causal or call.dropout or call.modifies_scores or call.is_gqa:
        ...         raise NotImplementedError("plain: unmasked calls without dropout or score modifiers only")
        ...     weights = (call.query @ call.key.transpose(-2, -1) * call.scale).softmax(-1)
        ...     return weights @ call.value, weights
        >>> backend = attnkit.Backend("plain", plain, "softmax(q k^T * scale) v, plain calls only",
        ...                           returns_weights=True)
        >>> backend.name, backend.returns_weights, backend.returns_lse, backend.structured, backend.devices
        ('plain', True, False, False, None)
    """

    name: str
    run: BackendFn
    summary: str
    returns_weights: bool = False
    returns_lse: bool = False
    structured: bool = False
    devices: frozenset[str] | None = None
    gradients: GradientsFn | None = None


_REGISTRY: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Make ``backend`` selectable by name in ``attention(..., backend=name)``.

    Args:
        backend: a :class:`attnkit.Backend`; one registered under the same name is replaced.

    Raises:
        TypeError: ``backend`` is not a :class:`attnkit.Backend`.
        ValueError: its name is ``"auto"`` (reserved for automatic selection).

    Example:

        >>> import torch
        >>> import attnkit
        >>> def plain(call):  # unmasked calls only: a sketch (see attnkit.Backend)
        ...     weights = (call.query @ call.key.transpose(-2, -1) * call.scale).softmax(-1)
        ...     return weights @ call.value, weights
        >>> attnkit.register_backend(attnkit.Backend("plain", plain, "a sketch", returns_weights=True))
        >>> "plain" in attnkit.backends()
        True
        >>> q = torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(0))
        >>> torch.allclose(attnkit.attention(q, q, q, backend="plain"),
        ...                attnkit.attention(q, q, q, backend="reference"), atol=1e-6)
        True
        >>> attnkit.attention(q, q, q, backend="plain", return_lse=True)
        Traceback (most recent call last):
            ...
        ValueError: backend 'plain' cannot return the log-sum-exp; use return_lse=False,
        or backend 'auto' or one of ['tiled']
        >>> attnkit.register_backend(attnkit.Backend("auto", plain, "a sketch"))
        Traceback (most recent call last):
            ...
        ValueError: 'auto' is reserved for automatic selection
    """
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be an attnkit.Backend, got {type(backend).__name__}")
    if backend.name == "auto":
        raise ValueError("'auto' is reserved for automatic selection")
    _REGISTRY[backend.name] = backend


def backends() -> tuple[str, ...]:
    """Names accepted by ``attention(..., backend=...)``: ``"auto"`` then every registered backend.

    Returns:
        A tuple of str: ``"auto"``, the built-in ``"reference"``, ``"torch"`` and ``"tiled"``, then
        the backends registered with :func:`attnkit.register_backend`, in registration order.

    Example:

        >>> import attnkit
        >>> attnkit.backends()  # then any backend you registered
        ('auto', 'reference', 'torch', 'tiled'...)
    """
    return ("auto", *_REGISTRY)


def get_backend(name: str) -> Backend:
    """The registered backend called ``name`` (not ``"auto"``); a clear error for unknown names."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, one of {backends()}, got {type(name).__name__}")
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; available: {backends()}") from None


def choose(call: AttentionCall) -> Route:
    """What ``backend="auto"`` runs for ``call`` (:mod:`.policy`): a backend and, for the tiled
    backend, its kernel (or ``""``: chosen by its op from the row bounds at run time)."""
    return _policy.choose(call)


def auto_runs(call: AttentionCall) -> str:
    """What ``"auto"`` runs for ``call``, read from its data as the op would: ``"torch"``, or the
    tiled backend with its kernel, ``"tiled:native"``, ``"tiled:blocks"``, ``"tiled:dense"`` (PyTorch's
    fused kernel over the dense mask) or ``"tiled:triton"``. For tests and benchmarks."""
    route = choose(call)
    if route.backend != "tiled" or route.kernel:
        return str(route)
    return "tiled:" + _policy.kernel_for(_tiled.interval_inputs(replace(call, route=route)))


def resolve(name: str, call: AttentionCall) -> tuple[Backend, Route]:
    """The backend that will run ``call`` when the user asked for ``name``, and the route it takes
    (decided here, once per call: the backend's backward follows it). An explicit name is never
    replaced: a backend that cannot do what the call asks is an error."""
    route = choose(call) if name == "auto" else Route(get_backend(name).name)
    backend = get_backend(route.backend)
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
    device = call.query.device.type
    if backend.devices is not None and device not in backend.devices:
        raise ValueError(f"backend {backend.name!r} runs on {sorted(backend.devices)}, the inputs are on {device!r}")
    return backend, route


from . import fused as _fused  # noqa: E402  (registration needs the registry above)
from . import policy as _policy  # noqa: E402
from .policy import Route  # noqa: E402
from . import reference as _reference  # noqa: E402
from . import tiled as _tiled  # noqa: E402

register_backend(
    Backend("reference", _reference.reference_attention,
            "the readable formula: scores, scale, mask, softmax, dropout, weighted sum", returns_weights=True)
)
register_backend(
    Backend("torch", _fused.torch_attention,
            "PyTorch's fused F.scaled_dot_product_attention; weights and dropout via baddbmm + in-place softmax",
            returns_weights=True)
)
register_backend(
    Backend("tiled", _tiled.tiled_attention,
            "block-sparse: per query block only the keys the mask allows (attnkit's native CPU kernel, "
            "else PyTorch's kernels per block), O(L) memory", returns_weights=True, returns_lse=True, structured=True,
            gradients=_tiled.tiled_gradients)
)
