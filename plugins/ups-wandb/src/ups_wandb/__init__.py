"""ups-wandb: rank 0 logs a run's config, metrics, summary and report to Weights & Biases, and
the training guard's records as a table."""

from .plugin import GUARD_COLUMNS, GUARD_KEY, ID_FILE, WandbOptions, WandbTracker, guard_row

__all__ = ["GUARD_COLUMNS", "GUARD_KEY", "ID_FILE", "WandbOptions", "WandbTracker", "guard_row"]
