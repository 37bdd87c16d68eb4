"""The kernel's two raw ops, ``torch.ops.attnkit_native.interval_forward`` / ``interval_backward``
(registered by the library, see ``csrc/ops.cpp``), with their tile choices made here.
Callers check :func:`.loading.available` first; :mod:`attnkit._backends.interval_op` wraps these
in the public custom op ``attnkit::interval_attention`` (autograd, fake tensors, vmap)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from ... import _torch_private

from .tile_tables import backward_parts, backward_tiles, tiles

#: The schemas the library must register (checked by the probe and after loading).
EXPECTED_SCHEMAS = {
    "interval_forward": "attnkit_native::interval_forward(Tensor query, Tensor key, Tensor value, Tensor lo, "
                        "Tensor hi, float scale, int block, int chunk, float dropout, int seed, float softcap, "
                        "Tensor? alibi_slopes, int dropout_head_start, int dropout_row_start, int dropout_key_start, "
                        "bool residual) -> (Tensor, Tensor, Tensor)",
    "interval_backward": "attnkit_native::interval_backward(Tensor grad_out, Tensor query, Tensor key, "
                         "Tensor value, Tensor out, Tensor lse, Tensor? grad_lse, Tensor lo, Tensor hi, float scale, "
                         "int block, int chunk, int parts, float dropout, int seed, float softcap, "
                         "Tensor? alibi_slopes, int dropout_head_start, int dropout_row_start, "
                         "int dropout_key_start, Tensor? out_low, bool split_weights) -> (Tensor, Tensor, Tensor)",
    "release_kept_memory": "attnkit_native::release_kept_memory() -> int",
    "matrix_units_available": "attnkit_native::matrix_units_available() -> bool",
    "dot_products_available": "attnkit_native::dot_products_available() -> bool",
    "use_half_products": "attnkit_native::use_half_products(int units) -> int",
    "backward_packs": "attnkit_native::backward_packs(Tensor query, Tensor key, Tensor value, Tensor grad_out) -> bool",
}


def registered_schemas() -> dict[str, str]:
    """The schemas of the ops named in ``EXPECTED_SCHEMAS`` that are registered now."""
    found = {}
    for name in EXPECTED_SCHEMAS:
        try:
            found[name] = _torch_private.schema_of(getattr(torch.ops.attnkit_native, name).default)
        except (AttributeError, RuntimeError):
            pass
    return found


def interval_forward(query: Tensor, key: Tensor, value: Tensor, lo: Tensor, hi: Tensor, scale: float,
                     block: int | None = None, chunk: int | None = None, dropout: float = 0.0,
                     seed: int = 0, softcap: float | None = None, alibi_slopes: Tensor | None = None,
                     dropout_start: tuple[int, int, int] = (0, 0, 0),
                     residual: bool = False) -> tuple[Tensor, ...]:
    """``(output [B, H, Lq, Dv], lse [B, H, Lq])`` of attention where row ``i`` of sequence ``b``
    attends keys ``lo[s, i] <= j < hi[s, i]`` (``s = b``, or 0 when ``lo`` has one row). The output
    is laid out as the query (rows outer to heads where the query has them so, else contiguous), and
    so are :func:`interval_backward`'s gradients as their inputs: no copy to view them back as
    ``[B, L, H * D]``.

    ``query [B, H, Lq, D]``, ``key [B, Hkv, Lk, D]``, ``value [B, Hkv, Lk, Dv]`` CPU tensors of one
    dtype (float32, bfloat16 or float16) with H a multiple of Hkv (GQA); the output is in that dtype,
    computed in float32 and rounded once, the lse float32. Rows with no key give zeros and lse
    ``-inf``. ``block`` (query rows
    computed together) and ``chunk`` (keys per step of the running softmax) default to
    :func:`.tile_tables.tiles`. ``dropout`` drops each weight with that probability (and scales the kept
    ones by ``1 / (1 - dropout)``) by :mod:`attnkit._backends.dropout`'s hash of ``seed`` and the
    position; the lse is the one before dropout. ``dropout_start = (head, row, key)`` places the
    call's query heads, rows and keys at those positions of the pattern (a piece of a larger call).

    The score of a pair is ``scale * q.k``, then ``softcap * tanh(score / softcap)`` with a
    ``softcap``, then ``- slope * |i + Lk - Lq - j|`` with ``alibi_slopes`` (float32 ``[H]`` or
    ``[B, H]``: FlashAttention's ALiBi).

    ``residual=True`` returns a third tensor: for half-precision inputs what the output's rounding
    took off (``output + residual`` is the float32 result to about 16 more bits), for
    :func:`interval_backward`'s ``out_low``; for float32 inputs an empty tensor."""
    if block is None or chunk is None:
        default_block, default_chunk = tiles(lo, hi)
        block, chunk = block or default_block, chunk or default_chunk
    _require_library()
    query, key, value = _plain_rows(query, key, value)
    results = torch.ops.attnkit_native.interval_forward(query, key, value, lo, hi, scale, block, chunk, dropout,
                                                        seed, softcap or 0.0, _slopes(alibi_slopes), *dropout_start,
                                                        residual)
    return results if residual else results[:2]


def interval_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                      lo: Tensor, hi: Tensor, scale: float, grad_lse: Tensor | None = None,
                      block: int | None = None, chunk: int | None = None, parts: int | None = None,
                      dropout: float = 0.0, seed: int = 0, softcap: float | None = None,
                      alibi_slopes: Tensor | None = None,
                      dropout_start: tuple[int, int, int] = (0, 0, 0),
                      out_low: Tensor | None = None, split_weights: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`interval_forward` (same shapes as its inputs) from
    ``grad_out [B, H, Lq, Dv]`` and, when the lse was used too, ``grad_lse [B, H, Lq]``; ``out`` and
    ``lse`` are the forward's (the kernel takes FlashAttention's row term ``rowsum(grad_out * out) -
    grad_lse`` from them), ``dropout``, ``seed``, ``softcap``, ``alibi_slopes`` and ``dropout_start``
    too. ``parts`` cuts each (sequence, kv head)'s rows into that many pieces computed in parallel
    (default :func:`.tile_tables.backward_parts`). ``out_low``: the forward's residual
    (``interval_forward(..., residual=True)``) of a half-precision ``out``, so that the row term reads
    the output as computed, not as rounded; None (or empty) reads ``out`` alone.

    On the bfloat16 products (AMX or AVX512-BF16) dV takes the weights rounded to bfloat16 once where
    the forward rounds them once (D == Dv, no modifier, no dropout), else in two parts;
    ``split_weights=True`` asks for two parts there too: a caller whose output and lse were folded
    with sinks must, as their weights sum to less than one."""
    _require_library()
    grad_out, query, key, value, out = _plain_rows(grad_out, query, key, value, out)
    if block is None or chunk is None:
        default_block, default_chunk = backward_tiles(lo, hi, backward_packs(query, key, value, grad_out))
        block, chunk = block or default_block, chunk or default_chunk
    if parts is None:
        parts = backward_parts(query.shape[0], key.shape[1], query.shape[2], block)
    if grad_lse is not None:
        grad_lse = grad_lse.to(torch.float32)
    if out_low is not None and out_low.numel() > 0:
        (out_low,) = _plain_rows(out_low)
    return torch.ops.attnkit_native.interval_backward(grad_out, query, key, value, out, lse, grad_lse, lo, hi, scale,
                                                      block, chunk, parts, dropout, seed, softcap or 0.0,
                                                      _slopes(alibi_slopes), *dropout_start, out_low,
                                                      split_weights)


def release_kept_memory() -> int:
    """Unmap the output memory the kernel keeps for reuse (see :func:`attnkit.kernel.release_memory`);
    returns the bytes released (0 when the kernel is not loaded)."""
    from .loading import available  # loading imports this module

    return int(torch.ops.attnkit_native.release_kept_memory()) if available() else 0


def matrix_units_available() -> bool:
    """Whether the kernel's bfloat16 forward and backward run their products on AMX tiles in this process
    (``csrc/amx.h``: the CPU has AMX-BF16 and the OS granted the tile state); False where the kernel
    is not loaded."""
    from .loading import _library, available  # loading imports this module

    return available() and _library.matrix_units


def dot_products_available() -> bool:
    """Whether the CPU has AVX512-BF16's dot products (``csrc/dots.h``), which multiply the kernel's
    bfloat16 calls when asked (:func:`use_half_products`); False where the kernel is not loaded."""
    from .loading import _library, available  # loading imports this module

    return available() and _library.dot_products


#: The units a half-precision call's products can run on (``csrc/products.h``): the AMX tiles (the
#: default), the AVX512-BF16 dot products, and neither (the float32-convert path, ``csrc/half.h``).
HALF_PRODUCTS = ("tiles", "dots", "convert")


def half_products_available(units: str) -> bool:
    """Whether half-precision products can run on ``units`` (one of :data:`HALF_PRODUCTS`) here: the
    float32-convert path wherever the kernel is loaded, the tiles and the dot products where the CPU
    has them too."""
    if units not in HALF_PRODUCTS:
        raise ValueError(f"half_products_available: units must be one of {HALF_PRODUCTS}, got {units!r}")
    from .loading import available  # loading imports this module

    return {"tiles": matrix_units_available, "dots": dot_products_available, "convert": available}[units]()


def use_half_products(units: str) -> str:
    """Sets the units (one of :data:`HALF_PRODUCTS`) half-precision calls run their products on (the
    tiles take bfloat16 and float16, float16 as two bfloat16 parts per value; the dot products
    bfloat16 alone), each where the CPU has them, else the float32-convert path; returns the
    previous setting. The setting is the
    kernel's, for the whole process (not one thread); the environment variable
    ``ATTNKIT_NATIVE_HALF_PRODUCTS`` sets it when the kernel loads (benchmarks in their own processes).
    The tiles by default; the dot products only when asked (slower than converting on the one CPU
    measured: docs/performance.md)."""
    if units not in HALF_PRODUCTS:
        raise ValueError(f"half_products: units must be one of {HALF_PRODUCTS}, got {units!r}")
    _require_library()
    return _ask_units(units)


_UNITS_CODE = {"convert": 0, "dots": 1, "tiles": 2}  # csrc/products.h's HalfProducts


def _ask_units(units: str) -> str:
    """Sets the kernel's units (a loaded kernel: also from ``loading`` while it loads); the previous."""
    previous = int(torch.ops.attnkit_native.use_half_products(_UNITS_CODE[units]))
    return next(name for name, code in _UNITS_CODE.items() if code == previous)


