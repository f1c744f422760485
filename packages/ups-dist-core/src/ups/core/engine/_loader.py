"""The data pipeline: a ``DataLoader`` with workers, pinned memory and a collate of the user's,
whose sampler state and randomness stay exact however far its workers read ahead.

Two things make that so:

- **The sampler's state counts what the steps consumed.** Workers prefetch: the loader draws
  indices ``num_workers x prefetch_factor`` batches ahead of the step, so a sampler asked for
  its state counts batches no step has trained on. :class:`StepBatches`, the loader's batch
  sampler, keeps the sampler's state as it was after each batch it drew; the engine takes them
  in order as it consumes batches (:meth:`Epoch.__next__`), so a checkpoint holds the state of
  the last batch a step took. Any sampler with ``state_dict`` gets this, not only ups's.
- **Data-side randomness is seeded per sample,** from ``(run.seed, epoch, place)``, the
  sample's place in the epoch (the sampler's ``places``, or counted as torch's sampler deals:
  :meth:`StepBatches._places`), the same on any number of ranks, in the worker that
  reads it (or, without workers, around the read, the training RNG untouched): a random
  transform in ``__getitem__`` draws the same numbers whatever ``num_workers``, whether the
  workers persist, after a resume mid-epoch, and on any number of ranks. The generators so
  seeded are ``data.loader.reseed``'s (torch's CPU generator by default: :data:`RESEED`).
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import math
import multiprocessing
import operator
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy
import structlog
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info

from ..config._config import FactoryConfig, LoaderConfig
from ..config._errors import ConfigError
from ..config._user_code import load_object
from ..launch._lifeline import die_with_loader

log = structlog.get_logger()


def build_dataset(section: FactoryConfig, key: str) -> Any:
    """Call the ``section`` (``data`` or ``eval``) factory with its options; check that it
    returns a map-style dataset.

    :raises ConfigError: naming ``<key>.factory`` for an iterable dataset or a non-dataset.
    """
    dataset = load_object(section.factory, f"{key}.factory")(**section.options)
    if isinstance(dataset, IterableDataset):
        raise ConfigError(
            f"{key}.factory",
            f"returned an iterable dataset ({type(dataset).__name__}); ups needs a map-style "
            "dataset (__len__ and __getitem__), which samplers can deal to ranks and resume",
        )
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ConfigError(
            f"{key}.factory", f"returned {type(dataset).__name__}, not a map-style dataset"
        )
    return dataset


def seed_of(*parts: int) -> int:
    """A seed in ``[0, 2**63)`` mixed from ``parts`` (nearby parts give unrelated seeds)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


_GOLDEN = 0x9E3779B97F4A7C15
"""An odd multiplier: ``place * _GOLDEN`` differs for every place in the low 32 bits, the bits
torch's CPU generator (a Mersenne Twister seeded with 32 bits) and NumPy's take."""
_MASK = 2**63 - 1


def place_seeds(base: int, places: Iterable[int]) -> list[int]:
    """The seeds in ``[0, 2**63)`` of the samples at ``places`` of an epoch whose seed is
    ``base``: a Weyl sequence, distinct in their low 32 bits for every place under ``2**32``
    (the Mersenne Twister's seeding scrambles neighbouring seeds, as torch relies on for its
    workers' ``base_seed + id``); one multiplication a sample read."""
    return [(base + place * _GOLDEN) & _MASK for place in places]


class Generator(NamedTuple):
    """A global generator: how to seed it, get and set its state, and compare two states."""

    seed: Callable[[int], object]
    get_state: Callable[[], Any]
    set_state: Callable[[Any], object]
    same: Callable[[Any, Any], bool]


