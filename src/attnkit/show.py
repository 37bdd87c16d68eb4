"""``attnkit show``: run texts through a model and write the report, images and a summary."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import toy
from .core import attention

DEFAULT_TEXTS = ("The quick brown fox jumps over the lazy dog.",)


@dataclass
class ShowResult:
    """What :func:`show` wrote and found."""

    paths: list[Path]
    summary: list[str]


def toy_record():
    """Seed 002's six tokens as a one-layer, one-head record (weightless self-attention)."""
    from .viz import AttentionRecord

    inputs = toy.embeddings()
    _, weights = attention(inputs, inputs, inputs, scale=1.0, return_weights=True)
    return AttentionRecord(" ".join(toy.TOKENS), toy.TOKENS, weights[None, None], model="toy")


def is_llama_directory(model: str) -> bool:
    """Whether ``model`` names a Hugging Face Llama directory (what ``attnkit train`` writes)."""
    config = Path(model) / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("model_type") == "llama"
    except (ValueError, UnicodeDecodeError, AttributeError):
        return False  # the BERT loader reports what is wrong with the file


def gpt_records(texts: Sequence[str], directory: str):
    """One record per text from a GPT's layers (causal: each token attends to itself and before)."""
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
    """One :class:`~attnkit.viz.AttentionRecord` per text, from every layer's weights."""
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
    """The induction-head demo's model, trained now (seconds; see :mod:`attnkit.models.induction`)."""
    from .models.induction import train_induction as train

    return train()


def induction_record(result) -> tuple[object, list[str], tuple[int, int]]:
    """The trained demo model on one sequence of random tokens repeated twice: its record (every
    layer and head), the per-head scores as text (over 64 such sequences) and the best
    induction head ``(layer, head)``."""
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
    park most of their weight there, which says little about the sentence."""
    received = record.attentions[layer].mean(dim=1)  # [heads, T]: average weight each key receives
    words = [i for i, t in enumerate(record.tokens) if not _is_special(t)] or list(range(record.num_tokens))
    result = []
    for head in received:
        best = max(words, key=lambda i: float(head[i]))
        result.append((record.tokens[best], float(head[best])))
    return result


def summarise(record) -> list[str]:
    """Per layer, the most-attended word token of each head, and the share taken by special tokens."""
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
