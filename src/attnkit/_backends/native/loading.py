"""Loading the built kernel into this process, safely, once.

A library is loaded only when its bytes match the record written when it was built and probed
(:mod:`.building`): a truncated, corrupted or foreign file (a crash waiting to happen: loading a
truncated shared object can kill the process with SIGBUS) is refused before ``dlopen`` ever sees
it. A library without a record (built by hand, or the record was deleted) is probed in a separate
process first, and recorded when it passes. After loading, the ops it registered must have the
expected schemas. Whatever fails, the tiled backend runs on PyTorch's kernels, and one warning says
why and how to rebuild.

``ATTNKIT_NATIVE=0`` turns the kernel off for the process; :func:`turned_off` for a block of code
(in this thread or task only: the switch lives in a context variable).
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import torch
from torch import Tensor

from ... import _torch_private
from . import building as _build
from .ops import EXPECTED_SCHEMAS, HALF_PRODUCTS, _ask_units, registered_schemas

REBUILD = "attnkit build-kernel"


class _Library:
    """The process's one attempt at loading the kernel: made on the first ask, under a lock, and
    remembered (a library cannot be unloaded, and a failed one is not tried again)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.loaded: bool | None = None
        self.why_not = ""
        self.path: Path | None = None
        self.wide = False  # the AVX-512 build (see building.wide)
        self.not_built = False  # it would run here: only the build step is missing
        self.hinted = False
        self.matrix_units = False  # the half-precision products on AMX tiles (csrc/amx.h), asked once at load
        self.dot_products = False  # AVX512-BF16's dot products (csrc/dots.h), asked once at load

    def load(self) -> bool:
        if self.loaded is None:
            with self._lock:
                if self.loaded is None:
                    self.loaded, self.why_not = self._try()
        return self.loaded

    def _try(self) -> tuple[bool, str]:
        if os.environ.get("ATTNKIT_NATIVE", "1") == "0":
            return False, "turned off by ATTNKIT_NATIVE=0"
        if why := _build.cpu_supported():
            return False, why
        if not _torch_supported():
            return False, f"built for torch 2.13, this is torch {torch.__version__}"
        self.wide = _build.wide()  # before the path, which the same flags name
        path = self.path = _build.library_path()
        if not path.exists():
            self.not_built = True
            return False, f"not built (run: {REBUILD})"
        if why := _verify(path):
            warnings.warn(f"attnkit native kernel not loaded: {why}; structured masks run on PyTorch's kernels "
                          f"(rebuild with: {REBUILD})", RuntimeWarning, stacklevel=4)
            return False, why
        try:
            torch.ops.load_library(str(path))
        except (OSError, RuntimeError) as error:
            return _refused(f"could not load {path}: {error}")
        if registered_schemas() != EXPECTED_SCHEMAS:
            return _refused(f"{path} registered {registered_schemas()}, expected {EXPECTED_SCHEMAS}")
        with _torch_private.untraced():  # a first load may happen while torch.jit.trace records
            self.matrix_units = bool(torch.ops.attnkit_native.matrix_units_available())
            self.dot_products = bool(torch.ops.attnkit_native.dot_products_available())
            _ask_half_products(os.environ.get("ATTNKIT_NATIVE_HALF_PRODUCTS", ""))
        return True, ""


def _ask_half_products(units: str) -> None:
    """Sets the units ``ATTNKIT_NATIVE_HALF_PRODUCTS`` names (empty: the default, the tiles); another
    value is warned about and the default kept."""
    if not units:
        return
    if units not in HALF_PRODUCTS:
        warnings.warn(f"ATTNKIT_NATIVE_HALF_PRODUCTS must be one of {HALF_PRODUCTS}, got {units!r}; "
                      f"bfloat16 products stay on the default units", RuntimeWarning, stacklevel=5)
        return
    _ask_units(units)


def _refused(why: str) -> tuple[bool, str]:
    warnings.warn(f"attnkit native kernel not loaded: {why}; structured masks run on PyTorch's kernels "
                  f"(rebuild with: {REBUILD})", RuntimeWarning, stacklevel=5)
    return False, why


def _torch_supported() -> bool:
    from ... import _torch_private

    return _torch_private.supported()


def _verify(path: Path) -> str:
    """Empty when ``path`` may be loaded in-process: its bytes match its build record, or (no
    record) a separate process loaded and ran it. Else why not."""
    record = _build.read_record(path)
    if record is None:
        if why := _build.probe(path):
            return f"{path} has no build record and {why}"
        try:  # remember the verdict; an unwritable cache only means probing again next time
            _build.write_record(path, "unknown (library found without a record)")
        except OSError:
            pass
        return ""
    try:
        size, digest = path.stat().st_size, _build.file_digest(path)
    except OSError as error:
        return f"cannot read {path}: {error}"
    if size != record.get("size") or digest != record.get("sha256"):
        return f"{path} does not match its build record (truncated, corrupted or replaced)"
    return ""


