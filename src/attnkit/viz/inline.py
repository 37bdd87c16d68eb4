"""Attention views inline in Jupyter: ``head_view``, ``model_view``, ``heatmap``.

    from attnkit import viz
    viz.head_view(attentions, tokens)         # displays in the output cell

Each call returns an :class:`AttentionView`, which Jupyter displays through ``_repr_mimebundle_``
(and ``_repr_html_``). The view is the report page (``report.render_report``, the same renderer
and scripts) inside an ``<iframe srcdoc=...>``: one self-contained document per output, with its
own script, style and weights. So it works wherever a notebook output may run a page
(JupyterLab, VS Code, a static HTML export), needs no network and no script of the host page,
and nothing it defines can collide with the notebook or with another view. The frame is
sandboxed (scripts only: no access to the notebook page).

A frame cannot grow with its content, so it gets an estimated height, and a small script next
to it listens for the height the page reports after each drawing and fits the frame to it.
Where the host runs no output script, the estimate stays and the frame scrolls.
"""

from __future__ import annotations

import html
import math
import uuid
from collections.abc import Sequence
from pathlib import Path

from .encode import Precision
from .inputs import to_records
from .record import AttentionRecord
from .report import Layout, View, render_report

# The width the height estimate assumes for the output area (a JupyterLab cell at 1280 px).
_ASSUMED_WIDTH = 1000
_TITLES = {"head": "head view", "model": "model view", "heatmap": "heatmap"}


class AttentionView:
    """One inline view of attention weights; Jupyter displays it, ``html()`` gives the page.

    Build it with :func:`head_view`, :func:`model_view` or :func:`heatmap`.
    """

    def __init__(self, records: Sequence[AttentionRecord], layout: Layout, *, title: str,
                 precision: Precision = "auto") -> None:
        self.records = list(records)
        self.layout = layout
        self.title = title
        self.precision = precision

    @property
    def view(self) -> View:
        """The view shown first: ``"head"``, ``"model"`` or ``"heatmap"``."""
        return self.layout.views[0]

    def page(self) -> str:
        """The view as one standalone HTML document (what the frame holds)."""
        return render_report(self.records, title=self.title, precision=self.precision, layout=self.layout,
                             progress=False)

    def html(self) -> str:
        """The output cell's HTML: the frame holding :meth:`page`, and the script that fits its height."""
        # Unique in the notebook page, whose outputs may come from many kernels and sessions.
        frame_id = f"attnkit-view-{uuid.uuid4().hex[:16]}"
        height = estimated_height(self.records[0], self.layout)
        return (
            f'<iframe id="{frame_id}" class="attnkit-view" title="{html.escape(self.title)}" '
            f'sandbox="allow-scripts" srcdoc="{html.escape(self.page(), quote=True)}" '
            f'style="width: 100%; height: {height}px; border: 0; display: block;"></iframe>\n'
            f"<script>{_FIT_SCRIPT % {'id': frame_id}}</script>"
        )

    def save(self, path: str | Path) -> Path:
        """Write the view as a standalone ``.html`` file (it opens in any browser, offline)."""
        path = Path(path)
        if path.suffix.lower() not in (".html", ".htm"):
            raise ValueError(f"path: got {str(path)!r}, expected a file name ending in .html")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.page(), encoding="utf-8")
        return path

    def _repr_html_(self) -> str:
        return self.html()

    def _repr_mimebundle_(self, include: object = None, exclude: object = None) -> dict[str, str]:
        return {"text/html": self.html(), "text/plain": repr(self)}

    def __repr__(self) -> str:
        first = self.records[0]
        sentences = f"{_count(len(self.records), 'sentence')}, " if len(self.records) > 1 else ""
        return (f"<attnkit {_TITLES[self.view]}: {sentences}{_count(first.num_tokens, 'token')}, "
                f"{_count(first.num_layers, 'layer')} x {_count(first.num_heads, 'head')}; "
                "displays in Jupyter, .save('view.html') writes a page>")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


# Fits the frame to the height its page reports. It only trusts messages from its own frame and
# stops listening once the output is cleared (the frame gone from the page). The frame may have
# drawn before this script ran (a browser parses a long page in slices), so it also asks.
_FIT_SCRIPT = """(() => {
  const frame = document.getElementById("%(id)s");
  if (!frame) return;
  window.addEventListener("message", function fit(event) {
    if (!frame.isConnected) { window.removeEventListener("message", fit); return; }
    const data = event.data;
    if (event.source !== frame.contentWindow || !data || data.type !== "attnkit:height") return;
    const height = Number(data.height);
    if (height > 0 && height < 100000) frame.style.height = `${Math.ceil(height) + 4}px`;
  });
  if (frame.contentWindow) frame.contentWindow.postMessage({ type: "attnkit:measure" }, "*");
})();"""


