"""What a run shows: the loss and metrics aggregated over all ranks at each report (``LossWindow``,
``PendingReport``), and a run folder's metrics read back, as a table and a figure
(``read_metrics``, ``write_report``: ``ups report``); each rank's step time by phase and the
straggler among the ranks (``StepTimer``, ``own_row``, ``straggler``, ``PHASES``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from ._metrics import LossWindow, PendingReport
    from ._phases import PHASES, StepTimer, own_row, straggler
    from ._summary import read_metrics, write_report

_EXPORTS = {
    "LossWindow": "._metrics",
    "PendingReport": "._metrics",
    "PHASES": "._phases",
    "StepTimer": "._phases",
    "own_row": "._phases",
    "straggler": "._phases",
    "read_metrics": "._summary",
    "write_report": "._summary",
}
"""Each public name and the module that defines it."""

__all__ = [
    "LossWindow",
    "PendingReport",
    "PHASES",
    "StepTimer",
    "own_row",
    "straggler",
    "read_metrics",
    "write_report",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
