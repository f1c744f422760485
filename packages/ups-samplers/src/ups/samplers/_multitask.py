"""The ``multitask`` sampler: a distributed sampler over several tasks, mixed as the user says.

torch's ``DistributedSampler`` over a ``ConcatDataset`` treats the tasks as one flat list: how
often each task is seen is an accident of its size, and a rank's share of a task is left to
chance. This sampler decides, per epoch, how many samples each task gets (its *mixing*), draws
them from the task without replacement within a pass over it, deals them so that every rank's
count of every task is within one of its share, and interleaves the tasks on every rank so
that any stretch of a rank's samples (a batch) holds the mix, not runs of one task.

Each task is an endless stream of passes over its samples, each pass a fresh permutation
(drawn for the seed, the task and the pass, one that gives any of its positions on its own, so
each rank draws only its share of the epoch). An epoch's samples of a task are its count ``w``
in the epoch on one rank, the stream's positions ``e·w`` to ``(e+1)·w - 1`` for epoch ``e``: a
small task over-sampled runs through several passes, none repeating a sample within a pass; a
large task under-sampled moves on through its pass, epoch by epoch; a task whose count is its
size reads each pass in one epoch. On more ranks the epoch is rounded to a multiple of them by
repeating samples of the same epoch (as torch's ``DistributedSampler`` pads), never by drawing
ahead from the next, so the epochs stay where they are whatever the world size.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import torch
from torch.utils.data import ConcatDataset

from ups.core import ConfigError, RunContext

from ._epoch import EpochSampler, Lookup, apportion, index_dtype, positions
from ._permute import shuffled

Mixing = Literal["balanced", "proportional", "temperature", "weights"]
EpochSize = Literal["sum", "max"] | int

MIXINGS: tuple[str, ...] = ("balanced", "proportional", "temperature", "weights")


def task_sizes(tasks: Sequence[int] | ConcatDataset[Any]) -> list[int]:
    """The tasks' sizes: given, or those of a ``ConcatDataset``'s parts (one per task)."""
    if isinstance(tasks, ConcatDataset):
        return [len(part) for part in tasks.datasets]  # type: ignore[arg-type]
    return [int(size) for size in tasks]


def check_mixing(
    mixing: str, temperature: float, weights: Sequence[float] | None, epoch_size: object
) -> None:
    """Check the mixing options on their own (the task sizes aside).

    :raises ValueError: naming the bad option and value, and what is allowed.
    """
    if mixing not in MIXINGS:
        raise ValueError(f"mixing: {mixing!r} is not one of {', '.join(MIXINGS)}")
    if (weights is not None) != (mixing == "weights"):
        raise ValueError("weights: give them with mixing 'weights', and only then")
    if not temperature > 0 or math.isinf(temperature):
        raise ValueError(f"temperature: {temperature!r} is not allowed; it must be > 0")
    if weights is not None:
        bad = [w for w in weights if not (math.isfinite(w) and w >= 0)]
        if bad:
            raise ValueError(f"weights: {bad[0]!r} is not allowed; weights are finite and >= 0")
        if not sum(weights) > 0:
            raise ValueError(f"weights: {list(weights)} add up to 0; at least one must be > 0")
    if epoch_size not in ("sum", "max") and (
        isinstance(epoch_size, bool) or not isinstance(epoch_size, int) or epoch_size < 1
    ):
        raise ValueError(f"epoch_size: {epoch_size!r} is not allowed; 'sum', 'max' or an int >= 1")


def mixture(
    sizes: Sequence[int],
    mixing: Mixing,
    *,
    temperature: float = 2.0,
    weights: Sequence[float] | None = None,
) -> list[float]:
    """The share of the epoch each task gets (they add up to 1).

    ``balanced``: the same for every task; ``proportional``: by size; ``temperature``: by
    ``size ** (1 / temperature)`` (1 is proportional; higher flattens towards balanced);
    ``weights``: by the given weights.

    :raises ValueError: naming the bad value.
    """
    check_mixing(mixing, temperature, weights, "sum")
    if mixing == "balanced":
        raw = [1.0] * len(sizes)
    elif mixing == "proportional":
        raw = [float(size) for size in sizes]
    elif mixing == "temperature":
        raw = [size ** (1 / temperature) for size in sizes]
    else:
        assert weights is not None
        raw = [float(w) for w in weights]
        if len(raw) != len(sizes):
            raise ValueError(f"weights: {len(raw)} given for {len(sizes)} tasks; give one a task")
    whole = sum(raw)
    return [w / whole for w in raw]


def epoch_length(sizes: Sequence[int], shares: Sequence[float], epoch_size: EpochSize) -> int:
    """Samples in an epoch: ``sum`` of the task sizes, ``max``: enough that every task with
    a share is seen in full at least once, or the number given."""
    check_mixing("balanced", 1.0, None, epoch_size)
    if epoch_size == "sum":
        return sum(sizes)
    if epoch_size == "max":
        return max(math.ceil(n / p - 1e-9) for n, p in zip(sizes, shares, strict=True) if p > 0)
    assert isinstance(epoch_size, int)
    return epoch_size


class MultiTaskDistributedSampler(EpochSampler):
    """A distributed sampler over tasks mixed by ``mixing``, balanced across ranks.

    The dataset is the tasks one after the other, as a ``ConcatDataset`` lays them out: task
    ``t``'s samples are indices ``offset[t] .. offset[t] + size[t] - 1``.

    Per epoch, task ``t`` gets ``count[t]`` of the epoch's samples: its share of the epoch
    length (:func:`mixture`, :func:`epoch_length`), the length rounded to a multiple of the
    ranks (up; down with ``drop_last``, except for ``epoch_size="max"``, which also goes on up
    until every task is seen in full), whole counts by largest remainder, so each is within one
    of its exact share. Which samples of a task an epoch reads is its count on one rank
    (``counts(1)``): the rounding repeats the first of them, or leaves out the last, so that
    with ``proportional`` and ``sum`` every epoch is one pass over every task. Rank ``r``
    gets every ``num_replicas``-th sample of the epoch's task-by-task list, so its count of
    each task is within one of ``count[t] / num_replicas``, and all ranks get the same number. On each rank the tasks are
    interleaved evenly (the largest task spread evenly over the rank's samples, then the next
    over the slots left, and so on; tasks of one count take turns), so any stretch of a rank's
    samples holds every task in proportion: within one with two tasks; we measured at most
    2.4 off with up to 11 tasks.

    :param tasks: the tasks' sizes, or a ``ConcatDataset`` of one dataset per task.
    :param mixing: ``balanced``, ``proportional``, ``temperature`` or ``weights``.
    :param temperature: for ``temperature``: shares by ``size ** (1 / temperature)``.
    :param weights: for ``weights``: one per task, >= 0, not all 0.
    :param epoch_size: ``sum`` (the tasks' total), ``max`` (every task seen in full at least
        once) or a number of samples.
    :param shuffle: draw each pass over a task in a random order (else in index order).
    :param drop_last: round the epoch down to a multiple of the ranks, not up (not with
        ``epoch_size="max"``).
    :raises ValueError: naming the bad value: no tasks, a task of size < 1, a bad mixing,
        temperature, weight or epoch size, a rank out of range.
    """

    def __init__(
        self,
        tasks: Sequence[int] | ConcatDataset[Any],
        num_replicas: int | None = None,
        rank: int | None = None,
        *,
        mixing: Mixing = "proportional",
        temperature: float = 2.0,
        weights: Sequence[float] | None = None,
        epoch_size: EpochSize = "sum",
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        chunk_size: int = 8192,
    ) -> None:
        super().__init__(num_replicas, rank, seed=seed, drop_last=drop_last, chunk_size=chunk_size)
        self.sizes = task_sizes(tasks)
        if not self.sizes:
            raise ValueError("tasks: none given; give at least one task")
        for t, size in enumerate(self.sizes):
            if size < 1:
                raise ValueError(f"tasks: task {t} has size {size}; every task needs a sample")
        self.mixing = mixing
        self.shares = mixture(self.sizes, mixing, temperature=temperature, weights=weights)
        self.temperature = temperature
        self.epoch_size = epoch_size
        self.length = epoch_length(self.sizes, self.shares, epoch_size)
        self.shuffle = shuffle
        self._windows = [max(count, 1) for count in self.counts(1)]
        """Each task's stretch of its stream an epoch reads: its count on one rank (at least 1,
        for a task that only the rounding to the world draws)."""
        ends = torch.tensor(self.sizes, dtype=torch.int64).cumsum(0)
        self.offsets = [0, *ends[:-1].tolist()]
        self._ends = ends
        self._dtype = index_dtype(int(ends[-1]))

    def counts(self, num_replicas: int | None = None) -> list[int]:
        """Samples of each task in an epoch on ``num_replicas`` ranks (default: this world)."""
        return apportion(self._pool_size(num_replicas or self.num_replicas), self.shares)

    def _pool_size(self, num_replicas: int) -> int:
        if self.epoch_size != "max":
            return self._total(self.length, num_replicas)
        # Round up, whatever drop_last says, and on until every task is seen in full.
        size = -(-self.length // num_replicas) * num_replicas
        while any(
            c < n and p > 0
            for c, n, p in zip(apportion(size, self.shares), self.sizes, self.shares, strict=True)
        ):
            size += num_replicas
        return size

    def _pool(self, epoch: int, num_replicas: int) -> torch.Tensor:
        return self._lookup(epoch, num_replicas)(slice(None))

    def _lookup(self, epoch: int, num_replicas: int) -> Lookup:
        return functools.partial(self._pool_at, epoch, num_replicas)

    def _pool_at(self, epoch: int, num_replicas: int, where: slice) -> torch.Tensor:
        """The epoch's samples at positions ``where`` of its task-by-task list: task ``t``'s
        ``c`` samples are the positions ``epoch·w .. (epoch + 1)·w - 1`` of its stream of
        passes (``w``: its count on one rank), from the start again past ``w`` (the padding to
        the world), each pass a permutation drawn for (seed, task, pass) that gives any
        position on its own (:func:`shuffled`), so a rank draws its share and nothing else."""
        counts = self.counts(num_replicas)
        start, stop, step = where.indices(sum(counts))
        parts = []
        for t, (end, count) in enumerate(zip(itertools.accumulate(counts), counts, strict=True)):
            # The positions of the slice in task t's part, end - count .. end - 1.
            first = max(start, start + -(-(end - count - start) // step) * step)
            stream = positions(first, min(stop, end), step, torch.int64)
            stream -= end - count
            window = self._windows[t]
            if count > window:
                stream %= window
            stream += epoch * window
            drawn = stream % self.sizes[t]
            if self.shuffle and len(stream):
                passes = stream // self.sizes[t]
                drawn = shuffled(drawn, self.sizes[t], (self.seed, t), passes)
            parts.append((drawn + self.offsets[t]).to(self._dtype))
        return torch.cat(parts)

    def task_of(self, indices: torch.Tensor) -> torch.Tensor:
        """The task of each dataset index."""
        return torch.searchsorted(self._ends, indices.to(torch.int64), right=True)

    def _arrange(self, share: torch.Tensor) -> torch.Tensor:
        """Interleave the tasks on this rank, largest first, each spread evenly over the
        slots the larger ones left free.

        Tasks with the same count here go together, taking turns. The ``k``-th of ``c``
        samples goes to the free slot ``floor((k + 1/2) / c · f)`` of the ``f`` still free,
        so each task is spread evenly, and the free slots left for the smaller tasks are too.
        One vectorised pass over the free slots per distinct count.
        """
        n = len(share)
        if n == 0:
            return share
        labels = self.task_of(share)
        if bool((labels[1:] < labels[:-1]).any()):  # a resumed epoch's rest: group by task
            order = torch.argsort(labels, stable=True)
            share, labels = share[order], labels[order]
        counts = torch.bincount(labels, minlength=len(self.sizes)).tolist()
        starts = [0, *itertools.accumulate(counts)][:-1]
        free = torch.arange(n, dtype=index_dtype(n))
        arranged = torch.empty_like(share)
        for count in sorted({c for c in counts if c}, reverse=True):
            tasks = [t for t, c in enumerate(counts) if c == count]
            g, f = len(tasks), len(free)
            picked = torch.arange(g * count, dtype=torch.int64).mul_(2).add_(1)
            picked = picked.mul_(f).div_(2 * g * count, rounding_mode="floor")
            if g == 1:
                arranged[free[picked]] = share[starts[tasks[0]] : starts[tasks[0]] + count]
            else:
                turns = torch.arange(g * count, dtype=torch.int64)
                first = torch.tensor([starts[t] for t in tasks], dtype=torch.int64)
                arranged[free[picked]] = share[first[turns % g] + turns // g]
            kept = torch.ones(f, dtype=torch.bool)
            kept[picked] = False
            free = free[kept]
        return arranged

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "sizes": list(self.sizes),
            "shares": list(self.shares),
            "length": self.length,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(tasks={len(self.sizes)}, mixing={self.mixing!r}, "
            f"length={self.length}, num_replicas={self.num_replicas}, rank={self.rank}, "
            f"seed={self.seed}, epoch={self.epoch})"
        )


@attrs.frozen(kw_only=True)
class MultiTaskSamplerOptions:
    """Options of the ``multitask`` sampler (see :class:`MultiTaskDistributedSampler`)."""

    mixing: Mixing = "proportional"
    """``balanced`` (every task as often), ``proportional`` (by size), ``temperature``
    (by ``size ** (1 / temperature)``) or ``weights`` (by ``weights``)."""
    temperature: float = 2.0
    """For ``mixing: temperature``; 1 is proportional, higher is closer to balanced."""
    weights: tuple[float, ...] | None = None
    """For ``mixing: weights``: one per task, in task order."""
    epoch_size: Literal["sum", "max"] | int = "sum"
    """Samples an epoch: ``sum`` of the task sizes, ``max`` (every task seen in full at least
    once), or a number."""
    shuffle: bool = True
    """Draw each pass over a task in a new random order."""
    drop_last: bool = False
    """Round the epoch down to a multiple of the ranks instead of up (not with ``max``)."""

    def __attrs_post_init__(self) -> None:
        check_mixing(self.mixing, self.temperature, self.weights, self.epoch_size)


def multitask_sampler(
    dataset: Any, *, ctx: RunContext, seed: int, options: MultiTaskSamplerOptions
) -> MultiTaskDistributedSampler:
    """The ``multitask`` sampler's factory: the data must be a ``ConcatDataset``, one part a
    task (as ``data.tasks`` names them)."""
    if not isinstance(dataset, ConcatDataset):
        raise ConfigError(
            "data.factory",
            f"returns a {type(dataset).__name__}; sampler 'multitask' needs a ConcatDataset, "
            "one dataset per task",
        )
    try:
        return MultiTaskDistributedSampler(
            dataset,
            num_replicas=ctx.world_size,
            rank=ctx.rank,
            seed=seed,
            **attrs.asdict(options),
        )
    except ValueError as error:
        raise ConfigError("sampler.options", str(error)) from None