def estimated_height(record: AttentionRecord, layout: Layout) -> int:
    """The frame's height (CSS pixels) before its page reports the real one: the first view's
    drawing, as the page's scripts size it at ``_ASSUMED_WIDTH``, plus its controls."""
    view, tokens = layout.views[0], record.num_tokens
    chrome = 90 + (40 if len(layout.views) > 1 else 0)  # selectors, summary line, tabs
    if view == "head":
        row = 20 if tokens <= 64 else 16 if tokens <= 256 else 13
        toggles = 32 * math.ceil(record.num_heads / 12)
        drawing = 110 + toggles + 26 + tokens * row + 8
    elif view == "model":
        thumb = max(40, min(96, (_ASSUMED_WIDTH - 48 - 64) // record.num_heads - 6))
        drawing = 40 + 22 + record.num_layers * (thumb + 6)
    else:
        cell = max(1, min(48, min(1100, _ASSUMED_WIDTH - 48 - 160) // tokens))
        margin = 90 if cell >= 9 else 8
        drawing = 40 + margin + tokens * cell + 8
    return int(chrome + drawing)


def _checked_index(name: str, value: object, count: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if not 0 <= value < count:
        raise ValueError(f"{name}: got {value}, expected 0 <= {name} < {count} "
                         f"(the weights have {_count(count, what)})")
    return value


def _title(title: str | None, view: View) -> str:
    if title is None:
        return f"attnkit {_TITLES[view]}"
    if not isinstance(title, str):
        raise TypeError(f"title must be a str, got {type(title).__name__}")
    return title


def head_view(
    attentions: object,
    tokens: Sequence[str] | Sequence[Sequence[str]] | None = None,
    *,
    layer: int = 0,
    heads: Sequence[int] | None = None,
    text: str | Sequence[str] | None = None,
    title: str | None = None,
) -> AttentionView:
    """Lines from each query token to the keys it attends, one colour per head, for one layer.

    Args:
        attentions: the weights, one of: a tensor ``[T, T]`` (one head), ``[heads, T, T]`` (one
            layer) or ``[layers, heads, T, T]``; a sequence of per-layer ``[heads, T, T]`` or
            ``[batch, heads, T, T]`` tensors (transformers' ``output_attentions``, attnkit's
            ``encode(..., need_weights=True).attentions``); an object holding them in an
            ``attentions`` attribute (its ``tokens`` too, if it has them); or ``AttentionRecord``
            objects. Rows are queries, columns keys; each row sums to 1 (or is all zeros).
        tokens: the ``T`` tokens, or one list per sentence of a batch (a sentence shorter than
            ``T`` is padded: its padded keys must have zero weight).
        layer: the layer shown first (a selector switches).
        heads: the heads selected at first (checkboxes switch); default all.
        text: the sentence, shown above the drawing (one per sentence of a batch).
        title: the frame's title (for screen readers and the saved page).

    Returns:
        An :class:`AttentionView`: Jupyter displays it; ``.save("view.html")`` writes the page.
    """
    records = to_records(attentions, tokens, text=text)
    _checked_index("layer", layer, records[0].num_layers, "layer")
    if heads is not None:
        if isinstance(heads, (str, bytes)) or not isinstance(heads, Sequence):
            raise TypeError(f"heads: expected a sequence of head indices, got {type(heads).__name__}")
        heads = [_checked_index(f"heads[{i}]", h, records[0].num_heads, "head") for i, h in enumerate(heads)]
    layout = Layout(views=("head",), layer=layer, heads=heads, embedded=True)
    return AttentionView(records, layout, title=_title(title, "head"))


def model_view(
    attentions: object,
    tokens: Sequence[str] | Sequence[Sequence[str]] | None = None,
    *,
    text: str | Sequence[str] | None = None,
    title: str | None = None,
) -> AttentionView:
    """Every layer (rows) x head (columns) as a small heatmap; click one to enlarge it.

    ``attentions`` and ``tokens`` as for :func:`head_view`. Returns an :class:`AttentionView`
    whose tabs are the model view and the heatmap of the head last clicked.
    """
    records = to_records(attentions, tokens, text=text)
    layout = Layout(views=("model", "heatmap"), embedded=True)
    return AttentionView(records, layout, title=_title(title, "model"))


def heatmap(
    attentions: object,
    tokens: Sequence[str] | Sequence[Sequence[str]] | None = None,
    *,
    layer: int = 0,
    head: int = 0,
    text: str | Sequence[str] | None = None,
    title: str | None = None,
) -> AttentionView:
    """The exact weights of one head, queries down and keys across (hover a cell for its value).

    ``attentions`` and ``tokens`` as for :func:`head_view`; ``layer`` and ``head`` choose the
    head shown first (selectors switch). Returns an :class:`AttentionView`.
    """
    records = to_records(attentions, tokens, text=text)
    _checked_index("layer", layer, records[0].num_layers, "layer")
    _checked_index("head", head, records[0].num_heads, "head")
    layout = Layout(views=("heatmap",), layer=layer, head=head, embedded=True)
    return AttentionView(records, layout, title=_title(title, "heatmap"))
