"""What the report and the image exports draw: one sentence's attention, every layer and head.

The renderer knows nothing about models. Whatever produced the weights (a real model, a trace,
a direct call of :func:`attnkit.attention`) hands over an :class:`attnkit.viz.AttentionRecord` per sentence.
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

    Raises:
        TypeError: ``attentions`` is not a floating ``torch.Tensor``.
        ValueError: ``attentions`` is not ``[layers, heads, T, T]`` with ``T = len(tokens)``
            (and at least one of each), holds values outside ``[0, 1]`` or a row that sums
            to neither 1 nor 0 (raw scores, or the wrong axis); ``layer_names`` is not one
            per layer.

    Example:

        >>> import attnkit
        >>> from attnkit import toy
        >>> from attnkit.viz import AttentionRecord
        >>> x = toy.embeddings()                                  # [6, 3]
        >>> _, weights = attnkit.attention(x, x, x, scale=1.0, return_weights=True)
        >>> record = AttentionRecord("Your journey starts with one step", toy.TOKENS,
        ...                          weights[None, None], model="toy")   # [1, 1, 6, 6]
        >>> record.tokens[:3], record.layer_names
        (['Your', 'journey', 'starts'], ['layer 0'])
        >>> AttentionRecord("keys as rows", toy.TOKENS, weights.T[None, None])   # the wrong axis
        Traceback (most recent call last):
            ...
        ValueError: attentions: row (layer 0, head 0, query 0) sums to 0.92..., expected 1
        (or 0 for a fully masked row); rows are queries, columns keys
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
        """The number of layers, ``attentions.shape[0]``.

        Example:

            >>> import torch
            >>> from attnkit.viz import AttentionRecord
            >>> uniform = torch.full((4, 2, 3, 3), 1 / 3)         # [layers, heads, T, T]
            >>> AttentionRecord("the cat sat", ["the", "cat", "sat"], uniform).num_layers
            4
        """
        return self.attentions.shape[0]

    @property
    def num_heads(self) -> int:
        """The number of heads per layer, ``attentions.shape[1]``.

        Example:

            >>> import torch
            >>> from attnkit.viz import AttentionRecord
            >>> uniform = torch.full((4, 2, 3, 3), 1 / 3)         # [layers, heads, T, T]
            >>> AttentionRecord("the cat sat", ["the", "cat", "sat"], uniform).num_heads
            2
        """
        return self.attentions.shape[1]

    @property
    def num_tokens(self) -> int:
        """The number of tokens ``T`` (``len(tokens)``, ``attentions.shape[2]``).

        Example:

            >>> import torch
            >>> from attnkit.viz import AttentionRecord
            >>> uniform = torch.full((4, 2, 3, 3), 1 / 3)         # [layers, heads, T, T]
            >>> AttentionRecord("the cat sat", ["the", "cat", "sat"], uniform).num_tokens
            3
        """
        return self.attentions.shape[2]

    def head(self, layer: int, head: int) -> Tensor:
        """The ``[T, T]`` weights of one head, with a clear error for an index out of range.

        Args:
            layer: ``0 <= layer < num_layers``.
            head: ``0 <= head < num_heads``.

        Returns:
            ``attentions[layer, head]``, ``[T, T]`` float32, a view (queries are rows, keys
            columns).

        Raises:
            ValueError: ``layer`` or ``head`` is out of range (negative indices included).

        Example:

            >>> import torch
            >>> from attnkit import masks
            >>> from attnkit.viz import AttentionRecord
            >>> causal = masks.causal_mask(3).float()             # [T, T]
            >>> weights = causal / causal.sum(-1, keepdim=True)   # each query: itself and before
            >>> record = AttentionRecord("the cat sat", ["the", "cat", "sat"], weights[None, None])
            >>> record.head(0, 0)
            tensor([[1.0000, 0.0000, 0.0000],
                    [0.5000, 0.5000, 0.0000],
                    [0.3333, 0.3333, 0.3333]])
            >>> record.head(0, 1)
            Traceback (most recent call last):
                ...
            ValueError: head: got 1, expected 0 <= head < 1
        """
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

        model: the name shown in the report, for every record.
        layer_names: one label per layer, for every record (see
            :class:`attnkit.viz.AttentionRecord`).

    Each record keeps the ``[T_b, T_b]`` block of real tokens. Padded keys must have received
    exactly zero weight from the real queries (else the padding was not masked, or was not on
    the right), so that dropping them loses nothing.

    Returns:
        ``B`` :class:`attnkit.viz.AttentionRecord` objects, in order, with
        ``attentions [layers, H, T_b, T_b]``.

    Raises:
        ValueError: ``texts``, ``tokens`` and the batch dim disagree, no layers are given, a
            sentence has more than ``T`` tokens or gives weight to its padded keys; or a record
            is invalid (see :class:`attnkit.viz.AttentionRecord`).

    Example:

        A batch of two sentences, the second padded from 2 to 3 tokens and its padding masked:

        >>> import torch
        >>> import attnkit
        >>> from attnkit import masks
        >>> from attnkit.viz import records_from_batch
        >>> x = torch.ones(2, 2, 3, 4)                            # [B, H, T, D]
        >>> keep = masks.padding_mask(torch.tensor([3, 2]))       # [B, 1, 1, T]
        >>> _, weights = attnkit.attention(x, x, x, mask=keep, return_weights=True)
        >>> weights[1, 0]                                         # [T, T]: padded key 2 has 0
        tensor([[0.5000, 0.5000, 0.0000],
                [0.5000, 0.5000, 0.0000],
                [0.5000, 0.5000, 0.0000]])
        >>> records = records_from_batch(["the cat sat", "a dog"], [["the", "cat", "sat"], ["a", "dog"]],
        ...                              [weights, weights])      # the same weights as two layers
        >>> [tuple(r.attentions.shape) for r in records]          # [layers, H, T_b, T_b]
        [(2, 2, 3, 3), (2, 2, 2, 2)]
        >>> records_from_batch(["the cat sat", "a"], [["the", "cat", "sat"], ["a"]], [weights])
        Traceback (most recent call last):
            ...
        ValueError: attentions: sentence 1 gives non-zero weight to padded keys (positions >= 1)
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
