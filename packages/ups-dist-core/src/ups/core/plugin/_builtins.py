"""The built-in plugin (``ups-dist-core``): torch's defaults, so a bare install trains.

Registered like any other plugin, with ``trylast=True`` so a third party can override them.
Importing it, or listing its records, imports no torch (see docs/plugins.md): the factories
import what they build from, or are named with :func:`~ups.core.imported`.
"""

from __future__ import annotations

from collections.abc import Sized
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from .._lazy import imported
from ..checkpoint._best import KeepBest
from ..checkpoint._files import check_writable
from ..config._structure import at_least
from ._markers import hookimpl_default
from ._records import CheckpointBackendPlugin, CommHookPlugin, SamplerPlugin, StrategyPlugin

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DistributedSampler

    from ..dist._context import RunContext


CHECKPOINTS = "checkpoints"
"""The folder, inside the run's folder, that holds the checkpoints of ``simple`` (and of
ups-ckpt's ``local`` and ``sharded``)."""


def probe_checkpoints(*, directory: Path, options: object) -> None:
    """The :class:`~ups.core.plugin._records.CheckpointProbe` of the backends that keep checkpoints in
    the run's ``checkpoints`` folder: that it can be made and written.

    :raises ConfigError: naming ``run.output_dir``, which places it.
    """
    check_writable(Path(directory) / CHECKPOINTS, "run.output_dir", "the checkpoints' folder")


@attrs.frozen(kw_only=True)
class SimpleCheckpointOptions:
    """Options of the ``simple`` backend."""

    keep_last: int | None = attrs.field(default=2, validator=at_least(1))
    """How many of the newest committed checkpoints to keep; older ones are deleted after a
    save commits (``null``: keep all). The checkpoint ``latest`` names is never deleted."""
    keep_every: int | None = attrs.field(default=None, validator=at_least(1))
    """Also keep every checkpoint whose step is a multiple of this (``null``: none kept for it)."""
    keep_best: KeepBest | None = None
    """Also keep the best ``count`` checkpoints by an evaluated value, ``monitor`` (``mode``:
    ``min`` or ``max``), each saved at the evaluation that brought it, never deleted, the
    best named by the pointer ``best`` (``null``: none kept for it); needs ``eval``."""


@attrs.frozen(kw_only=True)
class TorchSamplerOptions:
    """Options of the ``torch`` sampler, as in ``torch.utils.data.DistributedSampler``."""

    shuffle: bool = True
    drop_last: bool = False


def torch_sampler(
    dataset: Sized, *, ctx: RunContext, seed: int, options: TorchSamplerOptions
) -> DistributedSampler[int]:
    """``torch.utils.data.DistributedSampler`` for this rank."""
    from torch.utils.data import DistributedSampler

    return DistributedSampler(
        dataset,  # type: ignore[arg-type]
        num_replicas=ctx.world_size,
        rank=ctx.rank,
        shuffle=options.shuffle,
        seed=seed,
        drop_last=options.drop_last,
    )


class DDPAllReduce:
    """The state of the ``none`` hook: DDP's own all-reduce sends every gradient each step."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        from ..observe._profiling import gradient_bytes

        self._bytes = float(gradient_bytes(ddp))

    def comm_metrics(self, steps: int) -> dict[str, float]:
        """``comm_bytes`` per step: every gradient, in its dtype."""
        return {"comm_bytes": self._bytes}


def no_comm_hook(ddp: DistributedDataParallel, *, ctx: RunContext, options: object) -> DDPAllReduce:
    """Register nothing: DDP all-reduces gradients itself. Its state reports the bytes."""
    return DDPAllReduce(ddp)


@hookimpl_default
def ups_samplers() -> list[SamplerPlugin]:
    return [
        SamplerPlugin(
            name="torch",
            factory=torch_sampler,
            options=TorchSamplerOptions,
            even=True,
            world_invariant=True,
            description="torch.utils.data.DistributedSampler",
        ),
        SamplerPlugin(
            name="shard",
            factory=imported("ups.core.engine._evaluation:shard_sampler"),
            exact=True,
            description="for evaluation: rank r takes samples r, r+W, ..., each exactly once",
        ),
    ]


@hookimpl_default
def ups_comm_hooks() -> list[CommHookPlugin]:
    return [CommHookPlugin(name="none", factory=no_comm_hook, description="DDP's own allreduce")]


@hookimpl_default
def ups_strategies() -> list[StrategyPlugin]:
    return [
        StrategyPlugin(
            name="ddp",
            factory=imported("ups.core.engine._strategy:ddp"),
            description="every rank holds the whole model; DDP all-reduces the gradients",
        )
    ]


@hookimpl_default
def ups_checkpoint_backends() -> list[CheckpointBackendPlugin]:
    return [
        CheckpointBackendPlugin(
            name="simple",
            factory=imported("ups.core.checkpoint._simple:SimpleCheckpointer"),
            options=SimpleCheckpointOptions,
            probe=probe_checkpoints,
            description="a folder per checkpoint (state.pt, rank-<r>.pt, the COMMIT "
            "manifest), written and committed atomically by rank 0",
        )
    ]
