"""Attention weights as people hold them, turned into the renderer's records.

The notebook views accept what attnkit and Hugging Face ``transformers`` hand out, without
reshaping by the user:

- one tensor: ``[T, T]`` (one head), ``[heads, T, T]`` (one layer) or ``[layers, heads, T, T]``
  (attnkit's record layout);
- a sequence of per-layer tensors, ``[heads, T, T]`` or ``[batch, heads, T, T]``: transformers'
  ``output_attentions`` and attnkit's ``TextEncoder.encode(..., need_weights=True).attentions``;
- an object with an ``attentions`` attribute holding either (a transformers model output, an
  attnkit ``Encoded``); its ``tokens`` are used when the call gives none;
- :class:`attnkit.viz.AttentionRecord` objects, as they are.

Every mistake is a ``TypeError`` / ``ValueError`` that names the argument and the shapes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .record import AttentionRecord, records_from_batch

_FORMS = ("a tensor [T, T], [heads, T, T] or [layers, heads, T, T], or a sequence of per-layer "
          "[heads, T, T] / [batch, heads, T, T] tensors (transformers' output_attentions)")


def to_records(attentions: object, tokens: object = None, *, text: str | Sequence[str] | None = None,
               model: str = "") -> list[AttentionRecord]:
    """One :class:`attnkit.viz.AttentionRecord` per sentence of ``attentions`` (see the module
    docstring).

    ``tokens`` is one list of ``T`` strings, or one list per sentence of a batch (sentence ``b``
    may be shorter than ``T``: its padded keys must have zero weight, as
    :func:`attnkit.viz.records_from_batch` checks). ``text`` is shown above the drawing: one str,
    or one per sentence of a batch. ``model`` is the name each record carries.

    Returns:
        A list of ``B`` records (one for an unbatched input), each ``[layers, heads, T_b, T_b]``.

    Raises:
        TypeError: ``attentions`` is of no accepted form or not floating, ``tokens`` is missing
            (and not carried by ``attentions``) or not lists of str, ``text`` is not str.
        ValueError: the shapes disagree (non-square weights, per-layer shapes that differ, a
            token count other than ``T``, a batch without one token list per sentence), a holder
            without weights, tokens given with records, or invalid weights (see
            :class:`attnkit.viz.AttentionRecord`).

    Example:

        >>> import torch
        >>> from attnkit.viz.inputs import to_records
        >>> tokens = ["the", "cat", "sat"]
        >>> [r.attentions.shape for r in to_records(torch.full((3, 3), 1 / 3), tokens)]     # [T, T]
        [torch.Size([1, 1, 3, 3])]
        >>> per_layer = [torch.full((2, 4, 3, 3), 1 / 3)] * 6    # 6 x [batch, heads, T, T]
        >>> records = to_records(per_layer, [tokens, ["a", "dog", "ran"]], text=["the cat sat", "a dog ran"])
        >>> len(records), records[1].text, records[1].attentions.shape
        (2, 'a dog ran', torch.Size([6, 4, 3, 3]))
        >>> to_records(torch.full((3, 3), 1 / 3), ["the", "cat"])
        Traceback (most recent call last):
            ...
        ValueError: tokens: got 2 tokens, expected T = 3, the size of the weights' last two dims
    """
    if text is not None and not isinstance(text, str) and not (
            isinstance(text, Sequence) and all(isinstance(t, str) for t in text)):
        raise TypeError(f"text must be a str or a sequence of str, got {type(text).__name__}")
    if isinstance(attentions, AttentionRecord) or _is_record_list(attentions):
        if tokens is not None:
            raise ValueError("tokens: AttentionRecord objects carry their own tokens; pass tokens=None")
        return [attentions] if isinstance(attentions, AttentionRecord) else list(attentions)
    if hasattr(attentions, "attentions") and not isinstance(attentions, (Tensor, Sequence)):
        holder = attentions
        attentions = holder.attentions
        if attentions is None:
            raise ValueError(f"attentions: this {type(holder).__name__} holds no weights; ask the model for them "
                             "(attnkit: encode(..., need_weights=True); transformers: output_attentions=True)")
        if tokens is None:
            tokens = getattr(holder, "tokens", None)
    if tokens is None:
        raise TypeError("tokens: missing; give the T tokens of the sentence (a list of str), "
                        "or one list per sentence of a batch")
    layers = _as_layers(attentions)  # [layers, batch, heads, T, T]
    batch, length = layers.shape[1], layers.shape[-1]
    token_lists = _token_lists(tokens, batch, length)
    texts = _texts(text, batch)
    if batch == 1 and len(token_lists[0]) == length:
        return [AttentionRecord(texts[0], token_lists[0], layers[:, 0], model=model)]
    return records_from_batch(texts, token_lists, list(layers), model=model)


def _texts(text: str | Sequence[str] | None, batch: int) -> list[str]:
    if text is None or isinstance(text, str):
        return [text or ""] * batch
    if len(text) != batch:
        raise ValueError(f"text: got {len(text)} texts, expected one per sentence of the batch ({batch})")
    return list(text)


def _is_record_list(value: object) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(isinstance(item, AttentionRecord) for item in value))


def _tensor(value: object, name: str) -> Tensor:
    if isinstance(value, Tensor):
        tensor = value
    elif hasattr(value, "__array__") and not isinstance(value, (str, bytes)):
        tensor = torch.as_tensor(value)  # a numpy array (viz already needs numpy)
    else:
        raise TypeError(f"{name}: expected {_FORMS}; got {type(value).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"{name}: expected floating weights, got dtype {tensor.dtype} (shape {tuple(tensor.shape)})")
    return tensor.detach()


def _square(shape: tuple[int, ...], name: str) -> None:
    if shape[-1] != shape[-2]:
        raise ValueError(f"{name}: got shape {shape}, {shape[-2]} queries x {shape[-1]} keys; the views draw "
                         "self-attention, whose last two dims are [T, T] (the same tokens as queries and keys)")


def _as_layers(attentions: object) -> Tensor:
    """``attentions`` as one ``[layers, batch, heads, T, T]`` tensor."""
    if isinstance(attentions, (list, tuple)):
        if not attentions:
            raise ValueError("attentions: got an empty sequence, expected one [batch, heads, T, T] tensor per layer")
        layers = [_tensor(layer, f"attentions[{i}]") for i, layer in enumerate(attentions)]
        first = tuple(layers[0].shape)
        if len(first) not in (3, 4):
            raise ValueError(f"attentions[0]: got shape {first}, expected [heads, T, T] or [batch, heads, T, T] "
                             "per layer")
        for i, layer in enumerate(layers[1:], start=1):
            if tuple(layer.shape) != first:
                raise ValueError(f"attentions[{i}]: got shape {tuple(layer.shape)}, "
                                 f"expected {first} like attentions[0]")
        _square(first, "attentions[0]")
        stacked = torch.stack([layer.to(device="cpu") for layer in layers])
        return stacked if len(first) == 4 else stacked[:, None]
    tensor = _tensor(attentions, "attentions")
    shape = tuple(tensor.shape)
    if tensor.dim() not in (2, 3, 4):
        raise ValueError(f"attentions: got a {tensor.dim()}-D tensor of shape {shape}, expected {_FORMS}")
    _square(shape, "attentions")
    tensor = tensor.to(device="cpu")
    while tensor.dim() < 4:  # [T, T] -> one head; [heads, T, T] -> one layer
        tensor = tensor[None]
    return tensor[:, None]


def _token_list(value: object, name: str) -> list[str]:
    if isinstance(value, str):
        raise TypeError(f"{name}: got a str; expected a list of tokens (e.g. text.split())")
    try:
        items = list(value)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{name}: expected a list of str, got {type(value).__name__}") from None
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise TypeError(f"{name}[{i}]: expected a str, got {type(item).__name__}")
    return items


def _token_lists(tokens: object, batch: int, length: int) -> list[list[str]]:
    nested = (not isinstance(tokens, str) and isinstance(tokens, Sequence) and len(tokens) > 0
              and all(not isinstance(t, str) and isinstance(t, Sequence) for t in tokens))
    if not nested:
        if batch != 1:
            raise ValueError(f"tokens: got one token list for a batch of {batch} sentences; pass one list per "
                             "sentence (attnkit's encode(...).tokens is one)")
        lists = [_token_list(tokens, "tokens")]
    else:
        if len(tokens) != batch:
            raise ValueError(f"tokens: got {len(tokens)} token lists, expected one per sentence of the batch ({batch})")
        lists = [_token_list(t, f"tokens[{b}]") for b, t in enumerate(tokens)]
    for b, toks in enumerate(lists):
        name = "tokens" if not nested else f"tokens[{b}]"
        if batch == 1 and not nested and len(toks) != length:
            raise ValueError(f"{name}: got {len(toks)} tokens, expected T = {length}, the size of the weights' last "
                             "two dims")
        if len(toks) > length or not toks:
            raise ValueError(f"{name}: got {len(toks)} tokens, expected 1 to T = {length} (the weights' last dims)")
    return lists
