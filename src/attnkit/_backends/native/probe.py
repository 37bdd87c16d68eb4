"""``python -m attnkit._backends.native.probe LIBRARY``: load a built kernel in this (throwaway)
process and check it: the ops it registers have the expected schemas, and a small forward and
backward agree with a float64 computation. Exit status 0 when it works; a crash or a wrong answer
stays in this process (see :mod:`.building`)."""

from __future__ import annotations

import sys

import torch

from .ops import EXPECTED_SCHEMAS, registered_schemas


def _reference(q, k, v, lo, hi, scale):
    keys = torch.arange(k.shape[2])
    allowed = (keys >= lo[..., None]) & (keys < hi[..., None])
    scores = (q.double() @ k.double().transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ v.double(), torch.logsumexp(scores, -1)


def main(path: str) -> int:
    torch.ops.load_library(path)
    if registered_schemas() != EXPECTED_SCHEMAS:
        print(f"unexpected ops: {registered_schemas()}", file=sys.stderr)
        return 1
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=g, requires_grad=True) for _ in range(3))
    lo = torch.tensor([[0, 0, 1, 2, 3, 4, 5, 6, 7]])
    hi = lo + 2
    out, lse = torch.ops.attnkit_native.interval_forward(q, k, v, lo, hi, 0.5, 4, 3, 0.0, 0, 0.0, None, 0, 0, 0, False)[:2]
    expected_out, expected_lse = _reference(q, k, v, lo, hi, 0.5)
    grad_out = torch.randn(out.shape, generator=g)
    grads = torch.ops.attnkit_native.interval_backward(grad_out, q, k, v, out, lse, None, lo, hi, 0.5, 4, 3, 1, 0.0, 0,
                                                       0.0, None, 0, 0, 0, None, False)
    expected_grads = torch.autograd.grad(expected_out, (q, k, v), grad_out.double())
    results = [(out, expected_out), (lse, expected_lse), *zip(grads, expected_grads)]
    if not all(torch.allclose(got.double(), want.double(), atol=1e-4, rtol=1e-4) for got, want in results):
        print("the kernel's results differ from the float64 formula", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
