"""A step-by-step walkthrough of attention in the terminal.

It runs :func:`attnkit.attention` under :func:`attnkit.trace.record`, which keeps each named
intermediate, then prints every step with its shape, its values and one line of what
it means, and ends with a plain-language reading of the weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from . import masks, toy, trace
from .core import attention


@dataclass(frozen=True)
class Step:
    """One named intermediate of an attention call."""

    name: str
    tensor: Tensor
    meaning: str
    rows: Sequence[str] | None = None
    cols: Sequence[str] | None = None


def _format_matrix(t: Tensor, rows: Sequence[str] | None, cols: Sequence[str] | None, decimals: int = 4) -> str:
    t = t.detach().cpu()
    if t.dim() == 1:
        t = t[None]
        rows = None
    if t.dtype == torch.bool:
        cells = [["True" if v else "." for v in row] for row in t.tolist()]
    else:
        cells = [[f"{v:.{decimals}f}" for v in row] for row in t.tolist()]
    width = max(len(c) for row in cells for c in row)
    if cols is not None:
        width = max(width, *(len(c) for c in cols))
    label_width = max((len(r) for r in rows), default=0) if rows else 0
    lines = []
    if cols is not None:
        lines.append(" " * (label_width + 2) + " ".join(c.rjust(width) for c in cols))
    for i, row in enumerate(cells):
        label = rows[i].ljust(label_width) + "  " if rows else ""
        lines.append(label + " ".join(c.rjust(width) for c in row))
    return "\n".join(lines)


def toy_steps(*, causal: bool = False, scale: float = 1.0) -> list[Step]:
    """Seed 002's weightless self-attention: the embeddings are queries, keys and values at once."""
    tokens = toy.TOKENS
    inputs = toy.embeddings()
    with trace.record() as recorded:
        attention(inputs, inputs, inputs, causal=causal, scale=scale)
    found = recorded[0].steps

    steps = [
        Step("inputs", inputs, "one embedding per token; here they serve as queries, keys and values", tokens),
        Step("scores", found["scores"], "query . key for every pair: how similar two tokens are", tokens, tokens),
        Step("scaled_scores", found["scaled_scores"],
             f"scores x scale (scale = {scale:g}; the seed's weightless example does not divide by sqrt(d))"
             if scale == 1.0 else f"scores x scale (scale = {scale:g}) keeps the softmax from saturating",
             tokens, tokens),
    ]
    if causal:
        steps.append(Step("mask", masks.causal_mask(len(tokens)),
                          "causal: True where a token may attend (itself and earlier tokens)", tokens, tokens))
        steps.append(Step("masked_scores", found["masked_scores"],
                          "-inf where attention is not allowed, so softmax gives it zero weight", tokens, tokens))
    steps.append(Step("weights", found["weights"],
                      "softmax of each row: the share of attention each token pays to each other, summing to 1",
                      tokens, tokens))
    steps.append(Step("context", found["output"],
                      "weights @ values: each token's attention-weighted average of the value vectors", tokens))
    return steps


def reading(weights: Tensor, tokens: Sequence[str]) -> list[str]:
    """Plain-language reading of a ``[L, L]`` weight matrix: whom each token attends most."""
    lines = []
    for i, token in enumerate(tokens):
        row = weights[i]
        j = int(row.argmax())
        lines.append(f"'{token}' attends most to '{tokens[j]}' ({float(row[j]):.4f})")
    return lines


def render(steps: Sequence[Step]) -> str:
    """The walkthrough as text: each step's name, shape, meaning and values."""
    out = []
    for number, step in enumerate(steps, start=1):
        shape = list(step.tensor.shape)
        out.append(f"Step {number}: {step.name} {shape}")
        out.append(f"  {step.meaning}")
        body = _format_matrix(step.tensor, step.rows, step.cols)
        out.append("\n".join("    " + line for line in body.splitlines()))
        out.append("")
    weights = next(s for s in steps if s.name == "weights")
    out.append("Reading the weights:")
    out.extend("  " + line for line in reading(weights.tensor, weights.rows or []))
    return "\n".join(out)
