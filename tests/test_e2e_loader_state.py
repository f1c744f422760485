"""The engine's data loader with worker processes: the sampler state it hands a checkpoint is
the state as of the batches the steps consumed, not of those the workers prefetched, for
ups-samplers' samplers; a sampler resumed from it goes on with exactly the batches not taken."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from ups.core.config._config import LoaderConfig
from ups.core.engine._loader import Epoch, data_loader
from ups.samplers import MultiTaskDistributedSampler, TensorDistributedSampler


class Indices(Dataset[int]):
    """Each sample is its own index."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def sampler(kind: str, size: int) -> Any:
    if kind == "tensor":
        return TensorDistributedSampler(range(size), num_replicas=2, rank=1, seed=3)
    return MultiTaskDistributedSampler([size - 40, 40], num_replicas=2, rank=1, seed=3)


def loader(source: Any, workers: int) -> Any:
    options = LoaderConfig(num_workers=workers, prefetch_factor=4 if workers else None)
    return data_loader(
        Indices(200), source, 5, options, device=torch.device("cpu"), seed=0, rank=1, world_size=2
    )


@pytest.mark.parametrize("kind", ["tensor", "multitask"])
@pytest.mark.parametrize("taken", [1, 7, 19])
def test_the_state_counts_the_batches_taken_not_those_prefetched(kind: str, taken: int) -> None:
    source = sampler(kind, 200)
    source.set_epoch(2)
    epoch = Epoch(loader(source, workers=2))
    seen = [next(epoch).tolist() for _ in range(taken)]
    state = epoch.sampler_state
    assert source.state_dict() != state  # the workers did read ahead of the steps

    # without workers, the same batches leave the same state
    alone = sampler(kind, 200)
    alone.set_epoch(2)
    plain = Epoch(loader(alone, workers=0))
    assert [next(plain).tolist() for _ in range(taken)] == seen
    assert plain.sampler_state == state

    # resumed from it, a sampler goes on with exactly the rest of the epoch
    rest = list(epoch)
    resumed = sampler(kind, 200)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)
    assert [b.tolist() for b in Epoch(loader(resumed, workers=2))] == [b.tolist() for b in rest]
