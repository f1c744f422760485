"""ups-optuna: ``ups sweep``, a hyperparameter search of a ups config with Optuna."""

from .space import Objective, Param, Pruning, Sweep, parse_sweep
from .sweep import SweepResult, sweep

__all__ = ["Objective", "Param", "Pruning", "Sweep", "SweepResult", "parse_sweep", "sweep"]