def _same_numpy(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two states of NumPy's legacy global generator are one."""
    return a[2:] == b[2:] and bool(numpy.array_equal(a[1], b[1]))


RESEED: dict[str, Generator] = {
    "torch": Generator(
        torch.default_generator.manual_seed,
        torch.default_generator.get_state,
        torch.default_generator.set_state,
        lambda a, b: a.numpy().tobytes() == b.numpy().tobytes(),  # half torch.equal's cost
    ),
    "python": Generator(random.seed, random.getstate, random.setstate, operator.eq),
    "numpy": Generator(
        lambda seed: numpy.random.seed(seed % 2**32),
        numpy.random.get_state,
        numpy.random.set_state,
        _same_numpy,
    ),
}
"""The global generators ``data.loader.reseed`` may name. Only torch's CPU generator: a CUDA
rank's generators are the training's."""


class SeededBatch(list[int]):
    """A batch's indices, with the seed of each sample's data-side randomness: the epoch's
    seed ``base`` (``None``: none to seed) and the samples' ``places`` in the epoch."""

    base: int | None = None
    places: Sequence[int] = ()

    @property
    def seeds(self) -> list[int] | None:
        """Each sample's seed (worked out when a read needs them: :func:`place_seeds`)."""
        return None if self.base is None else place_seeds(self.base, self.places)


class StepBatches(Sampler[list[int]]):
    """The loader's batch sampler: ``batch_size`` indices at a time from ``sampler`` (the last
    batch may be short), each a :class:`SeededBatch`; it keeps the sampler's state after each
    batch it draws, for :meth:`consumed` to hand out in order. A sampler with
    ``set_batch_size`` is told the batch size before each iteration.

    :meth:`start` says which epoch the next iteration is, and where in it to begin.
    ``seed``: the run's, or ``None`` for batches without seeds.
    """

    def __init__(
        self, sampler: Any, batch_size: int, seed: int | None, rank: int, world_size: int
    ) -> None:
        self.sampler, self.batch_size = sampler, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.epoch = self.first = self.skip = 0
        self.stateful = callable(getattr(sampler, "state_dict", None))
        self.overran = False
        """Whether a pass found the sampler yielding more than its ``len()`` (:meth:`Epoch.end`)."""
        self._states: collections.deque[tuple[dict[str, Any], list[int]]] = collections.deque()
        self.indices: list[int] = []
        """The indices of the batch :meth:`consumed` last handed out."""

    def start(self, epoch: int, *, first: int = 0, skip: int = 0) -> None:
        """Make the next iteration epoch ``epoch`` (counted from 0), its batches numbered from
        ``first`` (those of the epoch taken before a resume, from a sampler's state), the
        first ``skip`` passed over unread (those taken before, by a sampler without a state)."""
        self.epoch, self.first, self.skip = epoch, first, skip

    def __len__(self) -> int:
        return max(0, math.ceil(len(self.sampler) / self.batch_size) - self.skip)

    def tell_batch_size(self) -> None:
        """Give a sampler with ``set_batch_size`` the batch size (before each iteration)."""
        resize = getattr(self.sampler, "set_batch_size", None)
        if callable(resize):
            resize(self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        self._states.clear()
        self.tell_batch_size()
        indices = iter(self.sampler)
        drawn = 0
        base = None if self.seed is None else seed_of(self.seed, self.epoch)
        for number in itertools.count(self.first):
            batch = SeededBatch(itertools.islice(indices, self.batch_size))
            if not batch:
                return
            drawn += len(batch)
            if number < self.first + self.skip:
                continue
            if base is not None:
                batch.base = base
                batch.places = self._places(
                    drawn - len(batch), number * self.batch_size, len(batch)
                )
            self._states.append((self.sampler.state_dict() if self.stateful else {}, batch))
            yield batch

    def _places(self, drawn: int, before: int, count: int) -> Sequence[int]:
        """The places in the epoch of the ``count`` samples of a batch: from the sampler's
        ``places(first, count)`` when it has one (``drawn``: samples it yielded before the
        batch in this iteration), else as torch's ``DistributedSampler`` deals, rank ``r`` of
        ``W`` taking places ``r, r + W, ...`` (``before``: the rank's samples of the epoch
        before the batch, counting those taken before a resume)."""
        own = getattr(self.sampler, "places", None)
        if callable(own):
            return [int(place) for place in own(drawn, count)]
        first, step = before * self.world_size + self.rank, self.world_size
        return range(first, first + count * step, step)

    def consumed(self) -> dict[str, Any]:
        """The sampler's state after the oldest batch drawn and not yet consumed (``{}`` for a
        sampler without a state), that batch's indices kept as :attr:`indices`; call it once
        for each batch a step takes."""
        state, self.indices = self._states.popleft()
        return state


class SeededData(Dataset[Any]):
    """``dataset``, read a batch at a time with the generators ``reseed`` names (of
    :data:`RESEED`) seeded for each sample (see the module's text).

    Seeding costs a few microseconds a sample, for nothing where the dataset draws no random
    number. So a batch is first read as it comes; if no generator moved meanwhile, no sample
    drew from them, and the batch is what seeded reads would have given. The first batch that
    moves one is read again, seeded, and so is every batch after it (in this process: each
    worker finds out for itself).
    """

    def __init__(self, dataset: Any, reseed: tuple[str, ...]) -> None:
        self.dataset = dataset
        self._many: Callable[[list[int]], list[Any]] | None = getattr(dataset, "__getitems__", None)
        self._reseed = reseed
        self._generators = [RESEED[name] for name in reseed]
        self.draws = False
        """Whether a read of the dataset was seen to draw from the generators."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (to spawned workers) with the generators' names: they are the process's
        own generators, found again in the process that unpickles it."""
        return {k: v for k, v in self.__dict__.items() if k != "_generators"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._generators = [RESEED[name] for name in self._reseed]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """The samples at ``indices``, each read with its seed set (a dataset that reads a
        batch at once, with its own ``__getitems__``, with its first sample's)."""
        generators = self._generators
        if not generators or getattr(indices, "base", None) is None:
            return self._read(indices)
        saved = [generator.get_state() for generator in generators]
        if not self.draws:
            samples = self._read(indices)
            if len(generators) == 1:  # the usual (torch's alone): no generator expressions
                if generators[0].same(saved[0], generators[0].get_state()):
                    return samples
            elif all(g.same(a, g.get_state()) for g, a in zip(generators, saved, strict=True)):
                return samples
            self.draws = True
        try:
            return self._seeded(indices, indices.seeds)  # type: ignore[attr-defined]
        finally:
            # In the main process, the generators are put back afterwards, so that reading
            # data leaves the training's randomness as it was (a worker's are its own).
            if get_worker_info() is None:
                for generator, state in zip(self._generators, saved, strict=True):
                    generator.set_state(state)

    def _read(self, indices: list[int]) -> list[Any]:
        return self._many(list(indices)) if self._many else [self.dataset[i] for i in indices]

    def _seeded(self, indices: list[int], seeds: list[int]) -> list[Any]:
        """The samples at ``indices``, each read with the generators seeded by its seed."""
        if self._many is not None:
            self._seed(seeds[0])
            return self._many(list(indices))
        samples = []
        for index, seed in zip(indices, seeds, strict=True):
            self._seed(seed)
            samples.append(self.dataset[index])
        return samples

    def _seed(self, seed: int) -> None:
        for generator in self._generators:
            generator.seed(seed)


class Epoch:
    """One pass over a loader whose batch sampler is :class:`StepBatches`: yields batches and
    knows the sampler's state as of the last one yielded, and how many it yielded.

    :attr:`length`, the batches the pass counts, is the loader's ``len()`` read before the pass
    draws its first index: a sampler whose ``__len__`` counts the indices it has left (it
    shrinks as the iteration goes) gives its whole pass, however far workers read ahead.
    """

    def __init__(self, loader: DataLoader[Any], keep: int = 1) -> None:
        assert isinstance(loader.batch_sampler, StepBatches)
        self._batches = loader.batch_sampler
        self._batches.tell_batch_size()  # a sampler's length may depend on it
        self.length = len(loader)
        """Batches of this pass, as the sampler's ``len()`` counts them."""
        self._iterator = iter(loader)
        self.taken = self._batches.first + self._batches.skip
        """Batches of the epoch taken, counting those before a resume."""
        self.sampler_state: dict[str, Any] = {}
        self.recent: collections.deque[list[int]] = collections.deque(maxlen=keep)
        """The indices of the last ``keep`` batches yielded (a step's micro-batches)."""

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        batch = next(self._iterator)
        self.sampler_state = self._batches.consumed()
        self.recent.append(self._batches.indices)
        self.taken += 1
        return batch

    def pass_over(self, count: int) -> None:
        """Take the next ``count`` batches without training on them (a quarantined step's)."""
        collections.deque(itertools.islice(self, count), maxlen=0)

    def end(self) -> bool:
        """Once the :attr:`length` batches are taken, whether the sampler yields more than its
        ``len()`` said, whose indices the epoch leaves unread; warn of it, once per loader.

        One batch asked for, once a pass: none to read where the sampler is as long as it says.
        """
        if next(self._iterator, _END) is _END:
            return False
        batches = self._batches
        if not batches.overran:
            batches.overran = True
            sampler = type(batches.sampler)
            log.warning(
                "the sampler yields more indices than its len() says: each epoch ends after "
                "the batches len() counts, and the rest is not trained on; make __len__ "
                "return what __iter__ yields (docs/hooks.md#ups_samplers)",
                sampler=f"{sampler.__module__}.{sampler.__qualname__}",
                epoch=batches.epoch + 1,
                batches=self.length,
            )
        return True


_END = object()
"""What ``next`` gives for a loader that has no batch left."""


def data_loader(
    dataset: Any,
    sampler: Any,
    batch_size: int,
    options: LoaderConfig,
    *,
    device: torch.device,
    seed: int,
    rank: int,
    world_size: int,
) -> DataLoader[Any]:
    """A loader of ``dataset`` in ``batch_size`` batches from ``sampler``, as ``options``
    (``data.loader``) say: workers, pinned memory (by default when ``device`` is CUDA), the
    user's collate. Its batch sampler is a :class:`StepBatches`; iterate it with :class:`Epoch`."""
    workers = options.num_workers
    pin = options.pin_memory if options.pin_memory is not None else device.type == "cuda"
    extra: dict[str, Any] = {}
    if workers:
        # The platform's default start method, not this process's: a rank forked from ups's
        # forkserver (ups.core.train) has the forkserver's, and a dataset from a file.py:
        # factory does not unpickle in a forkserver's worker.
        platform_default = multiprocessing.get_all_start_methods()[0]
        extra = {
            "persistent_workers": options.persistent_workers,
            "prefetch_factor": options.prefetch_factor,
            "multiprocessing_context": options.multiprocessing_context or platform_default,
            "worker_init_fn": die_with_loader,  # a worker ends with its rank, even stuck
        }
    collate = options.collate and load_object(options.collate, "data.loader.collate")
    seeded = seed if options.reseed else None
    return DataLoader(
        SeededData(dataset, options.reseed),
        batch_sampler=StepBatches(sampler, batch_size, seeded, rank, world_size),
        num_workers=workers,
        collate_fn=collate or None,
        pin_memory=pin and torch.cuda.is_available(),
        generator=torch.Generator().manual_seed(seed_of(seed, rank)),
        **extra,
    )
