"""Second-order gradients through PyTorch's fused SDPA kernels (and FlexAttention's).

SDPA's fused kernels have no derivative of their backward (on the CPU, PyTorch 2.13:
``derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented``),
so ``create_graph=True`` followed by a second backward (a gradient penalty, MAML) failed wherever
``"auto"`` picked SDPA, although the same call on the tiled backend worked. :func:`twice_differentiable`
puts one node after SDPA's output: a first-order backward passes the gradient straight to SDPA's
own backward (the same kernels, the same bits), and a backward that builds a graph
(``torch.is_grad_enabled()`` inside it) computes the gradients instead by autograd through the
reference formula recomputed from the saved inputs, which can be differentiated again (as the
interval op's backward does: ``interval_op._dense_backward``). FlexAttention's backward has no
derivative either: the GPU route's Flex engine takes the same node (``tiled._flex``).

The node returns SDPA's output as a view, not a copy (a copy would be one more output-sized
activation per layer in training), so a result that records a graph may not be changed in place
(``out += x``; PyTorch's error says to clone it). SDPA's fused kernels refuse that already where
they keep their output for the backward, as PyTorch 2.13's CPU kernel does. Calls that record no
graph, and calls under ``torch.compile``, ``torch.jit.trace`` or a ``torch.func`` transform, do
not take the node (nothing to differentiate twice there, a trace that cannot hold a Python
Function, or a transform that differentiates on its own levels).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .._call import records_graph
from .numerics import can_read


class _RecomputedWhenDifferentiatedTwice(torch.autograd.Function):
    """``output`` unchanged (a view of it); its backward as described in the module's docstring.
    ``recompute(query, key, value)`` gives the same output by differentiable plain ops."""

    @staticmethod
    def forward(ctx, output: Tensor, recompute: Callable[..., Tensor], query: Tensor, key: Tensor,
                value: Tensor) -> Tensor:
        ctx.recompute = recompute
        ctx.save_for_backward(query, key, value)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        if not torch.is_grad_enabled():  # first order: SDPA's own backward
            return grad_output, None, None, None, None
        inputs, needs = ctx.saved_tensors, ctx.needs_input_grad[2:]
        wanted = [t for t, needed in zip(inputs, needs) if needed]
        found = iter(torch.autograd.grad(ctx.recompute(*inputs), wanted, grad_output, create_graph=True,
                                         allow_unused=True))
        grads = [(next(found) if needed else None) for needed in needs]
        return None, None, *(torch.zeros_like(t) if needed and g is None else g
                             for t, g, needed in zip(inputs, grads, needs))


def twice_differentiable(output: Tensor, recompute: Callable[[Tensor, Tensor, Tensor], Tensor], query: Tensor,
                         key: Tensor, value: Tensor) -> Tensor:
    """``output`` of a fused kernel on ``query``, ``key``, ``value``, made differentiable twice by
    ``recompute`` (the same attention in plain ops) where it records a graph; else ``output`` itself."""
    if not records_graph(query, key, value) or not can_read(output, query, key, value):
        return output
    if torch.jit.is_tracing():  # a Python Function would enter the traced graph as an opaque call
        return output
    return _RecomputedWhenDifferentiatedTwice.apply(output, recompute, query, key, value)
