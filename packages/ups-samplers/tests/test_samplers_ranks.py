"""The samplers on real process groups (gloo ranks), and the plugin's registry entries."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import ConcatDataset, TensorDataset

from ups.core import ConfigError, RunContext, SamplerPlugin, load_plugins
from ups.core.testing import run_ranks
from ups.samplers import (
    ExactDistributedSampler,
    ExactSamplerOptions,
    MultiTaskDistributedSampler,
    MultiTaskSamplerOptions,
    TensorDistributedSampler,
    multitask_sampler,
)

SIZES = [37, 5, 120, 1]
"""Four tasks: a tiny one, a one-sample one, one larger than the rest together."""

MIXINGS: list[dict[str, Any]] = [
    {"mixing": "proportional"},
    {"mixing": "balanced", "epoch_size": "max"},
    {"mixing": "temperature", "temperature": 3.0, "epoch_size": 101},
    {"mixing": "weights", "weights": [2.0, 0.0, 1.0, 1.0], "drop_last": True},
]


def gathered(drawn: object) -> list[Any]:
    """What every rank drew, from every rank (``all_gather_object``)."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, drawn)
    return every


def draw_on_this_rank(ctx: RunContext, epoch: int) -> dict[str, Any]:
    """Each sampler built for this rank from the process group, its epoch drawn, and what
    every rank drew."""
    assert (ctx.rank, ctx.world_size) == (dist.get_rank(), dist.get_world_size())
    multitask = []
    for options in MIXINGS:
        sampler = MultiTaskDistributedSampler(SIZES, seed=11, batch_size=BATCH, **options)
        sampler.set_epoch(epoch)
        assert (sampler.rank, sampler.num_replicas) == (ctx.rank, ctx.world_size)
        multitask.append(
            {"indices": gathered(list(sampler)), "len": len(sampler), "counts": sampler.counts()}
        )
    tensor = TensorDistributedSampler(range(sum(SIZES)), seed=11)
    tensor.set_epoch(epoch)
    exact = ExactDistributedSampler(range(sum(SIZES)), shuffle=True, seed=11)
    exact.set_epoch(epoch)
    return {
        "multitask": multitask,
        "tensor": gathered(list(tensor)),
        "exact": gathered(list(exact)),
    }


OFFSETS = [0, 37, 42, 162]
BATCH = 4


