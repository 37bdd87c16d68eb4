"""Drawing attention: views inline in Jupyter, a standalone HTML report and PNG/SVG images.

``head_view``, ``model_view`` and ``heatmap`` display in a notebook (they take attnkit's weights
or transformers' ``output_attentions``). They and ``write_report`` need numpy; ``save_grid`` and
``save_head`` need matplotlib (both in the ``attnkit[viz]`` extra, imported only when used).
The core of attnkit needs neither, and nothing here needs Jupyter.
"""

from .encode import EXACT_LIMIT
from .export import save_grid, save_head
from .inline import AttentionView, head_view, heatmap, model_view
from .progress import progress
from .record import AttentionRecord, records_from_batch
from .report import Layout, render_report, write_report

__all__ = [
    "head_view", "model_view", "heatmap", "AttentionView", "Layout",
    "AttentionRecord", "records_from_batch", "write_report", "render_report",
    "save_grid", "save_head", "progress", "EXACT_LIMIT",
]
