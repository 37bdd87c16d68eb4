"""Which GPU engines this process can run: FlexAttention (PyTorch's, compiled through Triton) and
attnkit's own Triton kernel (:mod:`.triton`). Both need the ``triton`` package; neither is a
dependency of attnkit's core, so the policy asks here before it routes a call to one."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

__all__ = ["GpuEngines", "flex_supports", "triton_supports"]


@dataclass(frozen=True)
class GpuEngines:
    """``flex``: FlexAttention can be compiled here; ``triton``: attnkit's Triton kernel can run."""

    flex: bool
    triton: bool

    @staticmethod
    @cache
    def find() -> GpuEngines:
        has_triton = importlib.util.find_spec("triton") is not None
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
            has_flex = has_triton
        except ImportError:
            has_flex = False
        return GpuEngines(flex=has_flex, triton=has_triton)


def flex_supports(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """FlexAttention's compiled kernels take these inputs: one floating dtype of the three it
    compiles, and head sizes that are powers of two from 16 (its Triton templates' tiles)."""
    dims = (query.shape[-1], value.shape[-1])
    return (query.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and query.dtype == key.dtype == value.dtype
            and all(d >= 16 and d & (d - 1) == 0 for d in dims))


def triton_supports(query: Tensor) -> bool:
    """attnkit's Triton kernel takes half precision and float32 (its products accumulate in float32)."""
    return query.dtype in (torch.float16, torch.bfloat16, torch.float32)
