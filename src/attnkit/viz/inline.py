"""Attention views inline in Jupyter: ``head_view``, ``model_view``, ``heatmap``.

For example::

    from attnkit import viz
    viz.head_view(attentions, tokens)         # displays in the output cell

Each call returns an :class:`attnkit.viz.AttentionView`, which Jupyter displays through ``_repr_mimebundle_``
(and ``_repr_html_``). The view is the report page (:func:`attnkit.viz.render_report`, the same renderer
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

    Build it with :func:`attnkit.viz.head_view`, :func:`attnkit.viz.model_view` or
    :func:`attnkit.viz.heatmap`.

    Args:
        records: the sentences, one :class:`attnkit.viz.AttentionRecord` each (at least one; a
            selector switches between them).
        layout: the views offered and what they show first (:class:`attnkit.viz.Layout`; the
            view functions set ``embedded=True``).
        title: the frame's title (for screen readers) and the saved page's.
        precision: how the weights are stored in the page (see :func:`attnkit.viz.write_report`).

    Example:

        >>> import torch
        >>> from attnkit.viz import AttentionRecord, AttentionView, Layout
        >>> record = AttentionRecord("the cat sat", ["the", "cat", "sat"], torch.full((2, 4, 3, 3), 1 / 3))
        >>> view = AttentionView([record], Layout(views=("heatmap",), embedded=True), title="uniform")
        >>> view                                                  # what a terminal shows
        <attnkit heatmap: 3 tokens, 2 layers x 4 heads; displays in Jupyter, .save('view.html') writes a page>
        >>> view.save("uniform.html").exists()
        True
    """

    def __init__(self, records: Sequence[AttentionRecord], layout: Layout, *, title: str,
                 precision: Precision = "auto") -> None:
        self.records = list(records)
        self.layout = layout
        self.title = title
        self.precision = precision

    @property
    def view(self) -> View:
        """The view shown first, ``"head"``, ``"model"`` or ``"heatmap"``.

        Example:

            >>> import torch
            >>> from attnkit import viz
            >>> viz.model_view(torch.full((2, 4, 3, 3), 1 / 3), ["the", "cat", "sat"]).view
            'model'
        """
        return self.layout.views[0]

    def page(self) -> str:
        """The view as one standalone HTML document (what the frame holds).

        Returns:
            The page's HTML text, as :func:`attnkit.viz.render_report` writes it for this view's
            records and layout.

        Example:

            >>> import torch
            >>> from attnkit import viz
            >>> page = viz.heatmap(torch.full((3, 3), 1 / 3), ["the", "cat", "sat"], title="uniform").page()
            >>> page.startswith("<!DOCTYPE html>"), "<title>uniform</title>" in page
            (True, True)
        """
        return render_report(self.records, title=self.title, precision=self.precision, layout=self.layout,
                             progress=False)

    def html(self) -> str:
        """The output cell's HTML: the frame holding :meth:`attnkit.viz.AttentionView.page`, and the
        script that fits its height.

        Returns:
            An ``<iframe>`` (sandboxed, scripts only, the page in its ``srcdoc``, an id unique to
            this call) followed by a ``<script>``. Jupyter shows this for the view.

        Example:

            >>> import torch
            >>> from attnkit import viz
            >>> cell = viz.heatmap(torch.full((3, 3), 1 / 3), ["the", "cat", "sat"]).html()
            >>> cell.startswith('<iframe id="attnkit-view-'), 'sandbox="allow-scripts"' in cell
            (True, True)
            >>> cell.rstrip().endswith("</script>")
            True
        """
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
        """Write the view as a standalone ``.html`` file (it opens in any browser, offline).

        Args:
            path: a file name ending in ``.html`` (or ``.htm``); its directory is created if
                needed, an existing file replaced.

        Returns:
            ``path``, as a ``pathlib.Path``.

        Raises:
            ValueError: ``path`` does not end in ``.html`` or ``.htm``.

        Example:

            >>> import torch
            >>> from attnkit import viz
            >>> view = viz.head_view(torch.full((2, 3, 3), 1 / 3), ["the", "cat", "sat"])
            >>> view.save("views/cat.html")
            PosixPath('views/cat.html')
            >>> view.save("cat.png")
            Traceback (most recent call last):
                ...
            ValueError: path: got 'cat.png', expected a file name ending in .html
        """
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
    drawing, as the page's scripts size it at ``_ASSUMED_WIDTH``, plus its controls.

    Args:
        record: the sentence shown first (its tokens, layers and heads size the drawing).
        layout: the views; the first one is sized.

    Returns:
        The height in CSS pixels (grows with the tokens in the head view and the heatmap, with
        the layers in the model view).

    Example:

        >>> import torch
        >>> from attnkit.viz import AttentionRecord, Layout
        >>> from attnkit.viz.inline import estimated_height
        >>> record = AttentionRecord("the cat sat", ["the", "cat", "sat"], torch.full((2, 4, 3, 3), 1 / 3))
        >>> estimated_height(record, Layout(views=("head",)))
        326
        >>> estimated_height(record, Layout(views=("model", "heatmap")))   # 2 rows of thumbnails, and tabs
        396
    """
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
        An :class:`attnkit.viz.AttentionView`, which Jupyter displays; ``.save("view.html")``
        writes the page.

    Raises:
        TypeError: ``attentions`` is of no form above, not floating, or ``tokens`` is missing
            or not strings; ``layer`` or a head index is not an int, ``heads`` not a sequence,
            ``text`` or ``title`` not a str.
        ValueError: shapes that do not fit (weights not ``[..., T, T]``, a token count other
            than ``T``, layers of different shapes, a batch with one token list), ``layer`` or
            a head out of range, or weights that are not softmax rows (see
            :class:`attnkit.viz.AttentionRecord`).

    Example:

        >>> import torch
        >>> import attnkit
        >>> from attnkit import toy, viz
        >>> x = toy.embeddings()                                  # 6 tokens, [6, 3]
        >>> _, weights = attnkit.attention(x, x, x, scale=1.0, return_weights=True)   # [T, T]
        >>> viz.head_view(weights, toy.TOKENS)                    # in Jupyter: the drawing
        <attnkit head view: 6 tokens, 1 layer x 1 head; displays in Jupyter, .save('view.html') writes a page>

        transformers' ``output_attentions``, one ``[batch, heads, T, T]`` tensor per layer:

        >>> layers = [torch.full((1, 4, 6, 6), 1 / 6) for _ in range(2)]
        >>> view = viz.head_view(layers, toy.TOKENS, layer=1, heads=[0, 3])
        >>> view
        <attnkit head view: 6 tokens, 2 layers x 4 heads; displays in Jupyter, .save('view.html') writes a page>
        >>> viz.head_view(layers, toy.TOKENS, layer=2)
        Traceback (most recent call last):
            ...
        ValueError: layer: got 2, expected 0 <= layer < 2 (the weights have 2 layers)
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

    ``attentions`` and ``tokens`` as for :func:`attnkit.viz.head_view` (and the same errors).
    Returns an :class:`attnkit.viz.AttentionView` whose tabs are the model view and the heatmap
    of the head last clicked. ``text`` is shown above the drawing, ``title`` names the frame.

    Example:

        >>> import torch
        >>> from attnkit import viz
        >>> weights = torch.full((6, 12, 4, 4), 0.25)              # [layers, heads, T, T]
        >>> view = viz.model_view(weights, ["[CLS]", "hello", "world", "[SEP]"], text="hello world")
        >>> view
        <attnkit model view: 4 tokens, 6 layers x 12 heads; displays in Jupyter, .save('view.html') writes a page>
        >>> view.layout.views
        ('model', 'heatmap')
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

    ``attentions`` and ``tokens`` as for :func:`attnkit.viz.head_view` (and the same errors);
    ``layer`` and ``head`` choose the head shown first (selectors switch; out of range: a
    ``ValueError``). Returns an :class:`attnkit.viz.AttentionView`.

    Example:

        A batch of two sentences (one token list each; the shorter one's padding has zero
        weight), layer 1, head 0 shown first:

        >>> import torch
        >>> import attnkit
        >>> from attnkit import masks, viz
        >>> x = torch.ones(2, 2, 3, 4)                            # [B, H, T, D]
        >>> _, weights = attnkit.attention(x, x, x, mask=masks.padding_mask(torch.tensor([3, 2])),
        ...                                return_weights=True)   # [B, H, T, T]
        >>> view = viz.heatmap([weights, weights], [["the", "cat", "sat"], ["a", "dog"]], layer=1)
        >>> view
        <attnkit heatmap: 2 sentences, 3 tokens, 2 layers x 2 heads; displays in Jupyter,
         .save('view.html') writes a page>
        >>> [record.num_tokens for record in view.records]
        [3, 2]
    """
    records = to_records(attentions, tokens, text=text)
    _checked_index("layer", layer, records[0].num_layers, "layer")
    _checked_index("head", head, records[0].num_heads, "head")
    layout = Layout(views=("heatmap",), layer=layer, head=head, embedded=True)
    return AttentionView(records, layout, title=_title(title, "heatmap"))
