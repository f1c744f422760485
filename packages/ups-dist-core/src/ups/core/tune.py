"""``ups tune``: the largest per-rank batch size that fits in memory on every rank.

Every rank builds the run as ``ups train`` would (in a scratch folder: nothing of the run's own
folder is touched) and :func:`~ups.core.batch_size.find_batch_size` tries optimizer steps of
growing batch sizes, agreeing after each on whether it fitted everywhere.
"""

from __future__ import annotations

import tempfile

import attrs

from .batch_size import find_batch_size
from .config import Config
from .context import RunContext
from .engine import Run
from .plugins import Registry, load_plugins


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
    with tempfile.TemporaryDirectory(prefix="ups-tune-") as scratch:
        config = attrs.evolve(config, run=attrs.evolve(config.run, output_dir=scratch))
        run = Run(config, ctx, registry)
        shard = len(run.sampler) if hasattr(run.sampler, "__len__") else len(run.dataset)
        return find_batch_size(ctx, run.trial_step, start=start, limit=limit or shard)


def tune_here(ctx: RunContext, config: Config, start: int, limit: int | None) -> int:
    """:func:`tune_batch_size` with the installed plugins, as this rank of ``ctx``."""
    return tune_batch_size(config, ctx, load_plugins(), start=start, limit=limit)
