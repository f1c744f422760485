"""The ``tensor`` sampler: ``torch.utils.data.DistributedSampler`` with its index list a tensor.

torch's sampler turns the whole permutation into a Python list every epoch (``randperm(n)
.tolist()``), pads and slices that list: tens of bytes per sample of the whole dataset, on
every rank. This one keeps the permutation a tensor (int32 where the dataset allows), takes
this rank's share with a strided slice, and hands indices out lazily, a chunk at a time. It
draws the permutation exactly as torch does, so for the same arguments it yields the same
indices in the same order; and it can resume mid-epoch (``state_dict``).

``torch.randperm`` builds the whole permutation, on every rank, whatever its share. With
``permutation="keyed"`` the epoch's order is instead a keyed permutation that gives any of its
positions on its own (:func:`~ups.samplers._permute.shuffled`): each rank draws its share and
nothing else, O(N / W) time and memory, at the price of an order other than torch's.
"""

from __future__ import annotations

import functools
import math
import typing
from collections.abc import Sized
from typing import Any, Literal

import attrs
import torch

from ups.core import RunContext
from ups.core.config import boolean, check_type, choice

from ._epoch import SIZED, EpochSampler, Lookup, index_dtype, positions
from ._permute import shuffled

Permutation = Literal["torch", "keyed"]


@attrs.frozen(kw_only=True)
class TensorSamplerOptions:
    """Options of the ``tensor`` sampler, as in ``torch.utils.data.DistributedSampler``."""

    shuffle: bool = True
    """Shuffle the indices, differently each epoch (seeded by ``run.seed + epoch``)."""
    drop_last: bool = False
    """Drop the tail that does not divide evenly among the ranks, instead of padding by
    repeating indices from the start."""
    permutation: Permutation = "torch"
    """``torch``: torch's very order (``randperm``, the whole dataset on every rank);
    ``keyed``: another order, of which each rank draws only its share (much faster for large
    datasets)."""


class TensorDistributedSampler(EpochSampler):
    """A drop-in for :class:`torch.utils.data.DistributedSampler` that keeps indices in tensors.

    Same arguments, same attributes (``num_replicas``, ``rank``, ``epoch``, ``seed``,
    ``shuffle``, ``drop_last``, ``num_samples``, ``total_size``), same :meth:`set_epoch` and
    ``len()``, and the same indices: the permutation is ``torch.randperm`` drawn from a
    ``torch.Generator`` seeded with ``seed + epoch``; without ``drop_last`` the index list is
    padded by wrapping around to its start; rank ``r`` takes every ``num_replicas``-th index
    from position ``r``. Beyond torch's: :meth:`state_dict` and :meth:`load_state_dict`, and
    ``permutation="keyed"``, a shuffle of which each rank draws only its own share.

    :param dataset: anything with a length; only ``len(dataset)`` is used.
    :param num_replicas: the number of ranks; default: the default process group's size.
    :param rank: this rank, ``0 <= rank < num_replicas``; default: the default group's rank.
    :param chunk_size: how many indices iteration converts to Python ints at a time.
    :param permutation: ``torch`` (torch's order) or ``keyed`` (drawn per rank, O(N / W)).
    :raises TypeError: naming an argument of the wrong type (``shuffle="no"``, ``seed="0"``).
    :raises ValueError: naming the value: a rank out of range, fewer than one replica, another
        permutation.
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
        permutation: Permutation = "torch",
    ) -> None:
        check_type("dataset", dataset, Sized, SIZED)
        super().__init__(num_replicas, rank, seed=seed, drop_last=drop_last, chunk_size=chunk_size)
        self.dataset = dataset
        self.shuffle = boolean("shuffle", shuffle)
        self.permutation = choice("permutation", permutation, typing.get_args(Permutation))
        size = len(dataset)
        if drop_last and size % self.num_replicas != 0:
            # The largest multiple of num_replicas not above the dataset's size (as torch).
            self.num_samples = math.ceil((size - self.num_replicas) / self.num_replicas)
        else:
            self.num_samples = math.ceil(size / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def _pool(self, epoch: int, num_replicas: int, block: int = 1) -> torch.Tensor:
        size = len(self.dataset)
        dtype = index_dtype(size)
        if not self.shuffle:
            return torch.arange(size, dtype=dtype)
        if self.permutation == "keyed":
            return self._keyed_at(epoch, slice(None))
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(size, generator=generator, dtype=dtype)

    def _lookup(self, epoch: int, num_replicas: int, block: int = 1) -> Lookup:
        if self.shuffle and self.permutation == "keyed":
            return functools.partial(self._keyed_at, epoch)
        return super()._lookup(epoch, num_replicas, block)

    def _keyed_at(self, epoch: int, where: slice) -> torch.Tensor:
        """The positions of ``where`` of the epoch's keyed permutation."""
        size = len(self.dataset)
        drawn = positions(*where.indices(size), torch.int64)
        return shuffled(drawn, size, (self.seed,), epoch).to(index_dtype(size))

    def _pool_size(self, num_replicas: int) -> int:
        return len(self.dataset)

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "size": len(self.dataset),
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "permutation": self.permutation,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={len(self.dataset)}, num_replicas={self.num_replicas}, "
            f"rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, "
            f"drop_last={self.drop_last}, epoch={self.epoch})"
        )


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
        permutation=options.permutation,
    )