def backward_packs(query: Tensor, key: Tensor, value: Tensor, grad_out: Tensor) -> bool:
    """Whether :func:`interval_backward` over these tensors (the kernel's row layout, as
    :func:`_plain_rows` leaves them) runs its half-precision products on the packed layouts
    (``csrc/products.h``: the AMX tiles or the dot products, as asked and as the CPU has them),
    which take their own tile table (:data:`.tile_tables.PACKED_BACKWARD_TILES`). The kernel's
    own decision, asked of it."""
    return bool(torch.ops.attnkit_native.backward_packs(query, key, value, grad_out))


@contextmanager
def half_products(units: str) -> Iterator[None]:
    """Inside the ``with``, half-precision calls run their products on ``units`` (:func:`use_half_products`),
    for tests and benchmarks that compare the paths."""
    previous = use_half_products(units)
    try:
        yield
    finally:
        use_half_products(previous)


def _slopes(alibi_slopes: Tensor | None) -> Tensor | None:
    """ALiBi slopes as the kernel takes them: float32 ``[1 or B, H]``."""
    if alibi_slopes is None:
        return None
    return alibi_slopes.to(torch.float32).reshape(-1, alibi_slopes.shape[-1]).contiguous()


def _require_library() -> None:
    from .loading import available, why_unavailable  # loading imports this module

    if not available():
        raise RuntimeError(f"attnkit native kernel unavailable: {why_unavailable()}")


def _plain_rows(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The kernel reads rows of unit stride along the head dimension, at a stride >= the row
    length. A size-1 dim may carry any stride (and ``.contiguous()`` keeps it), so such rare layouts
    are copied with fresh strides."""
    return tuple(t if t.stride(-1) == 1 and t.stride(-2) >= t.shape[-1]
                 else t.clone(memory_format=torch.contiguous_format) for t in tensors)
