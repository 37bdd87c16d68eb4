"""Local Hugging Face checkpoints of other families for ``attnkit show`` and ``attnkit explain``.

attnkit's own loader (:mod:`attnkit.models`) reads BERT-family encoders without transformers. A
directory holding any other model type (GPT-2, Llama, Mistral, Qwen2, Gemma 2, GPT-OSS, T5, ...)
is loaded here with transformers, its attention on ``attn_implementation="attnkit"``, so the
weights shown are the ones :func:`attnkit.attention` applied: decoders with their causal (and
sliding-window) masks, encoder-decoders by their encoder's self-attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .._json import loads_untrusted
from .._optional import require

#: Model types attnkit's own loader reads without transformers.
OWN_MODEL_TYPES = frozenset({"bert"})


def model_type(name_or_path: str | Path) -> str | None:
    """The ``model_type`` in ``config.json`` of a directory, or None (not a directory, no config,
    not a JSON object, no string ``model_type``).

    Example:

        >>> import json, os
        >>> from attnkit.integrations.checkpoints import model_type
        >>> os.makedirs("some-llama", exist_ok=True)
        >>> with open("some-llama/config.json", "w") as file:
        ...     json.dump({"model_type": "llama", "hidden_size": 16}, file)
        >>> model_type("some-llama")
        'llama'
        >>> print(model_type("no-such-directory"))
        None
    """
    config = Path(name_or_path) / "config.json"
    if not config.is_file():
        return None
    try:
        kind = loads_untrusted(config.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, OSError, AttributeError):  # not a JSON object
        return None
    return kind if isinstance(kind, str) else None


def _architectures(directory: Path) -> list[str]:
    """The ``architectures`` listed in ``config.json`` (strings only; none when unreadable)."""
    try:
        found = loads_untrusted((directory / "config.json").read_text(encoding="utf-8")).get("architectures")
    except (ValueError, OSError, AttributeError):
        return []
    return [a for a in found if isinstance(a, str)] if isinstance(found, list) else []


def wants_transformers(name_or_path: str | Path) -> bool:
    """True for a directory whose model type attnkit's own loader does not read (anything but
    BERT): such a directory is loaded with :class:`attnkit.integrations.checkpoints.Checkpoint`.

    Example:

        >>> import json, os
        >>> from attnkit.integrations.checkpoints import wants_transformers
        >>> for kind in ("llama", "bert"):
        ...     os.makedirs(kind, exist_ok=True)
        ...     with open(f"{kind}/config.json", "w") as file:
        ...         json.dump({"model_type": kind}, file)
        >>> wants_transformers("llama"), wants_transformers("bert"), wants_transformers("no-such-directory")
        (True, False, False)
    """
    kind = model_type(name_or_path)
    return kind is not None and kind not in OWN_MODEL_TYPES


@dataclass
class Encoded:
    """One text through a checkpoint: its tokens (``tokens[0]``, ``T`` of them) and every layer's
    weights ``[1, H, T, T]`` (float32). :meth:`attnkit.integrations.checkpoints.Checkpoint.encode`
    makes them.

    Example:

        >>> import torch
        >>> from attnkit.integrations.checkpoints import Encoded
        >>> encoded = Encoded([["a", "b"]], [torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])])
        >>> len(encoded.tokens[0]), [tuple(a.shape) for a in encoded.attentions]
        (2, [(1, 1, 2, 2)])
    """

    tokens: list[list[str]]
    attentions: list[Tensor]


class Checkpoint:
    """A local transformers checkpoint with its tokenizer, attention on attnkit.

    ``path``: a directory saved by ``save_pretrained`` (``config.json``, the weights and a
    tokenizer), read with ``local_files_only=True`` (never a download). Attributes: ``path``,
    ``name`` (the directory's), ``tokenizer``, ``model`` (the base model, eval mode),
    ``is_encoder_decoder``, ``has_sinks``, ``num_layers``, ``num_heads``.

    Raises:
        ValueError: when the directory holds no usable tokenizer.
        ImportError: when transformers is not installed (naming the extra to install).

    Example:

        >>> import transformers
        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> words = {"[UNK]": 0, "the": 1, "quick": 2, "brown": 3, "fox": 4}
        >>> tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
        >>> tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        >>> fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
        >>> saved = fast.save_pretrained("tiny")
        >>> config = transformers.LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...                                   num_attention_heads=2, num_key_value_heads=1)
        >>> transformers.LlamaForCausalLM(config).save_pretrained("tiny")  # a tiny random Llama checkpoint
        >>> from attnkit.integrations.checkpoints import Checkpoint
        >>> checkpoint = Checkpoint("tiny")
        >>> checkpoint.name, checkpoint.num_layers, checkpoint.num_heads, checkpoint.is_encoder_decoder
        ('tiny', 2, 2, False)
    """

    def __init__(self, path: str | Path) -> None:
        require("transformers", f"model directory {str(path)!r} ({model_type(path)})", extra="transformers")
        from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

        from . import transformers as _registered  # noqa: F401  registers "attnkit"

        self.path = Path(path)
        self.name = self.path.name or str(self.path)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        except (OSError, ValueError) as error:
            raise ValueError(f"model directory {str(self.path)!r}: no usable tokenizer ({error})") from None
        from transformers.utils import logging

        bar = logging.is_progress_bar_enabled()
        logging.disable_progress_bar()  # no "Loading weights" bar in the command's output
        try:
            self.model = self._base_model(AutoModel, AutoModelForCausalLM)
        finally:
            if bar:
                logging.enable_progress_bar()
        config = self.model.config
        self.is_encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        self.has_sinks = any(isinstance(getattr(m, "sinks", None), Tensor) for m in self.model.modules())
        self.num_layers = getattr(config, "num_layers", None) or config.num_hidden_layers
        self.num_heads = getattr(config, "num_heads", None) or config.num_attention_heads

    def _base_model(self, auto_model, auto_causal_lm):
        """The checkpoint's base model (attention weights are all that is shown). A ``*ForCausalLM``
        checkpoint is loaded whole and its base model taken: loading the base model alone would
        leave ``lm_head.weight`` (stored when the embeddings are untied) unused, and transformers
        prints a load report about it into the command's output."""
        architectures = _architectures(self.path)
        loader = auto_causal_lm if any(a.endswith("ForCausalLM") for a in architectures) else auto_model
        model = loader.from_pretrained(self.path, attn_implementation="attnkit", local_files_only=True)
        return (model.base_model if loader is auto_causal_lm else model).eval()

    def _forward(self, input_ids: Tensor):
        network = self.model.get_encoder() if self.is_encoder_decoder else self.model
        with torch.no_grad():
            return network(input_ids=input_ids, output_attentions=True)

    def encode(self, text: str) -> Encoded:
        """``text`` alone (a batch of one: no padding), every layer's attention weights. With learned
        sinks (GPT-OSS) a row's weights sum to less than 1; they are renormalised over the keys.

        Returns:
            An :class:`attnkit.integrations.checkpoints.Encoded`: ``T`` tokens and ``num_layers``
            tensors ``[1, H, T, T]``.

        Raises:
            ValueError: when ``text`` gives no tokens.

        Example:

            >>> import transformers
            >>> from tokenizers import Tokenizer, models, pre_tokenizers
            >>> words = {"[UNK]": 0, "the": 1, "quick": 2, "brown": 3, "fox": 4}
            >>> tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
            >>> tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
            >>> fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
        >>> saved = fast.save_pretrained("tiny")
            >>> config = transformers.LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            ...                                   num_attention_heads=2, num_key_value_heads=1)
            >>> transformers.LlamaForCausalLM(config).save_pretrained("tiny")  # a tiny random Llama checkpoint
            >>> import torch
            >>> from attnkit.integrations.checkpoints import Checkpoint
            >>> encoded = Checkpoint("tiny").encode("the quick brown fox")
            >>> encoded.tokens, [tuple(a.shape) for a in encoded.attentions]
            ([['the', 'quick', 'brown', 'fox']], [(1, 2, 4, 4), (1, 2, 4, 4)])
            >>> first = encoded.attentions[0][0, 0]  # causal: nothing above the diagonal
            >>> bool((first.triu(1) == 0).all()), torch.allclose(first.sum(-1), torch.ones(4))
            (True, True)
        """
        input_ids = self.tokenizer(text, return_tensors="pt")["input_ids"]
        if input_ids.shape[1] == 0:
            raise ValueError(f"text {text!r} gives no tokens")
        attentions = [a.float() for a in self._forward(input_ids).attentions]
        if self.has_sinks:
            attentions = [a / a.sum(-1, keepdim=True).clamp_min(torch.finfo(a.dtype).tiny) for a in attentions]
        tokens = self.tokenizer.convert_ids_to_tokens(input_ids[0].tolist())
        return Encoded([tokens], attentions)

    def trace(self, text: str):
        """Every attention call of ``text`` (batch of one) recorded by :func:`attnkit.trace.record`,
        with its tokens. Call ``i`` is layer ``i`` (the encoder's layers for encoder-decoders).

        Returns:
            ``(trace, tokens)``: an :class:`attnkit.trace.Trace` and the ``T`` token strings.

        Example:

            >>> import transformers
            >>> from tokenizers import Tokenizer, models, pre_tokenizers
            >>> words = {"[UNK]": 0, "the": 1, "quick": 2, "brown": 3, "fox": 4}
            >>> tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
            >>> tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
            >>> fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
        >>> saved = fast.save_pretrained("tiny")
            >>> config = transformers.LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            ...                                   num_attention_heads=2, num_key_value_heads=1)
            >>> transformers.LlamaForCausalLM(config).save_pretrained("tiny")  # a tiny random Llama checkpoint
            >>> from attnkit.integrations.checkpoints import Checkpoint
            >>> recorded, tokens = Checkpoint("tiny").trace("the quick fox")
            >>> len(recorded.calls), tokens
            (2, ['the', 'quick', 'fox'])
        """
        from .. import trace

        input_ids = self.tokenizer(text, return_tensors="pt")["input_ids"]
        with trace.record() as recorded:
            self._forward(input_ids)
        return recorded, self.tokenizer.convert_ids_to_tokens(input_ids[0].tolist())


