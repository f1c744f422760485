"""ups-tensorboard: rank 0 writes a run's reports and evaluations as TensorBoard scalars."""

from .plugin import TensorBoardLogger, tag

__all__ = ["TensorBoardLogger", "tag"]
