"""The former home of :func:`~ups.core.engine.to_device` and the other batch helpers, kept so
that ``from ups.core.batches import ...`` goes on working: they live in :mod:`ups.core.engine`."""

from .engine import BatchError, batch_size, tensors, to_device

__all__ = ["BatchError", "batch_size", "tensors", "to_device"]
