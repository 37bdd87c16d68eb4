"""``attnkit show``: run texts through a model and write the report, images and a summary."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import toy
from ._json import loads_untrusted
from .core import attention

DEFAULT_TEXTS = ("The quick brown fox jumps over the lazy dog.",)


@dataclass
class ShowResult:
    """What :func:`attnkit.show.show` wrote and found.

    Args:
        paths: the files written, the report first, then the images.
        summary: the lines ``attnkit show`` prints (see :func:`attnkit.show.summarise`).

    Example:

        >>> from attnkit.show import ShowResult, show
        >>> result = show(None, model="toy", out="report", images=False)
        >>> isinstance(result, ShowResult), result.paths
        (True, [PosixPath('report/attention.html')])
    """

    paths: list[Path]
    summary: list[str]


def toy_record():
    """Seed 002's six tokens as a one-layer, one-head record (weightless self-attention).

    Returns:
        An :class:`attnkit.viz.AttentionRecord` with ``attentions [1, 1, 6, 6]`` (scale 1, as in
        :func:`attnkit.explain.toy_steps`), ``model="toy"``.

    Example:

        >>> from attnkit.show import toy_record
        >>> record = toy_record()
        >>> record.text, record.model, record.attentions.shape
        ('Your journey starts with one step', 'toy', torch.Size([1, 1, 6, 6]))
        >>> record.head(0, 0)[1]                                  # "journey"
        tensor([0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581])
    """
    from .viz import AttentionRecord

    inputs = toy.embeddings()
    _, weights = attention(inputs, inputs, inputs, scale=1.0, return_weights=True)
    return AttentionRecord(" ".join(toy.TOKENS), toy.TOKENS, weights[None, None], model="toy")


def is_llama_directory(model: str) -> bool:
    """Whether ``model`` names a Hugging Face Llama directory (what ``attnkit train`` writes).

    Args:
        model: a model name or directory path.

    Returns:
        True when ``model/config.json`` is a JSON object with ``"model_type": "llama"``;
        False otherwise (no such file, or not such JSON).

    Example:

        Only ``config.json`` is read (the loader checks the rest):

        >>> import json
        >>> from pathlib import Path
        >>> from attnkit.show import is_llama_directory
        >>> Path("gpt").mkdir()
        >>> _ = Path("gpt/config.json").write_text(json.dumps({"model_type": "llama"}))
        >>> is_llama_directory("gpt"), is_llama_directory("minilm")
        (True, False)
    """
    config = Path(model) / "config.json"
    if not config.is_file():
        return False
    try:
        return loads_untrusted(config.read_text(encoding="utf-8")).get("model_type") == "llama"
    except (ValueError, AttributeError, OSError):
        return False  # the BERT loader reports what is wrong with the file


def gpt_records(texts: Sequence[str], directory: str):
    """One record per text from a GPT's layers (causal: each token attends to itself and before).

    Args:
        texts: the texts, each run alone (a batch of one).
        directory: a Llama-format directory with a ``tokenizer.json`` (see
            :func:`attnkit.models.llama_export.load_llama`).

    Returns:
        One :class:`attnkit.viz.AttentionRecord` per text, ``attentions [layers, heads, T, T]``,
        its tokens decoded one by one, named after the directory.

    Raises:
        FileNotFoundError: the directory or its weights are missing.
        ValueError: it has no ``tokenizer.json``, a file is damaged, or a text gives no tokens.

    Example:

        >>> from attnkit.models.gpt import GPT, GPTConfig
        >>> from attnkit.models.llama_export import save_llama
        >>> from attnkit.training.corpus import train_tokenizer
        >>> config = GPTConfig(vocab_size=300, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        ...                    num_key_value_heads=2, intermediate_size=32)
        >>> tokenizer = train_tokenizer(["the cat sat on the mat"] * 4, 300)
        >>> directory = save_llama(GPT(config), "tiny-gpt", tokenizer)   # what attnkit train writes
        >>> from attnkit.show import gpt_records
        >>> records = gpt_records(["the cat sat", "on the mat"], "tiny-gpt")
        >>> [record.tokens for record in records]
        [['the', ' cat', ' sat'], ['on', ' the', ' mat']]
        >>> records[0].model, records[0].attentions.shape        # [layers, heads, T, T]
        ('tiny-gpt', torch.Size([2, 4, 3, 3]))
        >>> records[0].head(1, 0) > 0                             # causal
        tensor([[ True, False, False],
                [ True,  True, False],
                [ True,  True,  True]])
    """
    import torch

    from .models.llama_export import load_llama
    from .viz import AttentionRecord

    model, tokenizer = load_llama(directory)
    if tokenizer is None:
        raise ValueError(f"model directory {directory!r} has no tokenizer.json")
    records = []
    for text in texts:
        ids = tokenizer.encode(text).ids
        if not ids:
            raise ValueError(f"text {text!r} has no tokens")
        with torch.no_grad():
            _, weights = model(torch.tensor([ids]), need_weights=True)
        tokens = [tokenizer.decode([i]) for i in ids]
        records.append(AttentionRecord(text, tokens, torch.stack([w[0] for w in weights]), model=Path(directory).name))
    return records


def model_records(texts: Sequence[str], model: str = "minilm", *, batch_size: int = 16):
    """One :class:`~attnkit.viz.AttentionRecord` per text, from every layer's weights.

    Args:
        texts: the texts.
        model: ``"minilm"``, a BERT-family directory (run by :func:`attnkit.models.load`, in
            batches of ``batch_size``), a Llama directory from ``attnkit train`` (see
            :func:`attnkit.show.gpt_records`) or, with transformers installed, a Hugging Face
            checkpoint of another type (see :mod:`attnkit.integrations.checkpoints`).
        batch_size: texts per batch for BERT-family models (a progress bar on stderr shows
            for more than one batch).

    Returns:
        One record per text, ``attentions [layers, heads, T, T]`` over its own ``T`` tokens
        (special tokens included, padding dropped).

    Raises:
        ImportError: ``"minilm"`` is asked for and its package is not installed.
        OSError: the model directory is missing or unreadable.
        ValueError: a damaged model directory.

    Example:

        >>> from attnkit.show import model_records
        >>> records = model_records(["Hello world", "A cat sat on the mat."])
        >>> [record.tokens for record in records]
        [['[CLS]', 'hello', 'world', '[SEP]'], ['[CLS]', 'a', 'cat', 'sat', 'on', 'the', 'mat', '.', '[SEP]']]
        >>> records[1].model, records[1].attentions.shape        # 6 layers x 12 heads
        ('minilm', torch.Size([6, 12, 9, 9]))
    """
    from . import models
    from .integrations import checkpoints

    if is_llama_directory(model):  # a GPT from attnkit train: attnkit's own model, no transformers
        return gpt_records(texts, model)
    from .viz import progress, records_from_batch

    if checkpoints.wants_transformers(model):  # GPT-2, Llama, T5, ...: transformers, attention on attnkit
        return checkpoints.records(checkpoints.Checkpoint(model), texts)
    encoder = models.load(model)
    records = []
    batches = range(0, len(texts), batch_size)
    for start in progress(batches, label=f"encoding {len(texts)} texts", enabled=len(texts) > batch_size or None):
        chunk = list(texts[start : start + batch_size])
        out = encoder.encode(chunk, need_weights=True)
        records += records_from_batch(chunk, out.tokens, out.attentions, model=encoder.name)
    return records


def train_induction():
    """The induction-head demo's model, trained now (seconds; see :mod:`attnkit.models.induction`).

    Returns:
        The :class:`attnkit.models.induction.InductionResult` of
        :func:`attnkit.models.induction.train_induction` with the default
        :class:`attnkit.models.induction.InductionConfig` (250 steps, seeded: the same model
        each time, and the global random state is left as it was).

    Example:

        This function takes seconds to a minute; the same training with a tiny configuration
        runs at once:

        >>> from attnkit.models.induction import InductionConfig, train_induction
        >>> config = InductionConfig(steps=1, half=4, vocab_size=16, hidden_size=16, batch_size=4)  # tiny, fast
        >>> result = train_induction(config)
        >>> len(result.losses), result.config.num_layers, result.model.training
        (1, 2, False)
    """
    from .models.induction import train_induction as train

    return train()


def induction_record(result) -> tuple[object, list[str], tuple[int, int]]:
    """The trained demo model on one sequence of random tokens repeated twice: its record (every
    layer and head), the per-head scores as text (over 64 such sequences) and the best
    induction head ``(layer, head)``.

    Args:
        result: what :func:`attnkit.show.train_induction` (or
            :func:`attnkit.models.induction.train_induction`) returns.

    Returns:
        ``(record, lines, (layer, head))``; the record's ``attentions`` are
        ``[layers, heads, 2 * half, 2 * half]`` and its tokens ``t<id>``; the lines give the
        losses on each half and, per head, its previous-token, prefix-matching and copying
        scores.

    Example:

        >>> from attnkit.models.induction import InductionConfig, train_induction
        >>> config = InductionConfig(steps=1, half=4, vocab_size=16, hidden_size=16, batch_size=4)  # tiny, fast
        >>> result = train_induction(config)
        >>> from attnkit.show import induction_record
        >>> record, lines, (layer, head) = induction_record(result)
        >>> record.text, record.attentions.shape                  # [layers, heads, 2 * half, 2 * half]
        ('4 random tokens, repeated', torch.Size([2, 4, 8, 8]))
        >>> print(lines[1])
        layer head  previous-token  prefix-matching  copying
        >>> record.head(layer, head).shape                        # the best induction head
        torch.Size([8, 8])
    """
    import torch

    from .models import induction
    from .viz import AttentionRecord

    config = result.config
    tokens = induction.repeated_tokens(64, config.half, config.vocab_size, torch.Generator().manual_seed(1))
    _, weights = result.model(tokens[:1], need_weights=True)
    labels = [f"t{int(t)}" for t in tokens[0]]
    text = f"{config.half} random tokens, repeated"
    record = AttentionRecord(text, labels, torch.stack([w[0] for w in weights]), model="induction")
    first, second = induction.half_losses(result.model, tokens)
    prefix, copying = induction.prefix_matching_scores(result.model, tokens), induction.copying_scores(result.model)
    lines = [f"attention-only GPT trained for {config.steps} steps on random tokens repeated twice: loss "
             f"{first:.2f} on the first half (ln {config.vocab_size} = {math.log(config.vocab_size):.2f}), "
             f"{second:.2f} on the repeated half", *induction.head_table(result.model, tokens)]
    return record, lines, induction.best_induction_head(prefix, copying)


def _is_special(token: str) -> bool:
    return token.startswith("[") and token.endswith("]")


def most_attended(record, layer: int) -> list[tuple[str, float]]:
    """For each head of ``layer``: the word token that receives the most attention, and the
    average weight a query gives it. Special tokens ([CLS], [SEP]) are left out: BERT heads
    park most of their weight there, which says little about the sentence.

    Args:
        record: an :class:`attnkit.viz.AttentionRecord`.
        layer: ``0 <= layer < record.num_layers``.

    Returns:
        One ``(token, average weight)`` per head of the layer. A token in brackets is special;
        a record of special tokens only falls back to all of them.

    Raises:
        IndexError: ``layer`` is out of range.

    Example:

        >>> from attnkit.show import most_attended, toy_record
        >>> [(token, round(weight, 4)) for token, weight in most_attended(toy_record(), 0)]
        [('journey', 0.2162)]
    """
    received = record.attentions[layer].mean(dim=1)  # [heads, T]: average weight each key receives
    words = [i for i, t in enumerate(record.tokens) if not _is_special(t)] or list(range(record.num_tokens))
    result = []
    for head in received:
        best = max(words, key=lambda i: float(head[i]))
        result.append((record.tokens[best], float(head[best])))
    return result


def summarise(record) -> list[str]:
    """Per layer, the most-attended word token of each head, and the share taken by special tokens.

    Args:
        record: an :class:`attnkit.viz.AttentionRecord`.

    Returns:
        A heading line, then one line per layer (what ``attnkit show`` prints), as
        :func:`attnkit.show.most_attended` finds it, with weights to 2 decimals.

    Example:

        >>> from attnkit.show import summarise, toy_record
        >>> for line in summarise(toy_record()):
        ...     print(line)
        'Your journey starts with one step' (6 tokens): most-attended word of each head
          layer 0: journey(0.22)
    """
    special = [i for i, t in enumerate(record.tokens) if _is_special(t)]
    lines = [f"{record.text!r} ({record.num_tokens} tokens): most-attended word of each head"]
    for layer in range(record.num_layers):
        heads = "  ".join(f"{token}({weight:.2f})" for token, weight in most_attended(record, layer))
        line = f"  layer {layer}: {heads}"
        if special:
            share = float(record.attentions[layer][..., special].sum(-1).mean())
            line += f"   [special tokens take {share:.0%}]"
        lines.append(line)
    return lines


def show(texts: Sequence[str] | None, *, model: str = "minilm", out: str | Path = "attnkit-report",
         layer: int | None = None, head: int | None = None, images: bool = True) -> ShowResult:
    """Write ``out/attention.html`` (every text) and, with ``images``, PNG and SVG images of the
    first text's layer x head grid and of one head (default layer 0, head 0; for
    ``model="induction"``, the best induction head).

    ``model="induction"`` trains the induction-head demo first (seconds) and draws its heads on
    random tokens repeated twice, with each head's prefix-matching and copying scores.

    ``out`` is a directory, created if needed (an existing file there is refused before any
    work); files of the same names in it are replaced.

    Args:
        texts: the texts; ``None`` or empty for a built-in sentence (and for ``"toy"`` and
            ``"induction"``, which take none).
        model: ``"minilm"``, ``"toy"``, ``"induction"`` or a model directory (see
            :func:`attnkit.show.model_records`).
        out: the output directory.
        layer: the layer of the single-head images (default 0).
        head: the head of the single-head images (default 0).
        images: also write ``grid.png``, ``grid.svg`` and ``layer<L>-head<H>.png``/``.svg``.

    Returns:
        A :class:`attnkit.show.ShowResult` with the paths written and a summary (see
        :func:`attnkit.show.summarise`; the scores of each head for ``"induction"``).

    Raises:
        ValueError: ``out`` is an existing file, texts are given to ``"toy"`` or
            ``"induction"``, ``layer`` or ``head`` is out of range, or a model directory is
            damaged.
        ImportError: numpy (or, with ``images``, matplotlib) or the model's package is missing.
        OSError: a model directory is missing, or ``out`` cannot be written.

    Example:

        >>> from attnkit.show import show
        >>> result = show(None, model="toy", out="report", images=False)
        >>> [str(path) for path in result.paths]
        ['report/attention.html']
        >>> for line in result.summary:
        ...     print(line)
        'Your journey starts with one step' (6 tokens): most-attended word of each head
          layer 0: journey(0.22)
        >>> show(["my own text"], model="toy", images=False)
        Traceback (most recent call last):
            ...
        ValueError: the toy model has one fixed sentence; use --model minilm for your own texts
    """
    from .viz import save_grid, save_head, write_report
    from ._optional import require
    from .viz.report import DEFAULT_NAME

    # A missing optional package is reported before the model runs, not after minutes of it.
    require("numpy", "the HTML report")
    if images:
        require("matplotlib.figure", "image export")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: {str(out)!r} is a file; give a directory for the report and its images "
                         "(created if needed)")
    extra: list[str] = []
    if model in ("toy", "induction") and texts:
        what = "has one fixed sentence" if model == "toy" else "reads random tokens repeated twice"
        raise ValueError(f"the {model} model {what}; use --model minilm for your own texts")
    if model == "toy":
        records = [toy_record()]
    elif model == "induction":
        record, extra, best = induction_record(train_induction())
        records = [record]
        layer, head = (best if layer is None and head is None else (layer or 0, head or 0))
    else:
        records = model_records(list(texts or DEFAULT_TEXTS), model)
    layer, head = layer or 0, head or 0
    first = records[0]
    first.head(layer, head)  # a clear error for an out-of-range layer or head, before writing
    paths = [write_report(records, out / DEFAULT_NAME, title=f"attnkit: {first.model} attention")]
    if images:
        for suffix in ("png", "svg"):
            paths.append(save_grid(first, out / f"grid.{suffix}"))
            paths.append(save_head(first, layer, head, out / f"layer{layer}-head{head}.{suffix}"))
    summary = extra or [line for record in records[:3] for line in summarise(record)]
    if len(records) > 3:
        summary.append(f"... and {len(records) - 3} more texts in the report")
    return ShowResult(paths, summary)
