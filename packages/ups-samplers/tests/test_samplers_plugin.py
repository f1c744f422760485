"""The samplers through the plugin contract: the registry, the config, real ranks."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
from torch.utils.data import Dataset, DistributedSampler

from ups.core import ConfigError, RunContext, SamplerPlugin, load_plugins, train
from ups.core.testing import read_checkpoint, run_ranks, tiny_project
from ups.samplers import TensorDistributedSampler, TensorSamplerOptions, plugin


def test_the_entry_point_registers_the_tensor_sampler() -> None:
    registry = load_plugins()
    provided = registry.records("sampler")["tensor"]
    assert provided.plugin == "ups-samplers"
    assert registry.get("sampler", "tensor", "sampler.name").options is TensorSamplerOptions
    info = next(p for p in registry.plugins if p.name == "ups-samplers")
    assert (info.distribution, info.status) == ("ups-samplers", "enabled")


def test_the_config_options_reach_the_sampler() -> None:
    registry = load_plugins(
        extra=[("ups-samplers", plugin)], env={"UPS_DISABLE_PLUGIN_AUTOLOAD": "1"}
    )
    record, options = registry.select("sampler", "tensor", {"drop_last": True}, "sampler")
    assert isinstance(record, SamplerPlugin)
    assert options == TensorSamplerOptions(shuffle=True, drop_last=True)
    sampler = record.factory(
        range(10), ctx=RunContext(rank=2, world_size=3), seed=5, options=options
    )
    assert isinstance(sampler, TensorDistributedSampler)
    assert (sampler.rank, sampler.num_replicas, sampler.seed, len(sampler)) == (2, 3, 5, 3)


def test_an_unknown_option_is_a_config_error_naming_the_key() -> None:
    registry = load_plugins(
        extra=[("ups-samplers", plugin)], env={"UPS_DISABLE_PLUGIN_AUTOLOAD": "1"}
    )
    with pytest.raises(ConfigError, match=r"sampler\.options\.shufle.*did you mean"):
        registry.select("sampler", "tensor", {"shufle": False}, "sampler")


def indices_of_this_rank(ctx: RunContext, size: int) -> tuple[list[int], ...]:
    """This rank's indices: from the plugin's factory, from a sampler that asks the process
    group for its world and rank, and from torch's sampler."""
    options = TensorSamplerOptions()
    factory = plugin.ups_samplers()[0].factory
    from_factory = factory(range(size), ctx=ctx, seed=7, options=options)
    from_group = TensorDistributedSampler(range(size), seed=7)
    reference: DistributedSampler[int] = DistributedSampler(
        cast("Dataset[int]", range(size)), seed=7
    )
    return list(from_factory), list(from_group), list(reference)


def indices_of_each_size(ctx: RunContext, sizes: list[int]) -> list[tuple[list[int], ...]]:
    return [indices_of_this_rank(ctx, size) for size in sizes]


@pytest.mark.slow
def test_two_ranks_get_disjoint_shares_of_the_dataset() -> None:
    even, odd = zip(*run_ranks(indices_of_each_size, 2, [100, 101]), strict=True)
    for (rank0, group0, torch0), (rank1, group1, torch1) in (even, odd):
        assert (group0, group1) == (rank0, rank1)
        assert (torch0, torch1) == (rank0, rank1)
    (rank0, _, _), (rank1, _, _) = even
    assert len(rank0) == len(rank1) == 50
    assert sorted(rank0 + rank1) == list(range(100))
    # 101 samples: rank 1's last index is padding, wrapped around to the first index of all.
    (rank0, _, _), (rank1, _, _) = odd
    assert len(rank0) == len(rank1) == 51
    assert sorted(rank0 + rank1[:-1]) == list(range(101))
    assert rank1[-1] == rank0[0]


@pytest.mark.slow
def test_a_config_trains_with_the_tensor_sampler(tmp_path: Path) -> None:
    config = tiny_project(
        tmp_path,
        data={"options": {"n": 65}},
        training={"epochs": 2, "batch_size": 16, "lr": 0.01},
        sampler={"name": "tensor", "options": {"drop_last": True}},
    )
    result = train(config, nproc=2)
    # 65 samples, drop_last: 32 a rank, 2 batches of 16 an epoch (3 batches with padding).
    assert (result.steps, result.epochs) == (4, 2)


EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "pde_multitask.py"


@pytest.mark.slow
def test_the_example_trains_with_the_multitask_and_exact_samplers(tmp_path: Path) -> None:
    tasks = ["advection", "diffusion", "burgers"]
    data = {"samples_per_task": 40, "grid": 16}
    config = tiny_project(
        tmp_path,
        model={"factory": f"{EXAMPLE}:build_model", "options": {"grid": 16, "width": 16}},
        data={"factory": f"{EXAMPLE}:build_dataset", "options": data, "tasks": tasks},
        eval={
            "factory": f"{EXAMPLE}:build_dataset",
            "options": {**data, "samples_per_task": 11, "seed": 1},
            "sampler": {"name": "exact", "options": {"shuffle": True}},
        },
        training={"epochs": 1, "batch_size": 6, "max_steps": 4},
        sampler={"name": "multitask", "options": {"mixing": "balanced", "epoch_size": 60}},
    )
    result = train(config, nproc=2)
    assert result.steps == 4
    assert {f"loss/{task}" for task in tasks} <= set(result.metrics[-1])
    assert result.eval_metrics[-1]["samples"] == 33  # every evaluation sample once
    # The checkpoint holds where the sampler is: 2 ranks, 4 batches of 6 taken by each.
    assert result.checkpoint is not None
    state = read_checkpoint(result.checkpoint)["state"]["sampler"]
    assert state["sampler"] == "MultiTaskDistributedSampler"
    # (world size, samples taken per rank, the batch its blocks are dealt in)
    assert (state["epoch"], state["segments"], state["length"]) == (0, [[2, 24, 6]], 60)
