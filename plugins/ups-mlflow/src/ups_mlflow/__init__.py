"""ups-mlflow: rank 0 logs a run's config, metrics, summary and report to MLflow."""

from .plugin import ID_FILE, MlflowOptions, MlflowTracker

__all__ = ["ID_FILE", "MlflowOptions", "MlflowTracker"]
