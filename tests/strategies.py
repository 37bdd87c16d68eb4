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


# -- structured masks, each with its definition written out independently ----------------------


@dataclass
class MaskCase:
    """A structured mask and, from the definitions in its docstring, the pairs it allows:
    ``allowed(Lq, Lk) -> bool [S, Lq, Lk]`` with S = 1 (same for all sequences) or the batch."""

    mask: object
    allowed: object

    def __and__(self, other: "MaskCase") -> "MaskCase":
        return MaskCase(self.mask & other.mask, lambda lq, lk: self.allowed(lq, lk) & other.allowed(lq, lk))


def _grid(lq: int, lk: int) -> tuple[Tensor, Tensor]:
    """Query positions p = i + Lk - Lq (bottom-right alignment) as a column, keys j as a row."""
    return (torch.arange(lq) + lk - lq)[:, None], torch.arange(lk)[None, :]


def _same_document(ids: Tensor, lq: int, lk: int) -> Tensor:
    """``[S, Lq, Lk]``: query position and key inside the packed sequence ``ids [S, T]`` and equal ids."""
    p, j = _grid(lq, lk)
    length = ids.shape[-1]
    allowed = torch.zeros(ids.shape[0], lq, lk, dtype=torch.bool)
    for i, position in enumerate(p[:, 0].tolist()):
        for key in j[0].tolist():
            if 0 <= position < length and key < length:
                allowed[:, i, key] = ids[:, position] == ids[:, key]
    return allowed


@st.composite
def mask_cases(draw, *, batch: int, max_len: int = 24) -> MaskCase:
    """One structured mask (any kind, per-sequence ones with ``batch`` sequences), or two intersected."""
    from attnkit import masks

    def one() -> MaskCase:
        kind = draw(st.sampled_from(["causal", "window", "symmetric", "lengths", "ids", "prefix", "prefixes",
                                     "padding"]))
        if kind == "causal":
            return MaskCase(masks.causal(), lambda lq, lk: (lambda p, j: (j <= p)[None])(*_grid(lq, lk)))
        if kind in ("window", "symmetric"):
            size = draw(st.integers(1, max_len))
            if kind == "window":
                rule = lambda p, j: ((j > p - size) & (j <= p))[None]  # noqa: E731
            else:
                rule = lambda p, j: ((j - p).abs() < size)[None]  # noqa: E731
            return MaskCase(masks.sliding_window(size, causal=kind == "window"), lambda lq, lk: rule(*_grid(lq, lk)))
        if kind in ("lengths", "ids"):
            if kind == "lengths":
                lengths = draw(st.lists(st.integers(0, max_len // 2), min_size=1, max_size=4))
                ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
                mask = masks.document(lengths)
            else:
                total = draw(st.integers(0, max_len))
                rows = []
                for _ in range(batch):
                    cuts = sorted(draw(st.lists(st.integers(1, max(total - 1, 1)), max_size=3)))
                    row = torch.zeros(total, dtype=torch.int64)
                    for c in cuts:
                        row[c:] += 1
                    rows.append(row * 7 - 3)  # any labels work, as long as documents are contiguous
                ids = torch.stack(rows)
                mask = masks.document(ids=ids)
            return MaskCase(mask, lambda lq, lk, ids=ids: _same_document(ids, lq, lk))
        if kind in ("prefix", "prefixes"):
            if kind == "prefix":
                prefix = torch.tensor([draw(st.integers(0, max_len))])
                mask = masks.prefix_lm(int(prefix))
            else:
                prefix = torch.tensor(draw(st.lists(st.integers(0, max_len), min_size=batch, max_size=batch)))
                mask = masks.prefix_lm(prefix)
            return MaskCase(mask, lambda lq, lk: (lambda p, j: (j < prefix[:, None, None]) | (j <= p))(*_grid(lq, lk)))
        lengths = torch.tensor(draw(st.lists(st.integers(0, max_len), min_size=batch, max_size=batch)))
        return MaskCase(masks.padding(lengths),
                        lambda lq, lk: (_grid(lq, lk)[1] < lengths[:, None, None]).expand(-1, lq, -1))

    case = one()
    return case & one() if draw(st.booleans()) else case
