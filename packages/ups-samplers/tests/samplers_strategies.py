"""Hypothesis strategies for ups-samplers' property tests, and the samplers they describe."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal

import attrs
from hypothesis import assume
from hypothesis import strategies as st

from ups.samplers import (
    ExactDistributedSampler,
    MultiTaskDistributedSampler,
    TensorDistributedSampler,
    epoch_length,
    mixture,
)

Mixing = Literal["balanced", "proportional", "temperature", "weights"]
Kind = Literal["tensor", "keyed", "multitask", "exact"]
KINDS: tuple[Kind, ...] = ("tensor", "keyed", "multitask", "exact")
"""``keyed``: the tensor sampler with ``permutation="keyed"``."""


@attrs.frozen
class Case:
    """Arguments of one distributed sampler, for every rank of its world."""

    size: int
    world_size: int
    seed: int
    epoch: int
    shuffle: bool
    drop_last: bool


@st.composite
def cases(draw: st.DrawFn, max_size: int = 2000, max_world_size: int = 9) -> Case:
    """A dataset size (empty and smaller than the world included), a world size, a seed, an
    epoch, and the two options."""
    return Case(
        size=draw(st.integers(0, max_size)),
        world_size=draw(st.integers(1, max_world_size)),
        seed=draw(st.integers(0, 2**40)),
        epoch=draw(st.integers(0, 1000)),
        shuffle=draw(st.booleans()),
        drop_last=draw(st.booleans()),
    )


chunk_sizes = st.integers(1, 64)
"""Chunk sizes small enough that most index lists span several chunks."""


# -- the multitask sampler ------------------------------------------------------------------


@attrs.frozen
class TaskCase:
    """Arguments of one multitask sampler, for every rank of its world."""

    sizes: tuple[int, ...]
    world_size: int
    seed: int
    epoch: int
    mixing: Mixing
    temperature: float
    weights: tuple[float, ...] | None
    epoch_size: Literal["sum", "max"] | int
    shuffle: bool
    drop_last: bool
    batch_size: int = 1
    """Each rank's batch: the multitask sampler deals its stream in blocks of ``W x batch``."""

    @property
    def offsets(self) -> list[int]:
        """Where each task's indices start."""
        return [0, *itertools.accumulate(self.sizes)][:-1]

    def task_of(self, index: int) -> int:
        """The task whose index range holds ``index`` (-1 when none does)."""
        for task, (start, size) in enumerate(zip(self.offsets, self.sizes, strict=True)):
            if start <= index < start + size:
                return task
        return -1


MAX_EPOCH_LENGTH = 6000
"""Epochs longer than this (``max`` with a tiny share) make slow examples: left out."""


EPOCH_SIZES: st.SearchStrategy[Literal["sum", "max"] | int] = st.one_of(
    st.sampled_from(["sum", "max"]), st.integers(1, 2000)
)


@st.composite
def task_cases(
    draw: st.DrawFn,
    max_tasks: int = 8,
    max_task_size: int = 300,
    max_world_size: int = 8,
    mixings: Sequence[Mixing] = ("balanced", "proportional", "temperature", "weights"),
    epoch_sizes: st.SearchStrategy[Literal["sum", "max"] | int] = EPOCH_SIZES,
) -> TaskCase:
    """1 to ``max_tasks`` tasks (tiny ones often: they are the hard cases for mixing and
    interleaving), a world, a seed, an epoch, a mixing with its temperature or weights (some
    zero, never all), an epoch size (``sum``, ``max`` or a number) and the two options."""
    num_tasks = draw(st.integers(1, max_tasks))
    size = st.one_of(st.integers(1, 5), st.integers(1, max_task_size))
    sizes = tuple(draw(st.lists(size, min_size=num_tasks, max_size=num_tasks)))
    mixing = draw(st.sampled_from(mixings))
    weights = None
    if mixing == "weights":
        weight = st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.0, 3.0])
        weights = tuple(draw(st.lists(weight, min_size=num_tasks, max_size=num_tasks)))
        if sum(weights) == 0:
            weights = (*weights[:-1], 1.0)
    temperature = draw(st.floats(0.5, 8.0)) if mixing == "temperature" else 2.0
    epoch_size = draw(epoch_sizes)
    shares = mixture(sizes, mixing, temperature=temperature, weights=weights)
    assume(epoch_length(sizes, shares, epoch_size) <= MAX_EPOCH_LENGTH)
    return TaskCase(
        sizes=sizes,
        world_size=draw(st.integers(1, max_world_size)),
        seed=draw(st.integers(0, 2**40)),
        epoch=draw(st.integers(0, 50)),
        mixing=mixing,
        temperature=temperature,
        weights=weights,
        epoch_size=epoch_size,
        shuffle=draw(st.booleans()),
        drop_last=draw(st.booleans()),
        batch_size=draw(st.integers(1, 6)),
    )


