"""A model's state-dict shapes without allocating or initialising it.

The loaders check a checkpoint's tensors against the shapes its config implies before building the
model for real (a damaged size in config.json must not allocate it), by building it on the meta
device. Initialising meta tensors is no work, but torch 2.13 routes ``normal_`` and ``uniform_`` on
meta through its Python references, whose wrapper imports Dynamo (torch's compiler): 3-5 s added to the
first load of every process (measured on the 2-core CI machine). The random fills are skipped here:
on the meta device they fill nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# torch.nn.init's fills dispatch torch functions themselves (the mode sees them, not the Tensor
# methods they call inside); the methods are for modules that fill tensors directly
_RANDOM_FILLS = frozenset({
    torch.Tensor.normal_, torch.Tensor.uniform_, nn.init.normal_, nn.init.uniform_, nn.init.trunc_normal_,
    nn.init.kaiming_uniform_, nn.init.kaiming_normal_, nn.init.xavier_uniform_, nn.init.xavier_normal_,
})


class _SkipRandomFills(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RANDOM_FILLS:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def meta_state_dict(build: Callable[[], nn.Module]) -> dict[str, torch.Tensor]:
    """``build()``'s state dict with every tensor on the meta device (shapes and dtypes only)."""
    with torch.device("meta"), _SkipRandomFills():
        return build().state_dict()
