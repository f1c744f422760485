"""The loader's per-sample seeding: which global generators ``data.loader.reseed`` seeds, the
same numbers with or without workers, the training's generators left as they were, and nothing
done to CUDA's."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import Dataset, DistributedSampler

from ups.core.config._config import LoaderConfig
from ups.core.engine._loader import Epoch, data_loader, place_seeds, seed_of

GENERATORS = ("torch", "python", "numpy")


class Draws(Dataset[dict[str, torch.Tensor]]):
    """Each sample draws one number from each global generator."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "index": torch.tensor(index),
            "torch": torch.rand(()),
            "python": torch.tensor(random.random()),
            "numpy": torch.tensor(numpy.random.rand()),
        }


def drawn(
    reseed: tuple[str, ...], workers: int, epoch: int = 1, start: str | None = None
) -> dict[str, dict[int, float]]:
    """Each generator's number for each sample index, read in batches of 5 by one rank of 2
    (``start``: how the workers start, ``data.loader.multiprocessing_context``)."""
    options = LoaderConfig(  # type: ignore[arg-type]
        num_workers=workers, reseed=reseed, multiprocessing_context=start
    )
    sampler = DistributedSampler(range(24), num_replicas=2, rank=1, seed=3)
    sampler.set_epoch(epoch)
    loader = data_loader(
        Draws(), sampler, 5, options, device=torch.device("cpu"), seed=7, rank=1, world_size=2
    )
    loader.batch_sampler.epoch = epoch  # type: ignore[union-attr]
    numbers: dict[str, dict[int, float]] = {name: {} for name in GENERATORS}
    for batch in Epoch(loader):
        for name in GENERATORS:
            numbers[name].update(zip(batch["index"].tolist(), batch[name].tolist(), strict=True))
    return numbers


@pytest.mark.parametrize(
    "reseed", [(), ("torch",), ("python", "numpy"), GENERATORS], ids=lambda r: "+".join(r) or "none"
)
def test_the_generators_reseed_names_draw_the_same_with_or_without_workers(
    reseed: tuple[str, ...],
) -> None:
    seed_all(0)
    alone, workers = drawn(reseed, workers=0), drawn(reseed, workers=2)
    for name in reseed:
        assert alone[name] == workers[name], name
        assert len(set(alone[name].values())) == len(alone[name])  # a number per sample
        assert drawn(reseed, workers=0, epoch=2)[name] != alone[name]  # and per epoch
    for name in set(GENERATORS) - set(reseed):
        seed_all(1)
        assert drawn(reseed, workers=0)[name] != alone[name], f"{name} was seeded"


@pytest.mark.slow
def test_spawned_workers_seed_the_generators_of_their_own_process() -> None:
    # The seeded dataset goes to spawned workers pickled: its generators found again there.
    seed_all(0)
    assert drawn(GENERATORS, workers=2, start="spawn") == drawn(GENERATORS, workers=0)


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)


def test_reading_leaves_the_training_generators_as_they_were() -> None:
    seed_all(5)
    expected = (torch.rand(3).tolist(), random.random(), numpy.random.rand())
    seed_all(5)
    drawn(GENERATORS, workers=0)
    assert (torch.rand(3).tolist(), random.random(), numpy.random.rand()) == expected


def test_reading_seeds_no_cuda_generator() -> None:
    # torch.manual_seed also seeds every CUDA generator: on a rank where CUDA is not yet
    # initialised, each call queues the seeding with a recorded stack (hundreds of
    # microseconds), and on one where it is, it reseeds the training's CUDA generators.
    queued: list[Any] = getattr(torch.cuda, "_queued_calls", [])
    before = len(queued)
    drawn(GENERATORS, workers=0)
    assert len(queued) == before


@given(st.integers(0, 2**63 - 1), st.integers(0, 2**32 - 1 - 4096))
def test_place_seeds_are_63_bit_seeds_distinct_in_their_low_32_bits(base: int, first: int) -> None:
    # the 32 bits torch's CPU generator and NumPy's take from a seed
    seeds = place_seeds(base, range(first, first + 4096))
    assert all(0 <= seed < 2**63 for seed in seeds)
    assert len({seed % 2**32 for seed in seeds}) == len(seeds)


class SometimesDraws(Dataset[torch.Tensor]):
    """Sample ``i`` draws a number from torch's generator when ``i >= first_drawing`` (else
    it is 0); every read is counted."""

    def __init__(self, first_drawing: int) -> None:
        self.first_drawing = first_drawing
        self.reads: list[int] = []

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> torch.Tensor:
        self.reads.append(index)
        return torch.rand(()) if index >= self.first_drawing else torch.tensor(0.0)


@pytest.mark.parametrize("first_drawing", [0, 13, 40], ids=["always", "from 13", "never"])
def test_only_reads_that_draw_are_seeded_and_they_draw_their_places_numbers(
    first_drawing: int,
) -> None:
    dataset = SometimesDraws(first_drawing)
    sampler = DistributedSampler(range(40), num_replicas=1, rank=0, shuffle=False)
    loader = data_loader(
        dataset,
        sampler,
        5,
        LoaderConfig(),
        device=torch.device("cpu"),
        seed=7,
        rank=0,
        world_size=1,
    )
    loader.batch_sampler.epoch = 2  # type: ignore[union-attr]
    values = torch.cat(list(Epoch(loader))).tolist()
    seeds = place_seeds(seed_of(7, 2), range(40))
    expected = [
        torch.rand((), generator=torch.Generator().manual_seed(seed)).item()
        if i >= first_drawing
        else 0.0
        for i, seed in enumerate(seeds)
    ]
    assert values == expected
    # a batch is read once, but the first one that draws: read again, seeded
    again = (
        list(range(first_drawing // 5 * 5, first_drawing // 5 * 5 + 5))
        if first_drawing < 40
        else []
    )
    assert sorted(dataset.reads) == sorted(list(range(40)) + again)


READERS = '''
import os
import torch
from torch.utils.data import Dataset


class Recorded(Dataset):
    """Samples of 4 inputs and their sum; each read appends the reading process's pid to
    ``log``."""

    def __init__(self, log, n=16):
        self.log, self.x = log, torch.randn(n, 4, generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        with open(self.log, "a") as file:
            file.write(f"{os.getpid()}\\n")
        return self.x[index], self.x[index].sum(dim=0, keepdim=True)
'''


def test_evaluation_workers_are_forked_once_a_run_whatever_persistent_workers_says(
    tmp_path: Path,
) -> None:
    """Every fork of a rank's loader workers risks Python's fork hang (CPython gh-112275,
    before 3.11.8): the evaluation set does not change, so its workers are kept between
    evaluations. Six evaluations read from the same two workers."""
    from ups.core import train
    from ups.core.testing import tiny_project

    config = tiny_project(
        tmp_path,
        data={"loader": {"num_workers": 2, "persistent_workers": False}},
        eval={
            "factory": "readers.py:Recorded",
            "options": {"log": str(tmp_path / "eval_readers.txt")},
            "every_steps": 2,
        },
        training={"epochs": 2, "max_steps": 12},
    )
    (tmp_path / "readers.py").write_text(READERS)
    result = train(config)
    assert len(result.eval_metrics) == 6
    readers = (tmp_path / "eval_readers.txt").read_text().split()
    assert len(readers) == 6 * 16
    assert len(set(readers)) == 2, "fresh workers at an evaluation"
