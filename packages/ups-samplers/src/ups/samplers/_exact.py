"""The ``exact`` sampler: every sample to exactly one rank, none padded, for evaluation."""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

import attrs
import torch

from ups.core import RunContext
from ups.core.config import boolean, check_type

from ._epoch import SIZED, EpochSampler, index_dtype, seeded


class ExactDistributedSampler(EpochSampler):
    """Every index of ``dataset`` exactly once over all ranks: rank ``r`` takes positions
    ``r, r + num_replicas, ...`` of the epoch's order (shuffled or not), with no padding, so
    the ranks' shares differ in length by one at most (pytorch/pytorch#25162). For evaluation:
    a loop over uneven shards needs ``Join`` or, as ups's engine does, no collective inside it.
    Resumable and re-shardable like the other samplers (:meth:`state_dict`).

    :param dataset: anything with a length; only ``len(dataset)`` is used.
    :param shuffle: a new order every epoch (seeded by ``seed`` and the epoch).
    :raises TypeError: naming an argument of the wrong type (an int where a bool is due, ...).
    :raises ValueError: naming the value: a rank out of range, fewer than one replica.
    """

    pad = False

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        *,
        chunk_size: int = 8192,
    ) -> None:
        check_type("dataset", dataset, Sized, SIZED)
        super().__init__(num_replicas, rank, seed=seed, drop_last=False, chunk_size=chunk_size)
        self.dataset = dataset
        self.shuffle = boolean("shuffle", shuffle)

    def _pool(self, epoch: int, num_replicas: int, block: int = 1) -> torch.Tensor:
        size = len(self.dataset)
        if not self.shuffle:
            return torch.arange(size, dtype=index_dtype(size))
        return torch.randperm(size, generator=seeded(self.seed, epoch), dtype=index_dtype(size))

    def _pool_size(self, num_replicas: int) -> int:
        return len(self.dataset)

    def _fingerprint(self) -> dict[str, Any]:
        return {"size": len(self.dataset), "shuffle": self.shuffle}


@attrs.frozen(kw_only=True)
class ExactSamplerOptions:
    """Options of the ``exact`` sampler."""

    shuffle: bool = False
    """Visit the samples in a new random order every epoch."""


def exact_sampler(
    dataset: Sized, *, ctx: RunContext, seed: int, options: ExactSamplerOptions
) -> ExactDistributedSampler:
    """The ``exact`` sampler's factory: an :class:`ExactDistributedSampler` for this rank."""
    return ExactDistributedSampler(
        dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=options.shuffle, seed=seed
    )
