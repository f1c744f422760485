"""ups-tensorboard: rank 0 writes a run's reports and evaluations as TensorBoard scalars, and
the training guard's records as text."""

from .plugin import TensorBoardLogger, record_markdown, tag

__all__ = ["TensorBoardLogger", "record_markdown", "tag"]
