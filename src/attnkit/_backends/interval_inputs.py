"""The interval op's inputs as one frozen record, flattened only at the op boundary.

``torch.library`` custom ops take positional tensors and scalars; a record keeps the fifteen of
``attnkit::interval_attention`` together everywhere else (the tiled backend, the op's autograd and
vmap rules, the ring), the way FlexAttention's ``BlockMask.as_tuple()`` carries its own tensors
through its operator. A field added here is added to the op's schema in one place: its
definition in :mod:`.interval_op` lists the fields in this order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import Tensor

__all__ = ["IntervalInputs", "INTERVALS_ONLY", "KERNELS", "TENSOR_FIELDS"]

#: The interval op's kernels, by name. Their index is what the forward op returns and its backward
#: reads, so a call's backward runs the kernel its forward ran (:mod:`.interval_op`).
#:  native   attnkit's C++ CPU kernel (float32; bf16/fp16 computed in float32)
#:  blocks   PyTorch's kernels block by block over the block plan
#:  dense    PyTorch's fused kernel over every key with the mask as a tensor (``"auto"`` only)
#:  triton   attnkit's Triton kernel (CUDA; on CPU tensors through Triton's interpreter)
#:  flex     PyTorch's FlexAttention on a block mask built from the intervals (:mod:`.flex`); it has
#:           its own autograd, so the tiled backend calls it directly, never through the op
KERNELS = ("native", "blocks", "dense", "triton", "flex")
#: The kernels that read only the intervals: none of them applies a dense mask (``bias``).
INTERVALS_ONLY = ("native", "triton", "flex")


@dataclass(frozen=True, eq=False)
class IntervalInputs:
    """One call of the interval op, in its layout.

    ``query [N, H, Lq, D]``, ``key [N, Hkv, Lk, D]``, ``value [N, Hkv, Lk, Dv]`` (``H % Hkv == 0``);
    ``lo, hi [S, R, Lq]`` int64 (row ``i`` of sequence ``n`` attends ``lo[s, r, i] <= j < hi[s, r, i]``,
    ``s = n`` or 0 when S = 1); an additive ``bias`` broadcastable to ``[N, H, Lq, Lk]`` as ``[Nm, Hm,
    Lq, Lk]``; ``alibi_slopes [H]`` or ``[N, H]``; ``sinks [H]``; ``seed`` an int64 scalar or ``[seed,
    h0, i0, j0]`` (:func:`.dropout.at_positions`). ``causal_only``: the rows are plain causal (the fused
    kernel applies that itself). ``sparse_only``: the dense kernel is left out (an explicit
    ``backend="tiled"``). ``kernel``: one of :data:`KERNELS` to run, or ``""`` for
    :func:`.policy.kernel_for` to choose from the row bounds. ``keep_residual``: a backward will
    follow, so a half-precision CPU output comes with its residual (:mod:`.interval_op`); set by
    :func:`.interval_op.run` where an input requires a gradient.

    The same record holds the vmap rules' ``in_dims`` (one entry per field)."""

    query: Any
    key: Any
    value: Any
    lo: Any
    hi: Any
    bias: Any = None
    alibi_slopes: Any = None
    sinks: Any = None
    scale: Any = 1.0
    softcap: Any = None
    dropout: Any = 0.0
    seed: Any = None
    causal_only: Any = False
    sparse_only: Any = True
    kernel: Any = ""
    keep_residual: Any = False

    def as_tuple(self) -> tuple:
        """The op's positional inputs."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def replace(self, **changes: Any) -> IntervalInputs:
        return dataclasses.replace(self, **changes)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def tensors(self) -> tuple[Tensor | None, ...]:
        """The :data:`TENSOR_FIELDS`, in that order."""
        return tuple(getattr(self, name) for name in TENSOR_FIELDS)


#: The fields that hold tensors (or None): what the op's autograd saves through save_for_backward.
TENSOR_FIELDS = ("query", "key", "value", "lo", "hi", "bias", "alibi_slopes", "sinks", "seed")
