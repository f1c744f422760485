"""The ``ups-ckpt`` plugin: registers its checkpoint backends with the ups engine.

The backends' modules (and torch; ``sharded``: torch.distributed.checkpoint) are imported
when a backend is built, not when listed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ups.core import CheckpointBackendPlugin, hookimpl, imported, probe_checkpoints

if TYPE_CHECKING:
    import torch.distributed as dist

    from ups.core import Checkpointer, CheckpointFactory, RunContext

    from ._background import Locating


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
    (:class:`~ups.ckpt.InBackground`) when ``options.async_save``."""

    def factory(*, ctx: RunContext, directory: Path, options: Any) -> Checkpointer:
        from ._background import InBackground

        def make(group: dist.ProcessGroup | None) -> Locating:
            return build(ctx=ctx, directory=directory, options=options, group=group)

        return InBackground(ctx=ctx, build=make) if options.async_save else make(None)

    return factory


local_backend = backend(imported("ups.ckpt:LocalCheckpointer"))
sharded_backend = backend(imported("ups.ckpt:ShardedCheckpointer"))
fsspec_backend = backend(imported("ups.ckpt:FsspecCheckpointer"))


@hookimpl
def ups_checkpoint_backends() -> list[CheckpointBackendPlugin]:
    return [
        CheckpointBackendPlugin(
            name="local",
            factory=local_backend,
            options=imported("ups.ckpt:LocalCheckpointOptions"),
            probe=probe_checkpoints,
            description="a folder per checkpoint, per-rank files, committed atomically",
        ),
        CheckpointBackendPlugin(
            name="sharded",
            factory=sharded_backend,
            options=imported("ups.ckpt:LocalCheckpointOptions"),
            probe=probe_checkpoints,
            description="as local, each rank writing its share of the state with torch DCP",
        ),
        CheckpointBackendPlugin(
            name="fsspec",
            factory=fsspec_backend,
            options=imported("ups.ckpt:FsspecCheckpointOptions"),
            probe=imported("ups.ckpt._store:probe_store"),
            description="S3, GCS, Azure or a path through fsspec, committed by a manifest",
        ),
    ]
