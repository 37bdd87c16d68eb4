"""One standalone HTML file showing the attention of one or many sentences.

Everything is inline (style, script, data) and nothing refers to any URL, so the file works
offline and opened straight from disk (file://). The page draws on <canvas>, so inputs of 512
tokens stay responsive; the weights are embedded as base64 bytes (see :mod:`attnkit.viz.encode`).
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

from .encode import Precision, encode_weights
from .progress import progress as _progress
from .record import AttentionRecord

DEFAULT_NAME = "attention.html"

_SLOT = re.compile(r"\{\{(TITLE|STYLE|META|SCRIPT|DATA)\}\}")

# Concatenated in this order into the page's one inline script (later files use earlier ones).
_SCRIPTS = ("data.js", "colours.js", "canvas.js", "head_view.js", "model_view.js", "heatmap.js", "app.js")


View = Literal["head", "model", "heatmap"]
VIEWS: tuple[View, ...] = ("head", "model", "heatmap")


@dataclass(frozen=True)
class Layout:
    """Which views a page offers and what it shows first.

    Args:
        views: the views offered, as tabs; the first one is shown first. With a single view
            the tabs are hidden.
        layer: the layer shown first (head view and heatmap).
        head: the head shown first in the heatmap.
        heads: the heads selected at first in the head view; ``None`` selects them all.
        embedded: the page sits in a notebook's output frame: no title, tight margins, and it
            tells its host page its height (``postMessage``) after every drawing, so that the
            frame can fit it.

    Indices beyond a sentence's layers or heads are clamped by the page; the notebook views
    (:func:`attnkit.viz.head_view` and the others) check them first, with clear errors.

    Raises:
        ValueError: ``views`` is empty, repeats a view or names one that is not ``"head"``,
            ``"model"`` or ``"heatmap"``.

    Example:

        >>> from attnkit.viz import Layout
        >>> Layout(views=("heatmap", "head"), layer=1, head=2)
        Layout(views=('heatmap', 'head'), layer=1, head=2, heads=None, embedded=False)
        >>> Layout(views=("graph",))
        Traceback (most recent call last):
            ...
        ValueError: views: got ('graph',), expected distinct names among ('head', 'model', 'heatmap')
    """

    views: Sequence[View] = VIEWS
    layer: int = 0
    head: int = 0
    heads: Sequence[int] | None = None
    embedded: bool = False

    def __post_init__(self) -> None:
        views = tuple(self.views)
        if not views or any(view not in VIEWS for view in views) or len(set(views)) != len(views):
            raise ValueError(f"views: got {views!r}, expected distinct names among {VIEWS}")
        object.__setattr__(self, "views", views)
        if self.heads is not None:
            object.__setattr__(self, "heads", tuple(int(h) for h in self.heads))

    def as_json(self) -> dict:
        """The layout as the page's script reads it: a dict of JSON types (lists, ints, bools).

        Example:

            >>> from attnkit.viz import Layout
            >>> Layout(views=("head",), heads=(0, 2)).as_json()
            {'views': ['head'], 'layer': 0, 'head': 0, 'heads': [0, 2], 'embedded': False}
        """
        return {"views": list(self.views), "layer": int(self.layer), "head": int(self.head),
                "heads": None if self.heads is None else list(self.heads), "embedded": bool(self.embedded)}


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


def _script_json(value: object) -> str:
    # Inside <script>, only "</script" or "<!--" could end or confuse the block: escape every "<".
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")


def render_report(
    records: AttentionRecord | Iterable[AttentionRecord],
    *,
    title: str = "attnkit: attention report",
    precision: Precision = "auto",
    progress: bool | None = None,
    layout: Layout | None = None,
) -> str:
    """The report's HTML text; see :func:`attnkit.viz.write_report`. ``layout`` chooses the views
    offered and what is shown first (default: every view, the head view first).

    Args:
        records: one :class:`attnkit.viz.AttentionRecord`, or one per sentence.
        title: the page's title and heading.
        precision: how weights are stored (see :func:`attnkit.viz.write_report`).
        progress: draw a progress bar on stderr while encoding (``None``: for many sentences).
        layout: a :class:`attnkit.viz.Layout`; default ``Layout()``.

    Returns:
        One standalone HTML document (``str``) with style, script and weights inline, and no URL.

    Raises:
        TypeError: ``layout`` is not a :class:`attnkit.viz.Layout`, ``title`` not a str, or an
            item of ``records`` not an :class:`attnkit.viz.AttentionRecord`.
        ValueError: ``records`` is empty, or ``precision`` unknown.
        ImportError: numpy is not installed (the ``attnkit[viz]`` extra).

    Example:

        >>> import torch
        >>> from attnkit.viz import AttentionRecord, Layout, render_report
        >>> record = AttentionRecord("the cat sat", ["the", "cat", "sat"], torch.full((2, 4, 3, 3), 1 / 3))
        >>> page = render_report(record, title="Uniform attention", layout=Layout(views=("heatmap",)))
        >>> page.startswith("<!DOCTYPE html>"), "<title>Uniform attention</title>" in page
        (True, True)
        >>> page.count('<script type="application/octet-stream"')   # one data block per sentence
        1
    """
    layout = Layout() if layout is None else layout
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a Layout, got {type(layout).__name__}")
    if not isinstance(title, str):
        raise TypeError(f"title must be a str, got {type(title).__name__}")
    records = [records] if isinstance(records, AttentionRecord) else list(records)
    if not records:
        raise ValueError("records: got none, expected at least one AttentionRecord")
    metas, blocks = [], []
    for i, record in enumerate(_progress(records, label="encoding attention", enabled=progress)):
        if not isinstance(record, AttentionRecord):
            raise TypeError(f"records: item {i} is a {type(record).__name__}, expected an AttentionRecord")
        dtype, data = encode_weights(record.attentions, precision)
        metas.append({
            "text": record.text, "tokens": list(record.tokens), "model": record.model,
            "layerNames": list(record.layer_names), "layers": record.num_layers,
            "heads": record.num_heads, "dtype": dtype, "data": f"attnkit-data-{i}",
        })
        blocks.append(f'<script type="application/octet-stream" id="attnkit-data-{i}">{data}</script>')
    script = "(() => {\n\"use strict\";\n" + "\n".join(_asset(name) for name in _SCRIPTS) + "\n})();"
    fills = {
        "TITLE": html.escape(title),
        "STYLE": _asset("report.css"),
        "META": _script_json({"title": title, "records": metas, "layout": layout.as_json()}),
        "SCRIPT": script,
        "DATA": "\n".join(blocks),
    }
    # One pass over the template: inserted text (a title or a sentence that reads "{{DATA}}")
    # is never scanned for slots, so no input can alter the page.
    return _SLOT.sub(lambda slot: fills[slot.group(1)], _asset("report.html"))


def write_report(
    records: AttentionRecord | Iterable[AttentionRecord],
    out: str | Path,
    *,
    title: str = "attnkit: attention report",
    precision: Precision = "auto",
    progress: bool | None = None,
) -> Path:
    """Write one standalone HTML report and return its path.

    Args:
        records: one :class:`attnkit.viz.AttentionRecord` per sentence (a sentence selector switches
            between them).
        out: a ``.html`` file path, or a directory (created if needed) that receives
            ``attention.html``; an existing file without the ``.html`` suffix is refused.
        title: shown as the page's heading and title.
        precision: how weights are stored: ``"float32"`` (exact), ``"float16"`` (half the
            size, 3 significant digits) or ``"auto"`` (float32 unless a sentence has more than
            ``encode.EXACT_LIMIT`` weights).
        progress: draw a progress bar on stderr while encoding; ``None`` shows it for many
            sentences (``progress.MANY`` or more).

    The page has three views: the head view (lines from each query token to the keys it
    attends, one colour per head, heads selectable, hover a token to isolate its lines), the
    model view (every layer x head as a small heatmap, click one to enlarge it) and the exact
    heatmap of one head (hover a cell for query, key and weight).

    Returns:
        The path of the page written (``out`` itself, or ``out / "attention.html"``).

    Raises:
        ValueError: ``out`` is an existing file without the ``.html`` suffix, ``records`` is
            empty, or ``precision`` unknown.
        TypeError: an item of ``records`` is not an :class:`attnkit.viz.AttentionRecord`.
        ImportError: numpy is not installed (the ``attnkit[viz]`` extra).

    Example:

        >>> import torch
        >>> import attnkit
        >>> from attnkit import toy
        >>> from attnkit.viz import AttentionRecord, write_report
        >>> x = toy.embeddings()
        >>> _, weights = attnkit.attention(x, x, x, scale=1.0, return_weights=True)   # [6, 6]
        >>> record = AttentionRecord(" ".join(toy.TOKENS), toy.TOKENS, weights[None, None], model="toy")
        >>> write_report(record, "report")                        # a directory
        PosixPath('report/attention.html')
        >>> path = write_report([record, record], "two.html", title="Twice the same")
        >>> path.exists(), path.stat().st_size > 10_000
        (True, True)
    """
    out = Path(out)
    is_page = out.suffix.lower() in (".html", ".htm")
    if not is_page and out.exists() and not out.is_dir():
        raise ValueError(f"out: {str(out)!r} is a file; give a directory (it receives {DEFAULT_NAME}) "
                         "or a path ending in .html")
    path = out if is_page else out / DEFAULT_NAME
    page = render_report(records, title=title, precision=precision, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path
