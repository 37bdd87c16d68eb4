"""What the report and the image exports draw: one sentence's attention, every layer and head.

The renderer knows nothing about models. Whatever produced the weights (a real model, a trace,
a direct call of :func:`attnkit.attention`) hands over an :class:`AttentionRecord` per sentence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

# A row of weights is a probability distribution (sums to 1) or, when every key was masked,
# all zeros. fp32 softmax rows of 512 keys sum to 1 within ~1e-6; 1e-3 also admits weights
# computed in bf16/fp16 and cast up, while still catching raw scores or a wrong axis.
_ROW_SUM_TOLERANCE = 1e-3


@dataclass(frozen=True)
class AttentionRecord:
    """The attention weights of one sentence, for every layer and head.

    Args:
        text: the sentence as the user wrote it.
        tokens: the ``T`` tokens the model saw (special tokens included), in order.
        attentions: ``[layers, heads, T, T]`` weights; rows are queries, columns keys. Each row
            sums to 1, or is all zeros for a query that could attend to nothing. Stored as a
            detached float32 CPU copy.
        model: a name shown in the report (``"minilm"``, ``"toy"``...).
        layer_names: one label per layer; defaults to ``"layer 0"``, ``"layer 1"``...
    """

    text: str
    tokens: Sequence[str]
    attentions: Tensor
    model: str = ""
    layer_names: Sequence[str] | None = field(default=None)

    def __post_init__(self) -> None:
        tokens = [str(t) for t in self.tokens]
        weights = _check_weights(self.attentions, len(tokens))
        names = self.layer_names
        if names is None:
            names = [f"layer {i}" for i in range(weights.shape[0])]
        elif len(names) != weights.shape[0]:
            raise ValueError(f"layer_names: got {len(names)} names, expected one per layer ({weights.shape[0]})")
        # Frozen dataclass: normalised fields are written once, here.
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "attentions", weights)
        object.__setattr__(self, "layer_names", [str(n) for n in names])

    @property
    def num_layers(self) -> int:
        return self.attentions.shape[0]

    @property
    def num_heads(self) -> int:
        return self.attentions.shape[1]

    @property
    def num_tokens(self) -> int:
        return self.attentions.shape[2]

    def head(self, layer: int, head: int) -> Tensor:
        """The ``[T, T]`` weights of one head, with a clear error for an index out of range."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: got {layer}, expected 0 <= layer < {self.num_layers}")
        if not 0 <= head < self.num_heads:
            raise ValueError(f"head: got {head}, expected 0 <= head < {self.num_heads}")
        return self.attentions[layer, head]


def _check_weights(attentions: object, num_tokens: int) -> Tensor:
    if not isinstance(attentions, Tensor):
        raise TypeError(f"attentions: expected a torch.Tensor [layers, heads, T, T], got {type(attentions).__name__}")
    if not attentions.is_floating_point():
        raise TypeError(f"attentions: expected floating weights, got dtype {attentions.dtype}")
    shape = tuple(attentions.shape)
    if attentions.dim() != 4 or shape[2] != shape[3]:
        raise ValueError(f"attentions: got shape {shape}, expected [layers, heads, T, T]")
    if shape[2] != num_tokens:
        raise ValueError(f"attentions: got T = {shape[2]} (shape {shape}), expected T = len(tokens) = {num_tokens}")
    if 0 in shape:
        raise ValueError(f"attentions: got an empty shape {shape}, expected at least one layer, head and token")
    weights = attentions.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if not torch.isfinite(weights).all() or (weights < 0).any() or (weights > 1 + _ROW_SUM_TOLERANCE).any():
        raise ValueError("attentions: expected finite weights in [0, 1] (softmax probabilities)")
    sums = weights.sum(-1)
    valid = ((sums - 1).abs() <= _ROW_SUM_TOLERANCE) | (sums == 0)
    if not valid.all():
        layer, head, query = (int(i) for i in (~valid).nonzero()[0])
        raise ValueError(
            f"attentions: row (layer {layer}, head {head}, query {query}) sums to "
            f"{float(sums[layer, head, query]):.6f}, expected 1 (or 0 for a fully masked row); "
            "rows are queries, columns keys"
        )
    return weights


def records_from_batch(
    texts: Sequence[str],
    tokens: Sequence[Sequence[str]],
    attentions: Sequence[Tensor],
    *,
    model: str = "",
    layer_names: Sequence[str] | None = None,
) -> list[AttentionRecord]:
    """Split a padded batch into one record per sentence.

    Args:
        texts: ``B`` sentences.
        tokens: ``B`` token lists; sentence ``b`` has ``len(tokens[b]) = T_b`` real tokens,
            followed by padding up to ``T`` (right padding, as BERT tokenizers do).
        attentions: one ``[B, H, T, T]`` tensor per layer (what a model returns per layer).

    Each record keeps the ``[T_b, T_b]`` block of real tokens. Padded keys must have received
    exactly zero weight from the real queries (else the padding was not masked, or was not on
    the right), so that dropping them loses nothing.
    """
    if len(texts) != len(tokens):
        raise ValueError(f"tokens: got {len(tokens)} token lists, expected one per text ({len(texts)})")
    if len(attentions) == 0:
        raise ValueError("attentions: got no layers, expected one [B, H, T, T] tensor per layer")
    stacked = torch.stack([a.detach() for a in attentions], dim=1)  # [B, layers, H, T, T]
    if stacked.dim() != 5 or stacked.shape[0] != len(texts):
        raise ValueError(
            f"attentions: got per-layer shape {tuple(attentions[0].shape)}, expected [B, H, T, T] with B = {len(texts)}"
        )
    records = []
    for b, (text, toks) in enumerate(zip(texts, tokens)):
        n = len(toks)
        if n > stacked.shape[-1]:
            raise ValueError(f"tokens: sentence {b} has {n} tokens, more than the batch length T = {stacked.shape[-1]}")
        if stacked[b, :, :, :n, n:].any():
            raise ValueError(f"attentions: sentence {b} gives non-zero weight to padded keys (positions >= {n})")
        records.append(AttentionRecord(text, toks, stacked[b, :, :, :n, :n], model=model, layer_names=layer_names))
    return records
