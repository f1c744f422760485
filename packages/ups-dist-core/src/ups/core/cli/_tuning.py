"""What each rank of ``ups tune`` does: find the largest per-rank batch size that fits in
memory on every rank.

Every rank builds what a training step needs as ``ups train`` would (no evaluation data, no
checkpoint backend, no run folder: nothing of the run's own folder is touched; the config's
strategy, so a sharded model's trials hold its shards) and
:func:`~ups.core.engine._largest_batch.find_batch_size` tries optimizer steps of growing batch sizes,
agreeing after each on whether it fitted everywhere.
"""

from __future__ import annotations

from ..config._config import Config
from ..dist._context import RunContext
from ..dist._rng import seed_all
from ..dist._watchdog import Watchdog
from ..engine._largest_batch import find_batch_size
from ..engine._parts import build_parts
from ..engine._run import sample_batch, stepping
from ..plugin._manager import Registry, load_plugins


def tune_batch_size(
    config: Config,
    ctx: RunContext,
    registry: Registry,
    *,
    start: int = 1,
    limit: int | None = None,
) -> int:
    """Return the largest ``training.batch_size`` (per rank) whose optimizer step fits on every
    rank, from ``start`` up to ``limit`` (default: this rank's share of the data). The same
    number on every rank; every rank calls this together."""
    seed_all(config.run.seed)
    size = config.training.batch_size
    parts = build_parts(config, ctx, registry, batch_size=size, to_train=False)
    stepper = stepping(config, ctx, parts, Watchdog(ctx)).stepper
    collate = parts.loader.collate_fn

    def trial_step(batch_size: int) -> None:
        """One optimizer step: on this rank alone (no collective: through the bare module),
        or on every rank together under a strategy without local passes (FSDP)."""
        stepper.trial(sample_batch(parts.dataset, collate, batch_size))

    sampler, dataset = parts.sampler, parts.dataset
    shard = len(sampler) if hasattr(sampler, "__len__") else len(dataset)
    return find_batch_size(ctx, trial_step, start=start, limit=limit or shard)


def tune_here(ctx: RunContext, config: Config, start: int, limit: int | None) -> int:
    """:func:`tune_batch_size` with the installed plugins, as this rank of ``ctx``."""
    return tune_batch_size(config, ctx, load_plugins(), start=start, limit=limit)
