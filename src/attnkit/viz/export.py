"""PNG and SVG images of attention: the layer x head grid, and one head with token labels.

matplotlib is imported here, lazily, only when an image is written (the ``attnkit[viz]``
extra). The format follows the file's suffix: ``.png``, ``.svg`` or ``.pdf``. Figures are
saved at exactly ``size`` inches x ``dpi`` (no tight cropping), so a PNG's pixel size is known.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from .._optional import require
from .record import AttentionRecord

Scale = Literal["head", "absolute"]
_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
_CMAP = "Blues"
# Beyond this many tokens a head's axes label every n-th token only.
_ALL_LABELS = 64


def _format(path: Path) -> str:
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"path: got suffix {path.suffix!r} ({path}), expected one of {sorted(_FORMATS)}")
    return fmt


def _vmax(weights: Tensor, scale: Scale) -> float:
    if scale not in ("head", "absolute"):
        raise ValueError(f"scale: got {scale!r}, expected 'head' or 'absolute'")
    largest = float(weights.max())
    return 1.0 if scale == "absolute" or largest == 0 else largest


def _pooled(weights: Tensor, pixels: int) -> Tensor:
    """Max-pool a ``[T, T]`` head down to at most ``pixels`` per side, so that one-token-wide
    patterns (a diagonal) survive being drawn smaller than one pixel per token."""
    if weights.shape[-1] <= pixels:
        return weights
    return F.adaptive_max_pool2d(weights[None], pixels)[0]


def _save(figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # No date in the metadata keeps SVG/PDF output byte-identical between runs.
    metadata = {"Date": None} if _format(path) in ("svg", "pdf") else None
    figure.savefig(path, format=_format(path), metadata=metadata)
    return path


def save_grid(
    record: AttentionRecord,
    path: str | Path,
    *,
    cell: float = 1.0,
    dpi: int = 100,
    scale: Scale = "head",
) -> Path:
    """Save every layer (rows) x head (columns) as a small heatmap; return the path.

    The figure is ``max(4, 0.8 + heads * cell)`` x ``(0.9 + layers * cell)`` inches at ``dpi``.
    ``scale="head"`` colours each head from 0 to its own largest weight, ``"absolute"`` from 0
    to 1 for all.

    Args:
        record: the sentence (:class:`attnkit.viz.AttentionRecord`); its text and model name
            make the title, its layer names label the rows.
        path: a ``.png``, ``.svg`` or ``.pdf`` file; its directory is created if needed.
        cell: the side of one head's heatmap, in inches (heads of more tokens than
            ``cell * dpi`` pixels are max-pooled, so that narrow patterns stay visible).
        dpi: pixels per inch.
        scale: ``"head"`` or ``"absolute"``, as above.

    Returns:
        ``path``, as a ``pathlib.Path``.

    Raises:
        ValueError: an unknown suffix or ``scale``.
        ImportError: matplotlib is not installed (the ``attnkit[viz]`` extra).

    Example:

        >>> import torch
        >>> from attnkit.viz import AttentionRecord, save_grid
        >>> record = AttentionRecord("the cat sat", ["the", "cat", "sat"], torch.full((2, 4, 3, 3), 1 / 3))
        >>> save_grid(record, "grid.png", cell=0.5, dpi=50)       # 4 x 1.9 inches at 50 dpi
        PosixPath('grid.png')
        >>> from PIL import Image
        >>> Image.open("grid.png").size                           # (width, height) in pixels
        (200, 95)
        >>> save_grid(record, "grid.jpg")
        Traceback (most recent call last):
            ...
        ValueError: path: got suffix '.jpg' (grid.jpg), expected one of ['.pdf', '.png', '.svg']
    """
    Figure = require("matplotlib.figure", "image export").Figure
    path = Path(path)
    _format(path)
    layers, heads = record.num_layers, record.num_heads
    width, height = max(4.0, 0.8 + heads * cell), 0.9 + layers * cell
    figure = Figure(figsize=(width, height), dpi=dpi)
    # Margins in inches, converted to figure fractions: room for the labels and the title.
    figure.subplots_adjust(left=0.7 / width, right=1 - 0.1 / width, bottom=0.1 / height,
                           top=1 - 0.8 / height, wspace=0.08, hspace=0.08)
    axes = figure.subplots(layers, heads, squeeze=False)
    pixels = max(1, int(cell * dpi))
    for layer in range(layers):
        for head in range(heads):
            weights = record.head(layer, head)
            ax = axes[layer][head]
            ax.imshow(_pooled(weights, pixels).numpy(), cmap=_CMAP, vmin=0, vmax=_vmax(weights, scale),
                      interpolation="nearest", aspect="equal")
            ax.set_xticks([])
            ax.set_yticks([])
            if layer == 0:
                ax.set_title(f"head {head}", fontsize=8)
            if head == 0:
                ax.set_ylabel(record.layer_names[layer], fontsize=8)
    colours = "0 to each head's largest weight" if scale == "head" else "0 to 1"
    figure.suptitle(f"{_short(record.text, width)}\n{record.model + ', ' if record.model else ''}colours: {colours}",
                    fontsize=9, y=1 - 0.1 / height, va="top")
    return _save(figure, path)


def save_head(
    record: AttentionRecord,
    layer: int,
    head: int,
    path: str | Path,
    *,
    size: tuple[float, float] | None = None,
    dpi: int = 100,
    scale: Scale = "absolute",
) -> Path:
    """Save one head's ``[T, T]`` weights as a heatmap with token labels and a colour bar.

    Queries run down, keys across. Up to 64 tokens every token is labelled, beyond that every
    n-th; up to 16 tokens each cell also prints its weight. ``size`` in inches defaults to a
    square growing with the number of tokens (5 to 20 inches).

    Args:
        record: the sentence (:class:`attnkit.viz.AttentionRecord`).
        layer: the head's layer, ``0 <= layer < record.num_layers``.
        head: the head, ``0 <= head < record.num_heads``.
        path: a ``.png``, ``.svg`` or ``.pdf`` file; its directory is created if needed.
        size: ``(width, height)`` in inches; default as above.
        dpi: pixels per inch.
        scale: ``"absolute"`` colours from 0 to 1, ``"head"`` from 0 to the head's largest weight.

    Returns:
        ``path``, as a ``pathlib.Path``.

    Raises:
        ValueError: an unknown suffix or ``scale``, or ``layer`` / ``head`` out of range.
        ImportError: matplotlib is not installed (the ``attnkit[viz]`` extra).

    Example:

        >>> import attnkit
        >>> from attnkit import toy
        >>> from attnkit.viz import AttentionRecord, save_head
        >>> x = toy.embeddings()
        >>> _, weights = attnkit.attention(x, x, x, scale=1.0, causal=True, return_weights=True)
        >>> record = AttentionRecord(" ".join(toy.TOKENS), toy.TOKENS, weights[None, None], model="toy")
        >>> path = save_head(record, 0, 0, "images/causal.svg", size=(4, 3.5))
        >>> path.exists(), path.read_text().count("<svg")
        (True, 1)
        >>> save_head(record, 0, 1, "images/head1.svg")
        Traceback (most recent call last):
            ...
        ValueError: head: got 1, expected 0 <= head < 1
    """
    Figure = require("matplotlib.figure", "image export").Figure
    path = Path(path)
    _format(path)
    weights = record.head(layer, head)
    tokens, count = record.tokens, record.num_tokens
    if size is None:
        side = min(20.0, max(5.0, 2.5 + 0.2 * min(count, _ALL_LABELS) + 0.01 * count))
        size = (side + 1.0, side)
    figure = Figure(figsize=size, dpi=dpi, layout="constrained")
    ax = figure.subplots()
    vmax = _vmax(weights, scale)
    image = ax.imshow(weights.numpy(), cmap=_CMAP, vmin=0, vmax=vmax, interpolation="nearest")
    step = 1 if count <= _ALL_LABELS else -(-count // 40)
    ticks = list(range(0, count, step))
    labels = [f"{tokens[i]}" if step == 1 else f"{i} {tokens[i]}" for i in ticks]
    fontsize = 9 if count <= 32 else 7
    ax.set_xticks(ticks, labels, rotation=90, fontsize=fontsize)
    ax.set_yticks(ticks, labels, fontsize=fontsize)
    ax.set_xlabel("keys")
    ax.set_ylabel("queries")
    if count <= 16:
        for q in range(count):
            for k in range(count):
                value = float(weights[q, k])
                ax.text(k, q, f"{value:.2f}", ha="center", va="center", fontsize=8,
                        color="white" if value > 0.6 * vmax else "black")
    figure.colorbar(image, ax=ax, shrink=0.8, label="weight")
    model = f"{record.model}, " if record.model else ""
    ax.set_title(f"{_short(record.text, size[0])}\n{model}{record.layer_names[layer]}, head {head}", fontsize=10)
    return _save(figure, path)


def _short(text: str, width_inches: float) -> str:
    """The text cut to what fits on one line of a title that wide (~12 characters an inch)."""
    limit = max(10, int(width_inches * 12))
    return text if len(text) <= limit else text[: limit - 1] + "…"
