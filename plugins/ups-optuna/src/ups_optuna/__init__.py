"""ups-optuna: ``ups sweep``, a hyperparameter search of a ups config with Optuna."""

from typing import TYPE_CHECKING

from ups.core import lazy_exports

if TYPE_CHECKING:
    from .space import Objective, Param, Pruning, Sweep, parse_sweep
    from .sweep import SweepResult, sweep

_EXPORTS = {
    "Objective": ".space",
    "Param": ".space",
    "Pruning": ".space",
    "Sweep": ".space",
    "parse_sweep": ".space",
    "SweepResult": ".sweep",
    "sweep": ".sweep",
}

__all__ = ["Objective", "Param", "Pruning", "Sweep", "SweepResult", "parse_sweep", "sweep"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
