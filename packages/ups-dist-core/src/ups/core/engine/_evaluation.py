"""Exact evaluation: every sample counted once over all ranks, none padded, no hang on uneven
shards (pytorch/pytorch#25162).

Each rank evaluates its shard with the training step on the bare model (not through DDP, so no collective runs inside
the forward passes and shards of different lengths cannot deadlock, as ``Join`` would
otherwise be needed for), then one all-reduce adds up the per-task loss sums and counts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence, Sized
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler

from ..dist._context import RunContext
from ..observe._metrics import LossWindow
from ..observe._step_metrics import UserMetrics
from ._update import Forward


class ShardSampler(Sampler[int]):
    """Rank ``rank``'s shard of ``size`` samples: ``rank, rank + world, ...``; shards differ in
    length by one at most, and together hold every index exactly once."""

    def __init__(self, size: int, rank: int, world_size: int) -> None:
        self.indices = range(rank, size, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def shard_sampler(dataset: Sized, *, ctx: RunContext, seed: int, options: object) -> ShardSampler:
    """The built-in ``shard`` evaluation sampler: this rank's :class:`ShardSampler`."""
    return ShardSampler(len(dataset), ctx.rank, ctx.world_size)


def val_named(metrics: Mapping[str, float]) -> dict[str, float]:
    """An evaluation's ``metrics`` by the names the ``eval`` log event gives them, which plateau
    rules and schedulers monitor: ``val_loss``, ``val_loss/<task>``, ``val_<metric>``."""
    return {f"val_{name}": value for name, value in metrics.items()}


def evaluate(
    model: nn.Module,
    loader: DataLoader[Any],
    forward: Forward,
    tasks: Sequence[str],
    reduce: Mapping[str, str],
) -> dict[str, float]:
    """The loss (and ``loss/<task>``) and the step's metrics over the whole evaluation set,
    the same on every rank: ``forward`` (the training step's) on the bare ``model`` in eval
    mode, without gradients. A collective: every rank calls it, whatever its shard's length."""
    ctx = forward.ctx
    window = LossWindow(tasks, ctx.device)
    metrics = UserMetrics(reduce, window.tasks, ctx.device)
    training = model.training
    model.eval()
    with torch.no_grad():
        for batch in loader:
            _, taken = forward(model, batch)
            taken.count(window, metrics)
    model.train(training)
    result = window.report(ctx).result()
    return result | metrics.report(ctx).result()
