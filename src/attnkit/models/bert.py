"""A BERT-family encoder built from attnkit's layers.

Embeddings (word + position + token type, LayerNorm), then N blocks of
``x = LayerNorm(x + MultiHeadAttention(x))`` and ``x = LayerNorm(x + FFN(x))``: the post-norm
layout of BERT and MiniLM. Every attention call goes through
:class:`attnkit.nn.MultiHeadAttention`, hence through :func:`attnkit.attention`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn import MultiHeadAttention, _checks
from .checkpoint import read_json

# Hugging Face's names for the activations we support: "gelu" is the exact (erf) GELU.
_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


@dataclass(frozen=True)
class BertConfig:
    """The subset of a Hugging Face ``config.json`` that a BERT encoder needs.

    The fields keep Hugging Face's names and defaults. The constructor takes the values as given;
    :meth:`attnkit.models.BertConfig.from_dict` and :meth:`attnkit.models.BertConfig.from_file`
    check them (type and range) and raise ``ValueError`` for a damaged file.

    Example:

    >>> from attnkit.models import BertConfig
    >>> config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                     intermediate_size=64, max_position_embeddings=16)
    >>> config.hidden_act, config.type_vocab_size, config.pad_token_id
    ('gelu', 2, 0)
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    pad_token_id: int = 0

    @classmethod
    def from_dict(cls, raw: dict, *, source: str = "config") -> "BertConfig":
        """Build from a parsed ``config.json``, checking every key it uses (type and range);
        errors name ``source`` (the file) and the key. Keys attnkit does not use are ignored.

        Args:
            raw: the parsed JSON object (a ``dict``).
            source: what the errors call it, usually the file's path.

        Returns:
            The :class:`attnkit.models.BertConfig`.

        Raises:
            ValueError: ``raw`` is not a dict, is no absolute-position BERT (``model_type``,
                ``position_embedding_type``), lacks a required key, holds a value of the wrong
                type or range, or ``hidden_size`` is not divisible by ``num_attention_heads``.

        Example:

        >>> from attnkit.models import BertConfig
        >>> raw = {"model_type": "bert", "architectures": ["BertModel"], "vocab_size": 100,
        ...        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        ...        "intermediate_size": 64, "max_position_embeddings": 16, "hidden_act": "gelu"}
        >>> BertConfig.from_dict(raw).num_hidden_layers
        2
        >>> BertConfig.from_dict({**raw, "hidden_size": 30}, source="my/config.json")
        Traceback (most recent call last):
        ...
        ValueError: my/config.json: hidden_size 30 is not divisible by num_attention_heads 4
        """
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: expected a JSON object of settings, got {type(raw).__name__}")
        for key, expected in (("model_type", "bert"), ("position_embedding_type", "absolute")):
            value = raw.get(key, expected)
            if value != expected:
                raise ValueError(f"{source}: {key} is {value!r}; attnkit loads BERT-family encoders "
                                 f"with {key} {expected!r}")
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in raw and f.default is dataclasses.MISSING]
        if missing:
            raise ValueError(f"{source}: missing required key(s) {missing}")
        values = {name: _checked(source, name, raw[name]) for name in _RULES if name in raw}
        config = cls(**values)
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(f"{source}: hidden_size {config.hidden_size} is not divisible by "
                             f"num_attention_heads {config.num_attention_heads}")
        if config.pad_token_id >= config.vocab_size:
            raise ValueError(f"{source}: pad_token_id {config.pad_token_id} is not a token id "
                             f"(vocab_size is {config.vocab_size})")
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> "BertConfig":
        """Read and check the ``config.json`` at ``path`` (see
        :meth:`attnkit.models.BertConfig.from_dict`); errors name the file.

        Raises:
            ValueError: the file is unreadable, not UTF-8 JSON, not a JSON object, or fails a
                check of :meth:`attnkit.models.BertConfig.from_dict`.

        Example:

        >>> import json
        >>> from attnkit.models import BertConfig
        >>> with open("config.json", "w") as file:
        ...     json.dump({"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2,
        ...                "num_attention_heads": 4, "intermediate_size": 64,
        ...                "max_position_embeddings": 16}, file)
        >>> BertConfig.from_file("config.json").vocab_size
        100
        >>> BertConfig.from_file("missing.json")
        Traceback (most recent call last):
        ...
        ValueError: missing.json: not valid JSON (...)
        """
        return cls.from_dict(read_json(Path(path)), source=str(path))


