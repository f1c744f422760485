"""Exact evaluation: every sample counted once over all ranks, none padded, no hang on uneven
shards (pytorch/pytorch#25162).

Each rank evaluates its shard with the bare model (not through DDP, so no collective runs inside
the forward passes and shards of different lengths cannot deadlock, as ``Join`` would
otherwise be needed for), then one all-reduce adds up the per-task loss sums and counts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler

from .context import RunContext
from .metrics import LossWindow, per_sample_losses


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


def evaluate(
    model: nn.Module,
    loader: DataLoader[Any],
    ctx: RunContext,
    *,
    loss: str,
    tasks: Sequence[str],
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> dict[str, float]:
    """The loss (and ``loss/<task>``) over the whole evaluation set, the same on every rank.
    A collective: every rank calls it, whatever the length of its shard."""
    window = LossWindow(tasks, ctx.device)
    training = model.training
    model.eval()
    with torch.no_grad():
        for batch in loader:
            inputs, targets = batch[0].to(ctx.device), batch[1].to(ctx.device)
            with autocast():
                outputs = model(inputs)
            window.add(
                per_sample_losses(loss, outputs, targets), batch[2] if len(batch) > 2 else None
            )
    model.train(training)
    return window.report(ctx).result()
