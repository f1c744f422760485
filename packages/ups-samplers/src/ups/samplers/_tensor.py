"""The ``tensor`` sampler: ``torch.utils.data.DistributedSampler`` with its index list a tensor.

torch's sampler turns the whole permutation into a Python list every epoch (``randperm(n)
.tolist()``), pads and slices that list: tens of bytes per sample of the whole dataset, on
every rank. This one keeps the permutation a tensor (int32 where the dataset allows), takes
this rank's share with a strided slice, and hands indices out lazily, a chunk at a time. It
draws the permutation exactly as torch does, so for the same arguments it yields the same
indices in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import attrs
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ups.core import RunContext

_INT32_MAX = torch.iinfo(torch.int32).max


@attrs.frozen(kw_only=True)
class TensorSamplerOptions:
    """Options of the ``tensor`` sampler, as in ``torch.utils.data.DistributedSampler``."""

    shuffle: bool = True
    """Shuffle the indices, differently each epoch (seeded by ``run.seed + epoch``)."""
    drop_last: bool = False
    """Drop the tail that does not divide evenly among the ranks, instead of padding by
    repeating indices from the start."""


class TensorDistributedSampler(Sampler[int]):
    """A drop-in for :class:`torch.utils.data.DistributedSampler` that keeps indices in tensors.

    Same arguments, same attributes (``num_replicas``, ``rank``, ``epoch``, ``seed``,
    ``shuffle``, ``drop_last``, ``num_samples``, ``total_size``), same :meth:`set_epoch` and
    ``len()``, and the same indices: the permutation is ``torch.randperm`` drawn from a
    ``torch.Generator`` seeded with ``seed + epoch``; without ``drop_last`` the index list is
    padded by wrapping around to its start; rank ``r`` takes every ``num_replicas``-th index
    from position ``r``.

    :param dataset: anything with a length; only ``len(dataset)`` is used.
    :param num_replicas: the number of ranks; default: the default process group's size.
    :param rank: this rank, ``0 <= rank < num_replicas``; default: the default group's rank.
    :param chunk_size: how many indices iteration converts to Python ints at a time.
    :raises ValueError: for a rank out of range, or fewer than one replica.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        chunk_size: int = 8192,
    ) -> None:
        if num_replicas is None:
            num_replicas = dist.get_world_size()
        if rank is None:
            rank = dist.get_rank()
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
            )
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.chunk_size = chunk_size
        self.epoch = 0
        size = len(dataset)
        if drop_last and size % num_replicas != 0:
            # The largest multiple of num_replicas not above the dataset's size (as torch).
            self.num_samples = math.ceil((size - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(size / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which with ``seed`` decides the order when shuffling.

        Call it before iterating, every epoch, with the same value on every rank.
        """
        self.epoch = epoch

    def indices(self) -> torch.Tensor:
        """This rank's indices for the current epoch, in order, as a 1-D integer tensor.

        Its dtype is int32 when every index fits, else int64. Without padding, it is a strided
        view of the epoch's permutation.
        """
        size = len(self.dataset)
        dtype = torch.int32 if size - 1 <= _INT32_MAX else torch.int64
        stop = min(size, self.total_size)
        order: torch.Tensor | None = None
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(size, generator=generator, dtype=dtype)
            mine = order[self.rank : stop : self.num_replicas]
        else:
            mine = _positions(self.rank, stop, self.num_replicas, dtype)
        if self.total_size <= size:
            return mine
        # Padding: positions size..total_size-1 repeat the order from its start, as torch's
        # sampler does. They are fewer than num_replicas, so this rank gets at most one.
        first = size + (self.rank - size) % self.num_replicas
        wrapped = _positions(first, self.total_size, self.num_replicas, torch.int64) % size
        tail = wrapped if order is None else order[wrapped]
        return torch.cat((mine, tail.to(dtype)))

    def __iter__(self) -> Iterator[int]:
        # The epoch's indices are drawn now, as torch's sampler does, not at the first next().
        return _ints(self.indices(), self.chunk_size)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={len(self.dataset)}, num_replicas={self.num_replicas}, "
            f"rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, "
            f"drop_last={self.drop_last}, epoch={self.epoch})"
        )


def _positions(start: int, stop: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    """``start, start + step, ...`` below ``stop``, like ``range`` (empty when start >= stop)."""
    return torch.arange(start, max(start, stop), step, dtype=dtype)


def _ints(indices: torch.Tensor, chunk_size: int) -> Iterator[int]:
    for chunk in torch.split(indices, chunk_size):
        yield from chunk.tolist()


def tensor_sampler(
    dataset: Sized, *, ctx: RunContext, seed: int, options: TensorSamplerOptions
) -> TensorDistributedSampler:
    """The ``tensor`` sampler's factory: a :class:`TensorDistributedSampler` for this rank."""
    return TensorDistributedSampler(
        dataset,
        num_replicas=ctx.world_size,
        rank=ctx.rank,
        shuffle=options.shuffle,
        seed=seed,
        drop_last=options.drop_last,
    )
