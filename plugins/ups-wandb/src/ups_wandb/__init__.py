"""ups-wandb: rank 0 logs a run's config, metrics, summary and report to Weights & Biases."""

from .plugin import ID_FILE, WandbOptions, WandbTracker

__all__ = ["ID_FILE", "WandbOptions", "WandbTracker"]
