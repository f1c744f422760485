"""The ``ups-ckpt`` plugin: registers its checkpoint backends with the ups engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from ups.core import (
    CheckpointBackendPlugin,
    Checkpointer,
    CheckpointFactory,
    RunContext,
    hookimpl,
)

from .background import InBackground, Locating
from .local import LocalCheckpointer, LocalCheckpointOptions
from .remote import FsspecCheckpointer, FsspecCheckpointOptions


class _Backend(Protocol):
    """A checkpointer class of this package: built with the process group it is to use."""

    def __call__(
        self,
        *,
        ctx: RunContext,
        directory: Path,
        options: Any,
        group: dist.ProcessGroup | None = None,
    ) -> Locating: ...


def backend(build: _Backend) -> CheckpointFactory:
    """The factory of a backend: ``build``'s checkpointer, wrapped in a background writer
    (:class:`~ups.ckpt.background.InBackground`) when ``options.async_save``."""

    def factory(*, ctx: RunContext, directory: Path, options: Any) -> Checkpointer:
        def make(group: dist.ProcessGroup | None) -> Locating:
            return build(ctx=ctx, directory=directory, options=options, group=group)

        return InBackground(ctx=ctx, build=make) if options.async_save else make(None)

    return factory


local_backend = backend(LocalCheckpointer)


def _sharded(
    *, ctx: RunContext, directory: Path, options: Any, group: dist.ProcessGroup | None = None
) -> Locating:
    """A :class:`~ups.ckpt.sharded.ShardedCheckpointer`, its module (and with it
    torch.distributed.checkpoint) imported only when the ``sharded`` backend is chosen."""
    from .sharded import ShardedCheckpointer

    return ShardedCheckpointer(ctx=ctx, directory=directory, options=options, group=group)


sharded_backend = backend(_sharded)
fsspec_backend = backend(FsspecCheckpointer)


@hookimpl
def ups_checkpoint_backends() -> list[CheckpointBackendPlugin]:
    return [
        CheckpointBackendPlugin(
            name="local",
            factory=local_backend,
            options=LocalCheckpointOptions,
            description="a folder per checkpoint, per-rank files, committed atomically",
        ),
        CheckpointBackendPlugin(
            name="sharded",
            factory=sharded_backend,
            options=LocalCheckpointOptions,
            description="as local, each rank writing its share of the state with torch DCP",
        ),
        CheckpointBackendPlugin(
            name="fsspec",
            factory=fsspec_backend,
            options=FsspecCheckpointOptions,
            description="S3, GCS, Azure or a path through fsspec, committed by a manifest",
        ),
    ]
