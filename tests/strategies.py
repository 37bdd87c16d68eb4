"""Hypothesis strategies for attention calls: shapes, GQA, masks of every kind and layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch import Tensor


@dataclass
class Case:
    query: Tensor
    key: Tensor
    value: Tensor
    mask: Tensor | None
    causal: bool
    scale: float | None

    def kwargs(self) -> dict:
        return dict(mask=self.mask, causal=self.causal, scale=self.scale)

    def to(self, dtype: torch.dtype) -> "Case":
        mask = self.mask if self.mask is None or self.mask.dtype == torch.bool else self.mask.to(dtype)
        return Case(self.query.to(dtype), self.key.to(dtype), self.value.to(dtype), mask, self.causal, self.scale)


@st.composite
def cases(draw, *, max_len: int = 9, max_dim: int = 8, ranks=(2, 3, 4), gqa: bool = True) -> Case:
    rank = draw(st.sampled_from(ranks))
    lq = draw(st.integers(1, max_len))
    lk = draw(st.integers(1, max_len))
    dk = draw(st.integers(1, max_dim))
    dv = draw(st.integers(1, max_dim))
    if rank == 2:
        q_lead: tuple[int, ...] = ()
        kv_lead: tuple[int, ...] = ()
    elif rank == 3:
        q_lead = kv_lead = (draw(st.integers(1, 3)),)
    else:
        batch = draw(st.integers(1, 2))
        heads = draw(st.sampled_from([1, 2, 4, 6]))
        kv_heads = draw(st.sampled_from([h for h in range(1, heads + 1) if heads % h == 0])) if gqa else heads
        q_lead, kv_lead = (batch, heads), (batch, kv_heads)

    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    query = torch.randn(*q_lead, lq, dk, generator=g)
    key = torch.randn(*kv_lead, lk, dk, generator=g)
    value = torch.randn(*kv_lead, lk, dv, generator=g)

    scores_shape = (*q_lead, lq, lk)
    kind = draw(st.sampled_from(["none", "bool", "float", "float_inf"]))
    mask = None
    if kind != "none":
        dropped = draw(st.integers(0, len(scores_shape) - 2))
        shape = [1 if draw(st.booleans()) else n for n in scores_shape[dropped:]]
        if kind == "bool":
            keep = draw(st.sampled_from([0.3, 0.7, 1.0]))
            mask = torch.rand(*shape, generator=g) < keep
        elif kind == "float":
            mask = torch.randn(*shape, generator=g)
        else:
            mask = torch.randn(*shape, generator=g).masked_fill(torch.rand(*shape, generator=g) < 0.4, float("-inf"))
    causal = draw(st.booleans())
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    return Case(query, key, value, mask, causal, scale)
