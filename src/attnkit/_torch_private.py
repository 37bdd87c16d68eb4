"""Every private PyTorch API attnkit touches, in one place, checked against the torch versions
the test suite runs on.

- ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward): the CPU kernel
  behind ``F.scaled_dot_product_attention``, which also returns the log-sum-exp; the tiled backend
  runs it per block where attnkit's native kernel does not run.
- ``torch._C._GLIBCXX_USE_CXX11_ABI``: the C++ ABI the native kernel must be compiled with.
- ``OpOverload._schema``: the schema an op was registered with (the native kernel's are checked).
- ``fn._dynamo_marked_constant``: what ``torch.compiler.assume_constant_result`` sets, set here
  without importing ``torch._dynamo`` (about 1.4 s at import).
- ``CustomOpDef._backend_fns`` and ``_disable_dynamo``'s ``__dynamo_disable`` cache: a custom op's
  implementation is wrapped so that its first call imports ``torch._dynamo`` (1.4-3 s) even in
  programs that never compile; :func:`eager_first_call` defers that until Dynamo is loaded.
- ``torch._dynamo.config.recompile_limit`` (``cache_size_limit`` before 2.6) and
  ``torch._dynamo.exc.FailOnRecompileLimitHit``: the compiled FlexAttention engine keeps more
  versions than dynamo's default 8 and, past that, fails loudly instead of running FlexAttention
  unfused (an ``Lq x Lk`` score matrix) (:func:`recompile_limit`, :func:`recompile_limit_hit`).
- ``torch.cpu._is_amx_tile_supported``, ``_is_amx_fp16_supported``, ``_is_avx512_bf16_supported``:
  whether the CPU multiplies bfloat16 or float16 in hardware (:func:`cpu_multiplies_half_precision`).
- ``nn.MultiheadAttention._qkv_same_embed_dim``: whether a module packs its in-projections
  (``in_proj_weight``) or keeps three (``attnkit.nn.interop``).
- ``torch._C._functorch.is_functorch_wrapped_tensor``, ``torch._subclasses``' fake and functional
  tensors: tensors (inside ``torch.func`` transforms, compile-time tracing) whose values cannot steer
  Python control flow.
- ``torch.autograd.forward_ad._current_level``, ``torch._C._functorch.peek_interpreter_stack``,
  ``TransformType`` and ``retrieve_all_functorch_interpreters``: whether forward-mode AD is under
  way (:func:`forward_ad_active`), which SDPA's fused kernels and attnkit's custom op lack, and
  whether transforms differentiate twice (:func:`nested_differentiation`).
- ``torch._C._dispatch_keys``: whether a gradient is batched by ``torch._vmap_internals``
  (:func:`legacy_batched`).
- ``torch._C._get_tracing_state`` / ``_set_tracing_state``: an op whose result is not a tensor (the
  native kernel's ``matrix_units_available``) run while ``torch.jit.trace`` records, which refuses
  such outputs (:func:`untraced`).

Outside :data:`TESTED` the native kernel is not loaded and the per-block kernel falls back to plain
tensor ops (:func:`flash_cpu_ops` returns None): slower, never wrong.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.autograd.forward_ad  # noqa: F401  (forward_ad_active reads it)
from torch._C._functorch import TransformType

#: (major, minor) releases of torch the test suite runs on; pyproject.toml admits the same range.
TESTED = ((2, 13),)


def torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def supported() -> bool:
    """This torch is one the private APIs below were tested with."""
    return torch_release() in TESTED


def cxx11_abi() -> bool:
    """Whether this torch was built with the C++11 ABI of libstdc++ (``_GLIBCXX_USE_CXX11_ABI``)."""
    return bool(torch._C._GLIBCXX_USE_CXX11_ABI)


def flash_cpu_ops():
    """``(forward, backward)`` of PyTorch's fused CPU attention kernel with its log-sum-exp, or None
    on a torch outside :data:`TESTED` (their signatures are private and have changed before).

    forward(query, key, value, attn_mask=, scale=) -> (output, lse), ``[B, H, L, D]`` layout;
    backward(grad_out, query, key, value, out, lse, dropout_p, is_causal, attn_mask=, scale=)."""
    if not supported():
        return None
    aten = torch.ops.aten
    return aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward


def packs_in_projections(module: torch.nn.MultiheadAttention) -> bool:
    """Whether ``module`` keeps one packed ``in_proj_weight`` (its private ``_qkv_same_embed_dim``)."""
    return bool(module._qkv_same_embed_dim)


def without_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has no values Python may branch on: a ``torch.func`` transform's wrapper
    (``vmap``, ``grad``), a fake or functional tensor (``torch.compile``'s and AOT autograd's
    tracing, ``torch.library.opcheck``; a plain tensor wrapped for functionalization), or a meta tensor."""
    if type(tensor) is torch.Tensor:  # neither a fake nor a functional subclass: 0.5 us, not 4 (per call)
        return (tensor.device.type == "meta" or bool(torch._C._functorch.is_functorch_wrapped_tensor(tensor))
                or torch._is_functional_tensor(tensor))
    from torch._subclasses.fake_tensor import is_fake
    from torch._subclasses.functional_tensor import FunctionalTensor

    return (tensor.device.type == "meta" or bool(torch._C._functorch.is_functorch_wrapped_tensor(tensor))
            or is_fake(tensor) or isinstance(tensor, FunctionalTensor))


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jvp``, ...) is running eagerly
    (never while ``torch.compile`` traces: Dynamo cannot trace the stack's walk)."""
    return not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None


def _transforms() -> list:
    """The kinds (``TransformType``) of the ``torch.func`` transforms running, outermost first;
    empty when none is (or while ``torch.compile`` traces)."""
    if not functorch_active():
        return []
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return [level.key() for level in retrieve_all_functorch_interpreters()]


def nested_differentiation() -> bool:
    """Whether two or more differentiating ``torch.func`` levels (``grad``, ``vjp``'s, ``jvp``) are
    running: ``hessian``, ``jacfwd(jacfwd(f))``, ``grad(grad(f))``, ``jacrev(jacrev(f))``. One
    level under ``vmap`` (``vmap(grad(f))``, ``jacrev``, ``jacfwd``) is not."""
    return sum(kind in (TransformType.Grad, TransformType.Jvp) for kind in _transforms()) >= 2


def forward_ad_active() -> bool:
    """Whether forward-mode AD may be under way: a dual level of ``torch.autograd.forward_ad`` is
    open (its private ``_current_level``), or a ``torch.func.jvp`` transform (``jacfwd``,
    ``hessian``) is on the functorch stack. Cheap when neither is (two reads, no stack walk)."""
    if torch.autograd.forward_ad._current_level >= 0:  # a module attribute: ~0.1 us where an import took 1
        return not torch.compiler.is_compiling()
    return TransformType.Jvp in _transforms()


def beyond_first_order() -> bool:
    """Forward-mode AD or ``torch.func`` transforms that differentiate twice: what PyTorch's fused
    kernels (SDPA's, FlexAttention's) have no rules for."""
    if torch.autograd.forward_ad._current_level < 0 and not functorch_active():
        return False  # the common case, answered by one look at the functorch stack, not three
    return forward_ad_active() or nested_differentiation()


def legacy_batched(tensor: torch.Tensor | None) -> bool:
    """Whether ``tensor`` is batched by the older vmap of ``torch._vmap_internals``, which
    ``torch.autograd.grad(..., is_grads_batched=True)`` (``torch.autograd.functional.jacobian`` and
    ``hessian`` with ``vectorize=True``) applies to the output gradients: its ``Batched`` dispatch
    key, read from the key set's name (no Python name exists for it; ~1.5 us, so only backwards
    ask)."""
    if tensor is None:
        return False
    keys = str(torch._C._dispatch_keys(tensor)).removeprefix("DispatchKeySet(").removesuffix(")")
    return "Batched" in keys.split(", ")


def schema_of(op) -> str:
    """The registered schema of an op overload, e.g. ``torch.ops.attnkit_native.interval_forward.default``."""
    return str(op._schema)


def recompile_limit(limit: int):
    """A context in which dynamo keeps up to ``limit`` compiled versions of a function (more if the
    process already allows more)."""
    import torch._dynamo.config as config

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(limit, getattr(config, name))})


