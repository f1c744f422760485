"""The ``ups-ckpt`` plugin: registers its checkpoint backends with the ups engine.

The backends' modules (and torch) are imported when a backend is built, not with this module.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ups.core import CheckpointBackendPlugin, hookimpl

if TYPE_CHECKING:
    import torch.distributed as dist

    from ups.core import Checkpointer, RunContext
    from ups.core.records import CheckpointFactory

    from .background import Locating


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
        from .background import InBackground

        def make(group: dist.ProcessGroup | None) -> Locating:
            return build(ctx=ctx, directory=directory, options=options, group=group)

        return InBackground(ctx=ctx, build=make) if options.async_save else make(None)

    return factory


def _imported(module: str, name: str) -> _Backend:
    """The checkpointer class ``name`` of this package's ``module``, imported when a backend is
    built (the ``sharded`` one's module imports torch.distributed.checkpoint)."""

    def build(**kwargs: Any) -> Locating:
        built: Locating = getattr(importlib.import_module(module, __package__), name)(**kwargs)
        return built

    return build


local_backend = backend(_imported(".local", "LocalCheckpointer"))
sharded_backend = backend(_imported(".sharded", "ShardedCheckpointer"))
fsspec_backend = backend(_imported(".remote", "FsspecCheckpointer"))


@hookimpl
def ups_checkpoint_backends() -> list[CheckpointBackendPlugin]:
    from .local import LocalCheckpointOptions
    from .remote import FsspecCheckpointOptions

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