_library = _Library()
_disabled: ContextVar[bool] = ContextVar("attnkit_native_disabled", default=False)


def available() -> bool:
    """Whether the built kernel is loaded (loading it, safely, on the first ask)."""
    return _library.load()


def why_unavailable() -> str:
    """Why :func:`available` is False (empty when it is True)."""
    return "" if available() else _library.why_not


def hint_if_not_built() -> None:
    """Once per process, when a call the kernel would serve runs without it only because it was
    never built (a ``pip install`` without ``make``): one line saying how to build it."""
    if available() or not _library.not_built or _library.hinted:
        return
    _library.hinted = True
    warnings.warn(f"attnkit: the native CPU kernel for structured masks is not built, so they run on "
                  f"PyTorch's kernels (slower); build it once with: {REBUILD}", UserWarning, stacklevel=3)


def wide() -> bool:
    """Whether the loaded kernel is the AVX-512 build: its products in 512-bit vectors, the backward
    about twice as fast as the AVX2 build's on such a CPU."""
    return available() and _library.wide


def loaded_from() -> Path | None:
    """The library this process loaded, or None."""
    return _library.path if available() else None


@contextmanager
def turned_off() -> Iterator[None]:
    """Inside the ``with``, the tiled backend runs PyTorch's kernels even where this one applies
    (tests run the tiled suite both ways; benchmarks compare them). Local to the thread or task."""
    token = _disabled.set(True)
    try:
        yield
    finally:
        _disabled.reset(token)


def enabled() -> bool:
    """The kernel is loaded and not turned off here."""
    return not _disabled.get() and available()


#: The dtypes the kernel takes (half precision computed in float32: ``csrc/half.h``).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def serves(device_type: str, dtype: torch.dtype, has_tensor_mask: bool, needs_grad: bool = False) -> bool:
    """The kernel serves calls of this kind: CPU tensors of float32, bfloat16 or float16, no dense
    tensor mask, kernel enabled; half precision where :func:`serves_half_precision`, and elsewhere
    when the call needs gradients (``needs_grad``): PyTorch's half-precision backward on the CPU is
    the slow part everywhere measured (see :func:`serves_half_precision`)."""
    if has_tensor_mask or device_type != "cpu" or dtype not in KERNEL_DTYPES or not enabled():
        return False
    return dtype == torch.float32 or needs_grad or serves_half_precision(dtype)


@functools.cache
def serves_half_precision(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` (bfloat16 or float16) calls run on the kernel. On CPUs without matrix
    instructions for the dtype it computes them in float32 and PyTorch's own kernels convert too (AMD
    Zen 3, AVX2, L = 4096 causal, 2 threads: its bf16 training step 850 ms against SDPA's 4,107, the
    forward level). On a CPU with AMX-BF16 its bfloat16 products run on the tiles (``csrc/amx.h``),
    and it beat PyTorch's AMX kernels in bf16 and fp16, forward and training, on every mask measured
    (Intel Xeon with AMX, L = 8192, H = 8, D = 64, 2 threads, benchmarks/half_routes.py: bf16 forward
    0.33-0.68x their time, training 0.10-0.70x; fp16 forward, which converts, 0.53-0.86x;
    docs/performance.md). Where the CPU has AVX512-BF16 but no AMX, PyTorch's kernels keep the
    bfloat16 calls that need no gradient: played on that Xeon (oneDNN held to AVX512_CORE_BF16, the
    kernel's products converted; L = 4096-16384, 2 threads, the same benchmark) the kernel's forward
    took 0.70-1.62x their time (faster on the window, slower on documents and plain causal) and its
    training step 0.20-0.82x theirs, 0.52-0.70x with no mask from L = 128 (calls with a backward run
    it: :func:`serves`'s ``needs_grad``); float16, which such a CPU does not multiply, ran on the
    kernel in 0.59-0.78x their time forward, 0.04-0.05x in training. The kernel's AVX512-BF16 dot
    products (``csrc/dots.h``) were slower there than its float32 products."""
    from .ops import matrix_units_available

    return not _torch_private.cpu_multiplies_half_precision(dtype) or matrix_units_available()


def applies(query: Tensor, key: Tensor, value: Tensor, has_tensor_mask: bool) -> bool:
    """The kernel serves this call (:func:`serves`; query, key and value share one dtype)."""
    return serves(query.device.type, query.dtype, has_tensor_mask)

