"""A sampler's ``len()`` and the epoch it makes: read once, before the epoch's first index is
drawn (a ``__len__`` that counts the indices left gives the whole epoch, however far loader
workers read ahead), and a sampler that yields more than it said is warned about, not
silently cut short."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Sampler

from ups.core import RunContext, SamplerPlugin, hookimpl, load_config, load_plugins
from ups.core.config._config import LoaderConfig
from ups.core.engine import train_rank
from ups.core.engine._loader import Epoch, data_loader
from ups.core.testing import events, run_ranks, tiny_project

NO_AUTOLOAD = {"UPS_DISABLE_PLUGIN_AUTOLOAD": "1"}
WARNING = "the sampler yields more indices than its len() says"


class Countdown(Sampler[int]):
    """This rank's share of the data in order; ``len()`` is what this rank has left of the
    epoch (it shrinks as the sampler yields), or ``claimed`` where given."""

    def __init__(self, size: int, rank: int, world_size: int, claimed: int | None = None) -> None:
        self.indices = list(range(rank, size, world_size))
        self.claimed = claimed
        self.left = len(self.indices)

    def set_epoch(self, epoch: int) -> None:
        self.left = len(self.indices)

    def __len__(self) -> int:
        return self.left if self.claimed is None else self.claimed

    def __iter__(self) -> Iterator[int]:
        for index in self.indices:
            self.left -= 1
            yield index


def countdown(dataset: Sized, *, ctx: RunContext, seed: int, options: Any) -> Countdown:
    return Countdown(len(dataset), ctx.rank, ctx.world_size)


def too_short(dataset: Sized, *, ctx: RunContext, seed: int, options: Any) -> Countdown:
    """Says half of what it yields."""
    return Countdown(len(dataset), ctx.rank, ctx.world_size, claimed=len(dataset) // 4)


class Samplers:
    """The plugin of this module's samplers."""

    @hookimpl
    def ups_samplers(self) -> list[SamplerPlugin]:
        return [
            SamplerPlugin(name="countdown", factory=countdown),
            SamplerPlugin(name="too-short", factory=too_short),
        ]


def _train(ctx: RunContext, config: Path) -> int:
    registry = load_plugins(extra=[("samplers", Samplers())], env=NO_AUTOLOAD)
    return train_rank(load_config(config), ctx, registry).steps


def _project(folder: Path, sampler: str) -> Path:
    # 64 samples, 32 a rank, batches of 4: 8 steps an epoch; two workers read 4 batches ahead
    return tiny_project(
        folder,
        training={"epochs": 2, "batch_size": 4},
        sampler={"name": sampler},
        data={"loader": {"num_workers": 2}},
    )


def test_a_len_that_counts_what_is_left_gives_the_whole_epoch_with_workers(tmp_path: Path) -> None:
    assert run_ranks(_train, 2, _project(tmp_path, "countdown")) == [16, 16]
    logged = events(tmp_path / "runs" / "tiny" / "logs" / "rank0.jsonl")
    assert not [e for e in logged if e["event"].startswith(WARNING)]


def test_a_sampler_longer_than_its_len_is_warned_about_once_naming_it(tmp_path: Path) -> None:
    # len() says 16 indices, 4 batches: the epochs are 4 steps, and the rest is not trained on
    assert run_ranks(_train, 2, _project(tmp_path, "too-short")) == [8, 8]
    for rank in (0, 1):
        logged = events(tmp_path / "runs" / "tiny" / "logs" / f"rank{rank}.jsonl")
        warned = [e for e in logged if e["event"].startswith(WARNING)]
        assert len(warned) == 1, warned  # the first epoch's, not every epoch's
        assert warned[0]["sampler"] == f"{__name__}.Countdown"
        assert (warned[0]["level"], warned[0]["epoch"], warned[0]["batches"]) == ("warning", 1, 4)


@settings(max_examples=60, deadline=None)
@given(
    yielded=st.integers(0, 40),
    short_by=st.integers(0, 40),
    batch_size=st.integers(1, 9),
    shrinks=st.booleans(),
)
def test_an_epoch_counts_len_before_drawing_and_ends_knowing_whether_more_was_left(
    yielded: int, short_by: int, batch_size: int, shrinks: bool
) -> None:
    """Whatever a sampler's ``len()`` says (at most what it yields), the pass counts that
    many indices' batches, and its end tells whether the sampler had batches beyond them."""
    claimed = None if shrinks else max(0, yielded - short_by)
    sampler = Countdown(yielded, 0, 1, claimed=claimed)
    sampler.set_epoch(0)
    loader = data_loader(
        torch.arange(40.0),
        sampler,
        batch_size,
        LoaderConfig(),
        device=torch.device("cpu"),
        seed=0,
        rank=0,
        world_size=1,
    )
    said = yielded if claimed is None else claimed
    epoch = Epoch(loader)
    assert epoch.length == math.ceil(said / batch_size)
    for _ in range(epoch.length):
        next(epoch)
    assert epoch.end() == (math.ceil(yielded / batch_size) > epoch.length)
