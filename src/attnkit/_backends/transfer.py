"""Host-to-device copies that do not stall the device's queue.

``tensor.to("cuda")`` from ordinary (pageable) host memory waits for the copy, and with it for
every kernel queued before it: one such copy per attention call (its row bounds, a scalar a mask
or score modifier captures) makes the host wait for the GPU at every layer. Staged through pinned
memory the copy is queued like a kernel, and PyTorch's host allocator keeps the pinned buffer
until the copy has run."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["to_device", "device_scalar"]


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """``t`` on ``device``; from the CPU to CUDA without waiting (eager only: a compiled graph
    places its own copies)."""
    device = torch.device(device)
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu" and not torch.compiler.is_compiling():
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def device_scalar(value: float | int, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """A 0-d tensor holding ``value`` on ``device`` (see :func:`to_device`)."""
    return to_device(torch.tensor(value, dtype=dtype), device)