def recompile_limit_hit() -> tuple[type[BaseException], ...]:
    """What a ``fullgraph=True`` compiled function raises when it has used up its versions."""
    import torch._dynamo.exc as exc

    return tuple(getattr(exc, name) for name in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")
                 if hasattr(exc, name))


def assume_constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing ``torch._dynamo``: the mark is
    an attribute dynamo reads when (and if) it traces a call of ``fn``."""
    fn._dynamo_marked_constant = True
    return fn


def eager_first_call(op) -> None:
    """Let the first eager call of ``op`` (a ``torch.library.custom_op``) skip importing
    ``torch._dynamo``. torch wraps each implementation in ``torch._disable_dynamo``, which imports
    Dynamo on its first call to build the disabled function (measured: 1.4-3 s, 8x a sliding-window
    call at L = 16384). Dynamo only needs the wrapper when it is loaded, so the wrapper's cache is
    filled with a function that calls the implementation directly until then, and Dynamo's own
    disabled function from then on. Outside :data:`TESTED`, or where the internals differ, nothing
    changes (the first call is slower, never wrong)."""
    import sys

    if not supported():
        return
    for wrapped in getattr(op, "_backend_fns", {}).values():
        fn = getattr(wrapped, "__wrapped__", None)
        if fn is None or not callable(fn):
            continue

        def until_dynamo_loads(*args, _fn=fn, **kwargs):
            if "torch._dynamo" in sys.modules:
                disabled = sys.modules["torch._dynamo"].disable(_fn, True, wrapping=False)
                setattr(_fn, "__dynamo_disable", disabled)  # what _disable_dynamo caches
                return disabled(*args, **kwargs)
            return _fn(*args, **kwargs)

        setattr(fn, "__dynamo_disable", until_dynamo_loads)


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """Inside the ``with``, ``torch.jit.trace`` (if one is recording) records nothing."""
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        yield
    finally:
        torch._C._set_tracing_state(state)


#: The instructions with which PyTorch's CPU kernels multiply each half-precision dtype in hardware
#: (by ``torch.cpu``'s probes): bfloat16 on AMX tiles or AVX512-BF16's dot products, float16 on
#: AMX-FP16 tiles (AVX512-FP16's multiply-adds round to float16: not for its matrix products).
_HALF_PRECISION_PROBES = {
    torch.bfloat16: ("_is_amx_tile_supported", "_is_avx512_bf16_supported"),
    torch.float16: ("_is_amx_fp16_supported",),
}


def cpu_multiplies_half_precision(dtype: torch.dtype) -> bool:
    """Whether this CPU has matrix or dot-product instructions for ``dtype`` (bfloat16 or float16)
    that PyTorch's own CPU kernels use; False where torch cannot say."""
    probes = _HALF_PRECISION_PROBES.get(dtype, ())
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)
