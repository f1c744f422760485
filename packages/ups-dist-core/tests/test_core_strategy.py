"""The strategy family's contract as the engine enforces it: a strategy whose record says DDP
comm hooks do not apply refuses one (naming what to use instead), one that cannot run a
micro-batch on a rank alone refuses ``training.skip_oom: true`` and turns ``auto`` off, in
``ups validate`` and on the ranks alike; an unknown strategy names the ones there are."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
from test_core_weighting import LOPSIDED

from ups.core import (
    CommHookPlugin,
    Config,
    ConfigError,
    RunContext,
    Strategy,
    StrategyPlugin,
    hookimpl,
    load_config,
)
from ups.core.config._validate import validate
from ups.core.engine import train_rank
from ups.core.engine._run import Run
from ups.core.plugin._manager import AUTOLOAD_ENV, Registry, load_plugins
from ups.core.testing import run_ranks, tiny_project

SHARDING = types.SimpleNamespace(
    ups_strategies=hookimpl(
        lambda: [
            StrategyPlugin(
                name="sharding",
                factory=lambda *, ctx, config, options: Strategy(ctx, config),
                comm_hooks=False,
                instead="strategy.options.reduce_dtype",
                local_passes=False,
            )
        ]
    ),
    ups_comm_hooks=hookimpl(
        lambda: [CommHookPlugin(name="fake", factory=lambda ddp, *, ctx, options: None)]
    ),
    ups_samplers=LOPSIDED.ups_samplers,
)


def registry() -> Registry:
    return load_plugins(extra=[("sharding", SHARDING)], env={AUTOLOAD_ENV: "1"})


def config(tmp_path: Path, **sections: Any) -> Config:
    return load_config(tiny_project(tmp_path, **sections))


def test_a_comm_hook_under_a_strategy_without_ddp_is_refused_naming_what_to_use(
    tmp_path: Path,
) -> None:
    bad = config(tmp_path, strategy={"name": "sharding"}, comm_hook={"name": "fake"})
    expected = (
        "comm_hook.name: 'fake' hooks DDP's gradient all-reduce, which strategy 'sharding' does "
        "not run; allowed: 'none'; instead: strategy.options.reduce_dtype"
    )
    with pytest.raises(ConfigError) as raised:
        validate(bad, registry(), 2)
    assert str(raised.value) == expected
    with pytest.raises(ConfigError) as on_rank:  # the Python API checks on the ranks too
        train_rank(bad, RunContext(), registry())
    assert str(on_rank.value) == expected


def test_skip_oom_is_refused_where_a_rank_cannot_pass_alone_and_auto_is_off(
    tmp_path: Path,
) -> None:
    bad = config(tmp_path, strategy={"name": "sharding"}, training={"skip_oom": True})
    with pytest.raises(ConfigError, match=r"^training\.skip_oom: cannot hold under strategy"):
        validate(bad, registry(), 2)
    auto = config(tmp_path, strategy={"name": "sharding"}, training={"max_steps": 2})
    assert validate(auto, registry(), 1) is not None
    run = Run(auto, RunContext(), registry())
    assert run.stepper.agree is False  # one process agrees under ddp ("auto"), not here
    assert Run(config(tmp_path), RunContext(), registry()).stepper.agree is True


def uneven_epoch(folder: Path, name: str, **training: Any) -> Config:
    """A run under strategy ``name`` of a sampler that gives rank 0 one batch of the last
    step and rank 1 two (1 and 3 samples, batches of 2)."""
    sampler = {"name": "lopsided", "options": {"block": 2, "last": [1, 3]}}
    data = {"options": {"n": 8}}
    return config(
        folder,
        strategy={"name": name},
        sampler=sampler,
        data=data,
        training={"batch_size": 2, "lr": 0.001, **training},
    )


def trained(ctx: RunContext, run: Config) -> str:
    """Train ``run`` on this rank: the error, or ``trained``."""
    try:
        train_rank(run, ctx, registry())
    except ConfigError as error:
        return str(error)
    return "trained"


def test_ranks_of_unequal_batch_counts_are_refused_where_every_pass_gathers(
    tmp_path: Path,
) -> None:
    """Under a strategy without local passes (fsdp), a rank with fewer micro-batches would
    leave the others waiting in a gather, and under ``ddp`` a rank with fewer steps would
    meet another collective than its step's all-reduce (it did, and trained on garbage):
    every rank refuses the epoch in one line; with accumulation, ``ddp`` trains an epoch of
    2 and 3 batches (one step each, the extra pass on its rank alone)."""
    sharding = run_ranks(trained, 2, uneven_epoch(tmp_path / "a", "sharding"))
    assert (
        sharding
        == [
            "sampler.name: 'lopsided' gives the ranks from 2 to 3 batches in epoch 1; every rank "
            "must take as many (under strategy 'sharding' each pass gathers parameters): use a "
            "sampler that deals the ranks evenly (torch, tensor, multitask)"
        ]
        * 2
    )
    ddp = run_ranks(trained, 2, uneven_epoch(tmp_path / "b", "ddp"))
    assert (
        ddp
        == [
            "sampler.name: 'lopsided' gives the ranks from 2 to 3 optimizer steps in epoch 1; every "
            "rank must take as many (every step all-reduces across the ranks): use a sampler that "
            "deals the ranks evenly (torch, tensor, multitask)"
        ]
        * 2
    )
    accumulated = uneven_epoch(tmp_path / "c", "ddp", accumulation_steps=3)
    assert run_ranks(trained, 2, accumulated) == ["trained"] * 2


def test_an_unknown_strategy_names_those_installed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^strategy\.name: unknown strategy 'fsdb'; available"):
        validate(config(tmp_path, strategy={"name": "fsdb"}), registry(), 2)


def test_the_builtin_ddp_takes_no_options(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^strategy\.options"):
        validate(config(tmp_path, strategy={"name": "ddp", "options": {"x": 1}}), registry(), 2)


def test_ddp_wraps_nothing_on_one_process(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    assert Strategy(RunContext(), config(tmp_path)).wrap(model) is model
