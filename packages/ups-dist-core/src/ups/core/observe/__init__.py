"""What a run shows: the loss and metrics aggregated over all ranks at each report (``LossWindow``,
``PendingReport``), and a run folder's metrics read back, as a table and a figure
(``read_metrics``, ``write_report``: ``ups report``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from ._metrics import LossWindow, PendingReport
    from ._summary import read_metrics, write_report

_EXPORTS = {
    "LossWindow": "._metrics",
    "PendingReport": "._metrics",
    "read_metrics": "._summary",
    "write_report": "._summary",
}
"""Each public name and the module that defines it."""

__all__ = [
    "LossWindow",
    "PendingReport",
    "read_metrics",
    "write_report",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