def multitask(
    case: TaskCase, rank: int, num_replicas: int | None = None, chunk_size: int = 8192
) -> MultiTaskDistributedSampler:
    """The multitask sampler of ``case`` for ``rank`` (of ``num_replicas``, default the
    case's world), set to the case's epoch."""
    sampler = MultiTaskDistributedSampler(
        list(case.sizes),
        num_replicas=case.world_size if num_replicas is None else num_replicas,
        rank=rank,
        mixing=case.mixing,
        temperature=case.temperature,
        weights=None if case.weights is None else list(case.weights),
        epoch_size=case.epoch_size,
        shuffle=case.shuffle,
        seed=case.seed,
        drop_last=case.drop_last,
        batch_size=case.batch_size,
        chunk_size=chunk_size,
    )
    sampler.set_epoch(case.epoch)
    return sampler


# -- any of the three samplers --------------------------------------------------------------


@attrs.frozen
class Setup:
    """One of the samplers with its arguments, built for any world and rank."""

    kind: Kind
    case: Case | TaskCase

    @property
    def world_size(self) -> int:
        return self.case.world_size

    @property
    def pads(self) -> bool:
        """Whether the sampler pads (or drops) so that every rank has one length."""
        return self.kind != "exact"

    @property
    def drop_last(self) -> bool:
        """Whether the sampler drops its epoch's tail (``max`` epochs never do)."""
        if isinstance(self.case, TaskCase) and self.case.epoch_size == "max":
            return False
        return self.kind != "exact" and self.case.drop_last

    def build(
        self, num_replicas: int, rank: int, chunk_size: int = 8192
    ) -> TensorDistributedSampler | MultiTaskDistributedSampler | ExactDistributedSampler:
        """The sampler for ``rank`` of ``num_replicas``, set to the case's epoch."""
        case = self.case
        if isinstance(case, TaskCase):
            return multitask(case, rank, num_replicas, chunk_size)
        sampler: TensorDistributedSampler | ExactDistributedSampler
        if self.kind in ("tensor", "keyed"):
            sampler = TensorDistributedSampler(
                range(case.size),
                num_replicas=num_replicas,
                rank=rank,
                shuffle=case.shuffle,
                seed=case.seed,
                drop_last=case.drop_last,
                chunk_size=chunk_size,
                permutation="keyed" if self.kind == "keyed" else "torch",
            )
        else:
            sampler = ExactDistributedSampler(
                range(case.size),
                num_replicas=num_replicas,
                rank=rank,
                shuffle=case.shuffle,
                seed=case.seed,
                chunk_size=chunk_size,
            )
        sampler.set_epoch(case.epoch)
        return sampler


@st.composite
def setups(draw: st.DrawFn, kinds: Sequence[Kind] = KINDS) -> Setup:
    """A sampler of one of ``kinds``, with small data (resuming re-deals it several times)."""
    kind = draw(st.sampled_from(kinds))
    if kind == "multitask":
        case: Case | TaskCase = draw(task_cases(max_tasks=5, max_task_size=120))
    else:
        case = draw(cases(max_size=400, max_world_size=8))
    return Setup(kind, case)


world_sizes = st.integers(1, 8)
"""World sizes to resume on."""