def records(checkpoint: Checkpoint, texts: Sequence[str]) -> list:
    """One :class:`~attnkit.viz.AttentionRecord` per text (its weights ``[layers, H, T, T]``, named
    after the checkpoint), for :func:`attnkit.viz.write_report` and the other views.

    Args:
        checkpoint: a :class:`attnkit.integrations.checkpoints.Checkpoint`.
        texts: the texts, each run alone (:meth:`attnkit.integrations.checkpoints.Checkpoint.encode`).

    Example:

        >>> import transformers
        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> words = {"[UNK]": 0, "the": 1, "quick": 2, "brown": 3, "fox": 4}
        >>> tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
        >>> tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        >>> fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
        >>> saved = fast.save_pretrained("tiny")
        >>> config = transformers.LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...                                   num_attention_heads=2, num_key_value_heads=1)
        >>> transformers.LlamaForCausalLM(config).save_pretrained("tiny")  # a tiny random Llama checkpoint
        >>> from attnkit.integrations.checkpoints import Checkpoint, records
        >>> found = records(Checkpoint("tiny"), ["the quick fox", "brown fox"])
        >>> [(r.text, r.tokens, tuple(r.attentions.shape), r.model) for r in found]
        [('the quick fox', ['the', 'quick', 'fox'], (2, 2, 3, 3), 'tiny'),
         ('brown fox', ['brown', 'fox'], (2, 2, 2, 2), 'tiny')]
    """
    from ..viz import AttentionRecord

    result = []
    for text in texts:
        out = checkpoint.encode(text)
        weights = torch.stack([a[0] for a in out.attentions])  # [layers, H, T, T]
        result.append(AttentionRecord(text, out.tokens[0], weights, model=checkpoint.name))
    return result