#: The largest size (or token id) config.json may give: far above any real model's.
MAX_SIZE = 2**31 - 1

# What each key of config.json must be: ("int", minimum), ("probability", None), ("positive", None)
# (a finite float > 0) or ("activation", None).
_RULES: dict[str, tuple[str, int | None]] = {
    "vocab_size": ("int", 1),
    "hidden_size": ("int", 1),
    "num_hidden_layers": ("int", 1),
    "num_attention_heads": ("int", 1),
    "intermediate_size": ("int", 1),
    "max_position_embeddings": ("int", 1),
    "type_vocab_size": ("int", 1),
    "pad_token_id": ("int", 0),
    "layer_norm_eps": ("positive", None),
    "hidden_dropout_prob": ("probability", None),
    "attention_probs_dropout_prob": ("probability", None),
    "hidden_act": ("activation", None),
}


def _checked(source: str, key: str, value: object) -> object:
    """``value`` of ``config.json``'s ``key`` if it obeys the key's rule, else a ValueError naming both."""
    kind, minimum = _RULES[key]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "int":
        # bounded above too: torch cannot even describe a tensor with a dimension of 2**63
        if isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= MAX_SIZE:  # type: ignore[operator]
            return value
        too_large = isinstance(value, int) and not isinstance(value, bool) and value > MAX_SIZE
        expected = f"an integer <= {MAX_SIZE}" if too_large else f"an integer >= {minimum}"
    elif kind == "positive":
        if number and math.isfinite(value) and value > 0:  # type: ignore[arg-type, operator]
            return float(value)  # type: ignore[arg-type]
        expected = "a finite number > 0"
    elif kind == "probability":
        if number and 0 <= value < 1:  # type: ignore[operator]
            return float(value)  # type: ignore[arg-type]
        expected = "a probability in [0, 1)"
    else:
        if isinstance(value, str) and value in _ACTIVATIONS:
            return value
        raise ValueError(f"{source}: hidden_act {value!r} is not supported; expected one of {sorted(_ACTIVATIONS)}")
    raise ValueError(f"{source}: {key} must be {expected}, got {value!r} ({type(value).__name__})")


