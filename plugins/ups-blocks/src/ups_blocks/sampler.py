"""The ``blocks`` sampler: each rank reads one contiguous block of the dataset."""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler

from ups.core import RunContext
from ups_blocks.plugin import BlockOptions


class BlockSampler(Sampler[int]):
    """Indices ``[rank * n, (rank + 1) * n)`` with ``n = size // world_size``.

    Every rank gets the same number of indices, so every rank takes the same number of steps;
    the last ``size % world_size`` samples are never used.
    """

    def __init__(self, size: int, *, ctx: RunContext, seed: int, options: BlockOptions) -> None:
        self.per_rank = size // ctx.world_size
        self.start = ctx.rank * self.per_rank
        self.seed = seed
        self.options = options
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Called by the engine before every epoch; changes the shuffled order."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.per_rank * self.options.repeats

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        for _ in range(self.options.repeats):
            if self.options.shuffle:
                order = torch.randperm(self.per_rank, generator=generator)
            else:
                order = torch.arange(self.per_rank)
            yield from (order + self.start).tolist()


def block_sampler(
    dataset: Sized, *, ctx: RunContext, seed: int, options: BlockOptions
) -> BlockSampler:
    """The factory the engine calls on every rank (it satisfies ``SamplerFactory``)."""
    if len(dataset) < ctx.world_size:
        raise ValueError(f"{len(dataset)} samples cannot be split over {ctx.world_size} ranks")
    return BlockSampler(len(dataset), ctx=ctx, seed=seed, options=options)
