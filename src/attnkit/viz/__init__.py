"""Drawing attention: a standalone HTML report and PNG/SVG images.

``write_report`` needs numpy; ``save_grid`` and ``save_head`` need matplotlib (both in the
``attnkit[viz]`` extra, imported only when used). The core of attnkit needs neither.
"""

from .encode import EXACT_LIMIT
from .export import save_grid, save_head
from .progress import progress
from .record import AttentionRecord, records_from_batch
from .report import render_report, write_report

__all__ = [
    "AttentionRecord", "records_from_batch", "write_report", "render_report",
    "save_grid", "save_head", "progress", "EXACT_LIMIT",
]