class BertEmbeddings(nn.Module):
    """Token ids -> vectors: word + absolute position + token type, then LayerNorm (and dropout
    in training mode).

    Built from a :class:`attnkit.models.BertConfig`; the word embedding's ``pad_token_id`` row
    gets no gradient.

    Example:

    >>> import torch
    >>> from attnkit.models import BertConfig, BertEmbeddings
    >>> config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
    ...                     intermediate_size=64, max_position_embeddings=16)
    >>> embeddings = BertEmbeddings(config).eval()
    >>> embeddings(torch.tensor([[5, 6, 7]])).shape
    torch.Size([1, 3, 32])
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """``input_ids [B, T]`` -> ``[B, T, E]``. Token type 0 is added when none is given, as
        the checkpoint was trained with it (leaving it out shifts every vector).

        Args:
            input_ids: ``[B, T]`` integer token ids.
            token_type_ids: ``[B, T]`` segment ids, or None for all zeros.

        Returns:
            ``[B, T, E]`` vectors (``E`` = ``hidden_size``).

        Raises:
            ValueError: ``T`` is more than ``max_position_embeddings``.

        Example:

        >>> import torch
        >>> from attnkit.models import BertConfig, BertEmbeddings
        >>> config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        ...                     intermediate_size=64, max_position_embeddings=16)
        >>> embeddings = BertEmbeddings(config).eval()
        >>> ids = torch.tensor([[5, 6, 7]])
        >>> torch.equal(embeddings(ids), embeddings(ids, torch.zeros_like(ids)))
        True
        >>> embeddings(torch.zeros(1, 17, dtype=torch.long))
        Traceback (most recent call last):
        ...
        ValueError: input_ids has 17 tokens; this model has 16 positions
        """
        if input_ids.shape[1] > self.position.num_embeddings:
            raise ValueError(f"input_ids has {input_ids.shape[1]} tokens; this model has "
                             f"{self.position.num_embeddings} positions")
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.word(input_ids) + self.position(positions) + self.token_type(token_type_ids)
        return self.dropout(self.norm(x))


class BertLayer(nn.Module):
    """Post-norm transformer block: attention and feed-forward, each with residual + LayerNorm.

    The attention is a :class:`attnkit.nn.MultiHeadAttention` running on ``backend`` (one of
    :func:`attnkit.backends`); the feed-forward uses the config's ``hidden_act`` GELU.

    Example:

    >>> import torch
    >>> from attnkit.models import BertConfig, BertLayer
    >>> config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
    ...                     intermediate_size=64, max_position_embeddings=16)
    >>> layer = BertLayer(config).eval()
    >>> out, weights = layer(torch.randn(2, 5, 32), None)
    >>> out.shape, weights
    (torch.Size([2, 5, 32]), None)
    """

    def __init__(self, config: BertConfig, *, backend: str = "auto") -> None:
        super().__init__()
        hidden = config.hidden_size
        self.attention = MultiHeadAttention(hidden, config.num_attention_heads,
                                            dropout=config.attention_probs_dropout_prob, backend=backend)
        self.attention_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(hidden, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.gelu_approximate = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: Tensor, mask: Tensor | None, *, need_weights: bool = False,
                causal: bool = False) -> tuple[Tensor, Tensor | None]:
        """``x [B, T, E]``, ``mask`` broadcastable to ``[B, H, T, T]`` (True = may attend).

        Args:
            x: ``[B, T, E]`` hidden states.
            mask: a boolean mask broadcastable to ``[B, H, T, T]`` (True = may attend), e.g. a
                key-padding mask ``[B, 1, 1, T]``, or None.
            need_weights: also return the attention weights.
            causal: add a causal mask (BERT was trained without one).

        Returns:
            ``(x [B, T, E], weights)``: ``weights`` is ``[B, H, T, T]`` with ``need_weights``,
            else None.

        Raises:
            ValueError: ``mask`` does not broadcast to ``[B, H, T, T]`` (raised by
                :func:`attnkit.attention`).

        Example:

        >>> import torch
        >>> from attnkit.models import BertConfig, BertLayer
        >>> config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        ...                     intermediate_size=64, max_position_embeddings=16)
        >>> layer = BertLayer(config).eval()
        >>> keys = torch.tensor([[True, True, True, False, False]])[:, None, None, :]  # [B, 1, 1, T]
        >>> out, weights = layer(torch.randn(1, 5, 32), keys, need_weights=True)
        >>> out.shape, weights.shape
        (torch.Size([1, 5, 32]), torch.Size([1, 4, 5, 5]))
        >>> bool((weights[..., 3:] == 0).all())  # padded keys get no weight
        True
        """
        weights = None
        if need_weights:
            attended, weights = self.attention(x, mask=mask, causal=causal, need_weights=True)
        else:
            attended = self.attention(x, mask=mask, causal=causal)
        x = self.attention_norm(x + self.dropout(attended))
        hidden = F.gelu(self.intermediate(x), approximate=self.gelu_approximate)
        x = self.output_norm(x + self.dropout(self.output(hidden)))
        return x, weights


class BertEncoder(nn.Module):
    """Embeddings and a stack of :class:`attnkit.models.BertLayer`; returns hidden states and, if
    asked, weights.

    Built from a :class:`attnkit.models.BertConfig`, every attention on ``backend`` (see
    :func:`attnkit.backends`). :func:`attnkit.models.load` builds one from a checkpoint.

    Example:

    >>> import torch
    >>> from attnkit.models import BertConfig, BertEncoder
    >>> config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                     intermediate_size=64, max_position_embeddings=16)
    >>> encoder = BertEncoder(config).eval()
    >>> hidden, weights = encoder(torch.tensor([[5, 6, 7, 8]]))
    >>> hidden.shape, weights
    (torch.Size([1, 4, 32]), None)
    """

    def __init__(self, config: BertConfig, *, backend: str = "auto") -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config, backend=backend) for _ in range(config.num_hidden_layers))

    def set_backend(self, backend: str) -> None:
        """Run every attention call of the model on ``backend`` (see :func:`attnkit.backends`);
        an unknown name is refused and changes nothing.

        Raises:
            ValueError: ``backend`` is not a registered backend.

        Example:

        >>> import torch
        >>> from attnkit.models import BertConfig, BertEncoder
        >>> config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...                     intermediate_size=64, max_position_embeddings=16)
        >>> encoder = BertEncoder(config).eval()
        >>> ids = torch.tensor([[5, 6, 7, 8]])
        >>> before = encoder(ids)[0]
        >>> encoder.set_backend("reference")
        >>> torch.allclose(encoder(ids)[0], before, atol=1e-5)
        True
        >>> encoder.set_backend("nope")
        Traceback (most recent call last):
        ...
        ValueError: unknown backend 'nope'; available: (...)
        """
        backend = _checks.backend_name(backend)
        for layer in self.layers:
            layer.attention.backend = backend

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        need_weights: bool = False,
        causal: bool = False,
    ) -> tuple[Tensor, tuple[Tensor, ...] | None]:
        """``input_ids [B, T]``, ``attention_mask [B, T]`` (1/True on real tokens, 0 on padding).

        ``causal`` adds a causal mask in every layer: BERT was trained without one, so this only
        serves to show the mechanism on a real model.

        Returns ``hidden_states [B, T, E]`` and, with ``need_weights``, one ``[B, H, T, T]``
        weight tensor per layer (padded keys get exactly zero weight); without, None.

        Args:
            input_ids: ``[B, T]`` integer token ids.
            attention_mask: ``[B, T]``, 1/True on real tokens and 0 on padding, or None.
            token_type_ids: ``[B, T]`` segment ids, or None for all zeros.
            need_weights: also return every layer's attention weights.
            causal: add a causal mask in every layer.

        Raises:
            ValueError: ``attention_mask``'s shape differs from ``input_ids``', or ``T`` is more
                than ``max_position_embeddings``.

        Example:

        >>> import torch
        >>> from attnkit.models import BertConfig, BertEncoder
        >>> config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...                     intermediate_size=64, max_position_embeddings=16)
        >>> encoder = BertEncoder(config).eval()
        >>> ids = torch.tensor([[5, 6, 7, 8], [5, 6, 0, 0]])
        >>> real = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
        >>> hidden, weights = encoder(ids, real, need_weights=True)
        >>> hidden.shape, len(weights), weights[0].shape
        (torch.Size([2, 4, 32]), 2, torch.Size([2, 4, 4, 4]))
        >>> bool((weights[1][1, :, :, 2:] == 0).all())  # the second text's padding
        True
        """
        key_mask = None
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask must match input_ids {tuple(input_ids.shape)}, "
                                 f"got {tuple(attention_mask.shape)}")
            key_mask = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, T]: True = real key
        x = self.embeddings(input_ids, token_type_ids)
        all_weights = []
        for layer in self.layers:
            x, weights = layer(x, key_mask, need_weights=need_weights, causal=causal)
            all_weights.append(weights)
        return x, (tuple(all_weights) if need_weights else None)
