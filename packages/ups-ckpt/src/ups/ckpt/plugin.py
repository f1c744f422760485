"""The ``ups-ckpt`` plugin: registers its checkpoint backends with the ups engine."""

from __future__ import annotations

from pathlib import Path

from ups.core import CheckpointBackendPlugin, Checkpointer, RunContext, hookimpl

from .background import InBackground
from .local import LocalCheckpointer, LocalCheckpointOptions
from .remote import FsspecCheckpointer, FsspecCheckpointOptions
from .sharded import ShardedCheckpointer


def local_backend(
    *, ctx: RunContext, directory: Path, options: LocalCheckpointOptions
) -> Checkpointer:
    """The ``local`` backend, writing in the background when ``options.async_save``."""
    if not options.async_save:
        return LocalCheckpointer(ctx=ctx, directory=directory, options=options)
    return InBackground(
        ctx=ctx,
        build=lambda group: LocalCheckpointer(
            ctx=ctx, directory=directory, options=options, group=group
        ),
    )


def fsspec_backend(
    *, ctx: RunContext, directory: Path, options: FsspecCheckpointOptions
) -> Checkpointer:
    """The ``fsspec`` backend, writing in the background when ``options.async_save``."""
    if not options.async_save:
        return FsspecCheckpointer(ctx=ctx, directory=directory, options=options)
    return InBackground(
        ctx=ctx,
        build=lambda group: FsspecCheckpointer(
            ctx=ctx, directory=directory, options=options, group=group
        ),
    )


def sharded_backend(
    *, ctx: RunContext, directory: Path, options: LocalCheckpointOptions
) -> Checkpointer:
    """The ``sharded`` backend, writing in the background when ``options.async_save``."""
    if not options.async_save:
        return ShardedCheckpointer(ctx=ctx, directory=directory, options=options)
    return InBackground(
        ctx=ctx,
        build=lambda group: ShardedCheckpointer(
            ctx=ctx, directory=directory, options=options, group=group
        ),
    )


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