def task_of(index: int) -> int:
    """The task of a dataset index (an index out of range fails the test)."""
    assert 0 <= index < sum(SIZES)
    return max(t for t, start in enumerate(OFFSETS) if start <= index)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_ranks_of_a_process_group_partition_the_epoch(world_size: int) -> None:
    """seed 001's validate_distributed_sampling, as a test: every rank builds its sampler from
    the process group, and what the ranks drew, gathered, is the epoch one process draws,
    batch for global batch, every task dealt evenly in each."""
    epoch = 0
    results = run_ranks(draw_on_this_rank, world_size, epoch)
    # Every rank gathered the same thing: what each rank drew.
    assert all(result == results[0] for result in results)
    # And what rank r drew is what a sampler for rank r, built here, draws.
    result = results[0]
    for options, drawn in zip(MIXINGS, result["multitask"], strict=True):
        shares = drawn["indices"]
        for rank, share in enumerate(shares):
            sampler = MultiTaskDistributedSampler(
                SIZES, world_size, rank, seed=11, batch_size=BATCH, **options
            )
            sampler.set_epoch(epoch)
            assert share == list(sampler)
        counts = drawn["counts"]
        assert [len(share) for share in shares] == [drawn["len"]] * world_size
        assert abs(drawn["len"] * world_size - sum(counts)) < world_size  # padded or dropped
        alone = list(MultiTaskDistributedSampler(SIZES, 1, 0, seed=11, **options))
        union = Counter(i for share in shares for i in share)
        assert (union - Counter(alone)).total() + (Counter(alone) - union).total() < world_size
        # Global batch t of the ranks is batch t of one process of world_size x BATCH, and
        # each rank holds every task's count in it over the ranks, within one.
        block = world_size * BATCH
        for t in range(sum(counts) // block):
            batches = [share[t * BATCH : (t + 1) * BATCH] for share in shares]
            assert Counter(i for batch in batches for i in batch) == Counter(
                alone[t * block : (t + 1) * block]
            )
            together = Counter(task_of(i) for batch in batches for i in batch)
            for batch in batches:
                mine = Counter(task_of(i) for i in batch)
                assert all(abs(mine[k] - c / world_size) < 1 for k, c in together.items())
        # Epoch 0 reads each task's stream from its start: its samples, each as often as
        # the others, give or take one; within one pass over a task, none twice.
        times_alone = Counter(alone)
        for t, (start, size) in enumerate(zip(OFFSETS, SIZES, strict=True)):
            times = [times_alone[i] for i in range(start, start + size)]
            assert sum(times) == counts[t]
            assert max(times) - min(times) <= 1
    total = sum(SIZES)
    tensor = result["tensor"]
    assert len({len(share) for share in tensor}) == 1
    padded = [i for share in tensor for i in share]
    assert set(padded) == set(range(total))
    assert len(padded) - total == -total % world_size
    exact = result["exact"]
    assert sorted(i for share in exact for i in share) == list(range(total))
    assert max(map(len, exact)) - min(map(len, exact)) <= 1


# -- the plugin -----------------------------------------------------------------------------


def test_the_plugin_registers_multitask_for_training_and_exact_for_evaluation() -> None:
    records = load_plugins().records("sampler")  # listed; imported when selected (get)
    assert records["multitask"].plugin == records["exact"].plugin == "ups-samplers"
    registry = load_plugins()
    multitask, exact, tensor = (
        registry.get("sampler", name, "sampler.name") for name in ("multitask", "exact", "tensor")
    )
    assert isinstance(multitask, SamplerPlugin)
    assert isinstance(exact, SamplerPlugin)
    assert isinstance(tensor, SamplerPlugin)
    assert multitask.options is MultiTaskSamplerOptions
    assert exact.options is ExactSamplerOptions
    assert (multitask.multi_task, multitask.exact) == (True, False)
    assert (exact.multi_task, exact.exact) == (False, True)
    assert (tensor.multi_task, tensor.exact) == (False, False)


def tasks(*sizes: int) -> ConcatDataset[tuple[torch.Tensor, ...]]:
    return ConcatDataset([TensorDataset(torch.arange(n)) for n in sizes])


def test_the_config_options_reach_the_multitask_sampler() -> None:
    registry = load_plugins()
    record, options = registry.select(
        "sampler", "multitask", {"mixing": "balanced", "epoch_size": 12}, "sampler"
    )
    data = tasks(3, 9)
    sampler = record.factory(data, ctx=RunContext(rank=1, world_size=2), seed=4, options=options)
    assert isinstance(sampler, MultiTaskDistributedSampler)
    assert (sampler.rank, sampler.num_replicas, sampler.seed) == (1, 2, 4)
    assert sampler.counts() == [6, 6]
    assert len(sampler) == 6


def test_the_multitask_factory_needs_a_concat_dataset() -> None:
    with pytest.raises(ConfigError, match=r"^data\.factory: returns a range.*ConcatDataset"):
        multitask_sampler(
            range(10),
            ctx=RunContext(rank=0, world_size=1),
            seed=0,
            options=MultiTaskSamplerOptions(),
        )


def test_a_bad_multitask_option_is_a_config_error_naming_sampler_options() -> None:
    registry = load_plugins()
    bad = {"mixing": "temperature", "temperature": 0}
    with pytest.raises(
        ConfigError, match=r"^sampler\.options: temperature: must be .* > 0, not 0(\.0)?$"
    ):
        registry.select("sampler", "multitask", bad, "sampler")
    # Weights are checked against the tasks only when the sampler meets the data.
    _, options = registry.select(
        "sampler", "multitask", {"mixing": "weights", "weights": [1.0]}, "sampler"
    )
    data = tasks(3, 9)
    with pytest.raises(
        ConfigError, match=r"^sampler\.options: weights: 1 given for 2 tasks"
    ) as raised:
        multitask_sampler(data, ctx=RunContext(rank=0, world_size=1), seed=0, options=options)
    assert raised.value.path == "sampler.options"
