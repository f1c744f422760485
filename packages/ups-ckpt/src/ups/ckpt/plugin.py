"""The ``ups-ckpt`` plugin: registers its checkpoint backends with the ups engine."""

from __future__ import annotations

from ups.core import CheckpointBackendPlugin, hookimpl

from .local import LocalCheckpointer, LocalCheckpointOptions


@hookimpl
def ups_checkpoint_backends() -> list[CheckpointBackendPlugin]:
    return [
        CheckpointBackendPlugin(
            name="local",
            factory=LocalCheckpointer,
            options=LocalCheckpointOptions,
            description="a folder per checkpoint, per-rank files, committed atomically",
        )
    ]
