"""The ``zero`` strategy on real gloo process groups: 2 ranks under ``zero`` train as under
``ddp`` and as one process (accumulation, micro-batches of unequal sizes, clipping, Adam and
SGD with momentum, an LR scheduler, ``comm_hook: none``); each rank holds about half of the
optimizer state; a ``zero`` checkpoint resumes bitwise under ``zero``, and under ``ddp`` and
on one process; LR schedulers, LR multipliers and the optimizer's options reach the local
optimizer."""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR
from zero_factories import build_model

import ups.fsdp.plugin
from ups.core import Config, RunContext, Strategy, config_from_mapping, load_plugins
from ups.core.engine import train_rank
from ups.core.engine._schedule import apply_lr_multiplier
from ups.core.plugin._manager import AUTOLOAD_ENV
from ups.core.testing import assert_bitwise_equal, assert_params_close, read_checkpoint, run_ranks
from ups.fsdp._zero import ZeroRedundancyOptimizer, zero  # torch's, imported without its warnings

FACTORIES = Path(__file__).resolve().with_name("zero_factories.py")
"""The model and data of the runs here."""
WORLD = 2

State = dict[str, Any]
"""A checkpoint's training state."""

ADAM = {
    "optimizer": "adamw",
    "lr": 0.01,
    "scheduler": "steplr",
    "scheduler_options": {"step_size": 2, "gamma": 0.5},
}
SGD = {"optimizer": "sgd", "lr": 0.1, "optimizer_options": {"momentum": 0.9}}
"""Optimizers with state: Adam's two moments, SGD's momentum (whose updates follow the
gradients' scale, so the clipping shows)."""


def config(
    folder: Path,
    strategy: str,
    batch: int,
    accumulation: int,
    samples: int,
    /,
    optimizer: dict[str, Any] = ADAM,
    **sections: Any,
) -> Config:
    """A config training :func:`zero_factories.build_model` on ``samples`` tuples for 2 epochs
    under ``strategy``, clipped to 0.3, with ``optimizer``'s keys of ``training``, sections
    updated key by key."""
    mapping: dict[str, Any] = {
        "run": {"name": "zero", "output_dir": str(folder), "log_every": 1000},
        "model": {"factory": f"{FACTORIES}:build_model"},
        "data": {"factory": f"{FACTORIES}:build_tuples", "options": {"n": samples}},
        "training": {
            "epochs": 2,
            "batch_size": batch,
            "accumulation_steps": accumulation,
            "grad_clip_norm": 0.3,
            **optimizer,
        },
        "sampler": {"name": "torch", "options": {"shuffle": True}},
        "strategy": {"name": strategy},
    }
    for name, values in sections.items():
        mapping[name] = {**mapping.get(name, {}), **values}
    return config_from_mapping(mapping)


def registry() -> Any:
    """The built-in plugins and ups-fsdp's, no other installed plugin."""
    return load_plugins(extra=[("ups-fsdp", ups.fsdp.plugin)], env={AUTOLOAD_ENV: "1"})


def final_states(ctx: RunContext, configs: list[Config]) -> list[State]:
    """Train each config in turn on this rank; each run's final checkpoint's state."""
    found = []
    for each in configs:
        result = train_rank(each, ctx, registry())
        assert result.checkpoint is not None
        found.append(read_checkpoint(result.checkpoint)["state"])
    return found


def on_ranks(configs: list[Config]) -> list[State]:
    """:func:`final_states` on ``WORLD`` ranks (rank 0's: the checkpoint rank 0 wrote)."""
    return run_ranks(final_states, WORLD, configs)[0]


def alone(configs: list[Config]) -> list[State]:
    """:func:`final_states` in this process, one rank."""
    return final_states(RunContext(), configs)


def one_process(batch: int, accumulation: int) -> dict[str, int]:
    """The ``training`` keys of one process taking a step of ``WORLD`` ranks' samples."""
    return {"batch_size": WORLD * batch * accumulation, "accumulation_steps": 1}


@st.composite
def uneven_steps(draw: st.DrawFn) -> tuple[int, int, int]:
    """``(batch, accumulation, samples)`` such that each of ``WORLD`` ranks ends every epoch
    with a step of micro-batches of unequal sizes (full ones, then a short one)."""
    batch = draw(st.integers(2, 5))
    accumulation = draw(st.integers(2, 3))
    full = draw(st.integers(0, 2))
    last = draw(st.integers(batch + 1, batch * accumulation - 1).filter(lambda n: n % batch))
    return batch, accumulation, WORLD * (full * batch * accumulation + last)


# ---------------------------------------------------------------------------------------------
# Training under zero ≡ ddp ≡ one process


@pytest.mark.slow
@settings(max_examples=3, deadline=None)
@given(shape=uneven_steps())
def test_zero_trains_as_ddp_and_as_one_process(
    tmp_path_factory: pytest.TempPathFactory, shape: tuple[int, int, int]
) -> None:
    """2 ranks of ``k`` micro-batches of ``b`` under ``zero`` ≡ under ``ddp`` ≡ one process of
    ``2kb`` (under ``ddp``, and under ``zero``: nothing to shard), to 1e-5: AdamW with a step
    LR scheduler, and SGD with momentum; ``comm_hook: none`` set under ``zero``."""
    batch, accumulation, samples = shape
    folder = tmp_path_factory.mktemp("equivalent")
    shape_ = (batch, accumulation, samples)
    hook = {"comm_hook": {"name": "none"}}
    ranks = on_ranks(
        [
            config(folder / "zero_adam", "zero", *shape_, **hook),
            config(folder / "zero_sgd", "zero", *shape_, SGD),
            config(folder / "ddp_adam", "ddp", *shape_),
            config(folder / "ddp_sgd", "ddp", *shape_, SGD),
        ]
    )
    big = one_process(batch, accumulation)
    one = alone(
        [
            config(folder / "one_adam", "zero", *shape_, training=big),
            config(folder / "one_sgd", "ddp", *shape_, SGD, training=big),
        ]
    )
    zero_adam, zero_sgd, ddp_adam, ddp_sgd = (state["model"] for state in ranks)
    for found, expected in [(zero_adam, ddp_adam), (zero_sgd, ddp_sgd)]:
        assert_params_close(found, expected, atol=1e-5)
    for found, expected in [(zero_adam, one[0]["model"]), (zero_sgd, one[1]["model"])]:
        assert_params_close(found, expected, atol=1e-5)
    # the saved optimizer state is the full one, as ddp's: every parameter's
    assert ranks[0]["optimizer"]["state"].keys() == ranks[2]["optimizer"]["state"].keys()
    assert len(ranks[0]["optimizer"]["state"]) == len(list(build_model().parameters()))
    assert (
        ranks[0]["optimizer"]["param_groups"][0]["lr"]
        == ranks[2]["optimizer"]["param_groups"][0]["lr"]
    )


# ---------------------------------------------------------------------------------------------
# What each rank holds, and what reaches the local optimizer


def state_bytes(state: Any) -> int:
    """The bytes of the tensors of an optimizer's ``state`` (by parameter)."""
    return sum(
        value.numel() * value.element_size()
        for per_param in state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    )


def trained(
    ctx: RunContext, strategy: Strategy, build: Callable[..., torch.optim.Optimizer]
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A 4-layer model of width 16 (8 parameters, shared out evenly by size) wrapped by
    ``strategy``, with its optimizer after one step on this rank's batch."""
    model = build_model(width=16, layers=4)
    wrapped = strategy.wrap(model)
    optimizer = strategy.optimizer(build, model)
    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(ctx.rank))
    wrapped(inputs).square().mean().backward()
    optimizer.step()
    return model, optimizer


def sharded(
    ctx: RunContext, strategy: Strategy, build: Callable[..., torch.optim.Optimizer]
) -> ZeroRedundancyOptimizer:
    """:func:`trained`'s optimizer, a :class:`ZeroRedundancyOptimizer` on 2 ranks."""
    _, optimizer = trained(ctx, strategy, build)
    assert isinstance(optimizer, ZeroRedundancyOptimizer)
    return optimizer


def held_bytes(ctx: RunContext, folder: Path) -> dict[str, Any]:
    """The bytes of optimizer state this rank holds under ``ddp`` and under ``zero`` after a
    step of Adam, and under ``zero`` again once ddp's full state is loaded; the full state
    ``zero`` gives for a checkpoint (rank 0's), and ddp's."""
    cfg = config(folder, "zero", 4, 1, 8)
    adam = functools.partial(torch.optim.Adam, lr=1e-3)
    ddp_model, ddp = trained(ctx, Strategy(ctx, cfg), adam)
    strategy = zero(ctx=ctx, config=cfg, options=None)
    zero_model, optimizer = trained(ctx, strategy, adam)
    assert isinstance(optimizer, ZeroRedundancyOptimizer)
    found = {
        "ddp": state_bytes(ddp.state),
        "zero": state_bytes(optimizer.optim.state),
        "exposed": state_bytes(optimizer.state),
        "saved": strategy.optimizer_state(optimizer),
        "ddp_state": ddp.state_dict(),
        "same_params": all(
            torch.equal(a, b)
            for a, b in zip(ddp_model.parameters(), zero_model.parameters(), strict=True)
        ),
    }
    loaded = sharded(ctx, zero(ctx=ctx, config=cfg, options=None), adam)
    strategy.load_optimizer_state(loaded, ddp.state_dict())
    found |= {"loaded": state_bytes(loaded.optim.state), "loaded_exposed": len(loaded.state)}
    found["reloaded"] = strategy.optimizer_state(loaded)
    return found


@pytest.mark.slow
def test_each_rank_holds_half_the_optimizer_state(tmp_path: Path) -> None:
    """On 2 ranks each holds ≤ 0.6x the optimizer state ``ddp`` holds (and the two together
    all of it), after a step and after loading ``ddp``'s full state; the state ``zero`` saves
    is ``ddp``'s, to the bit, on rank 0, and ``{}`` on rank 1; the steps are ``ddp``'s."""
    ranks = run_ranks(held_bytes, WORLD, tmp_path)
    full = ranks[0]["ddp"]
    assert full > 0 and ranks[1]["ddp"] == full
    for rank in ranks:
        assert rank["zero"] <= 0.6 * full and rank["loaded"] <= 0.6 * full, rank
        assert rank["exposed"] == rank["loaded_exposed"] == 0
        assert rank["same_params"]
    assert sum(rank["zero"] for rank in ranks) == sum(rank["loaded"] for rank in ranks) == full
    assert_bitwise_equal(ranks[0]["saved"], ranks[0]["ddp_state"])
    assert_bitwise_equal(ranks[0]["reloaded"], ranks[0]["ddp_state"])
    assert ranks[1]["saved"] == ranks[1]["reloaded"] == {}


def local_lrs(ctx: RunContext, folder: Path) -> dict[str, Any]:
    """The LR the local optimizer steps with once a step scheduler halved it and an LR
    multiplier of 3 applied, and once a plateau scheduler cut it; the local optimizer's
    ``foreach`` and ``fused`` as built."""
    strategy = zero(ctx=ctx, config=config(folder, "zero", 4, 1, 8), options=None)
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    optimizer = sharded(ctx, strategy, sgd)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.5)
    scheduler.step()
    apply_lr_multiplier(optimizer, 3.0, scheduler)
    optimizer.step()
    found = {"step": optimizer.optim.param_groups[0]["lr"]}
    optimizer = sharded(ctx, strategy, sgd)
    plateau = ReduceLROnPlateau(optimizer, patience=0, factor=0.1)
    plateau.step(1.0)
    plateau.step(2.0)
    optimizer.step()
    found["plateau"] = optimizer.optim.param_groups[0]["lr"]
    optimizer = sharded(ctx, strategy, functools.partial(torch.optim.Adam, foreach=False))
    found["foreach"] = optimizer.optim.param_groups[0]["foreach"]
    optimizer = sharded(ctx, strategy, functools.partial(torch.optim.Adam, fused=True))
    found["fused"] = optimizer.optim.param_groups[0]["fused"]
    return found


@pytest.mark.slow
def test_schedulers_multipliers_and_options_reach_the_local_optimizer(tmp_path: Path) -> None:
    for found in run_ranks(local_lrs, WORLD, tmp_path):
        assert found["step"] == pytest.approx(0.1 * 0.5 * 3.0)
        assert found["plateau"] == pytest.approx(0.1 * 0.1)
        assert found["foreach"] is False and found["fused"] is True


# ---------------------------------------------------------------------------------------------
# Checkpoints


def copied(run: Config, folder: Path) -> Path:
    """A copy of ``run``'s run folder as ``folder/zero``: a checkpoint to resume apart."""
    shutil.copytree(run.run_dir, folder / run.run.name)
    return folder


def assert_states_close(found: State, expected: State) -> None:
    """The same step, and the model and the optimizer's moments to 1e-6."""
    assert found["step"] == expected["step"]
    assert_params_close(found["model"], expected["model"])
    assert found["optimizer"]["state"].keys() == expected["optimizer"]["state"].keys()
    for index, moments in expected["optimizer"]["state"].items():
        assert_params_close(found["optimizer"]["state"][index], moments)


@pytest.mark.slow
@settings(max_examples=2, deadline=None)
@given(shape=uneven_steps())
def test_a_zero_checkpoint_resumes_under_zero_ddp_and_on_one_process(
    tmp_path_factory: pytest.TempPathFactory, shape: tuple[int, int, int]
) -> None:
    """A 2-rank ``zero`` run stopped after its first epoch (a checkpoint every step), resumed
    on 2 ranks under ``zero`` ≡ the uninterrupted run, to the bit (model and optimizer state);
    resumed under ``ddp``, to 1e-6. Resumed on one process (``zero``: a plain optimizer), it
    goes on as a 2-rank ``ddp`` run's checkpoint does under ``ddp``, to 1e-6 (not as the 2-rank run: the checkpoint's schedule keeps
    the per-rank batch size and accumulation, so one process takes steps of half the
    samples)."""
    batch, accumulation, samples = shape
    folder = tmp_path_factory.mktemp("resume")
    epoch = -(-samples // (WORLD * batch * accumulation))  # steps
    saving = {"checkpoint": {"every_steps": 1, "resume": "latest"}}
    shape_ = (batch, accumulation, samples)
    stop = {"max_steps": epoch}
    reference = config(folder / "a", "zero", *shape_, **saving)
    stopped = config(folder / "b", "zero", *shape_, **saving, training=stop)
    stopped_ddp = config(folder / "e", "ddp", *shape_, **saving, training=stop)
    first = on_ranks([reference, stopped, stopped_ddp])
    assert first[1]["step"] == first[2]["step"] == epoch
    assert_states_close(first[1], first[2])  # what zero saves is what ddp saves
    under_ddp = copied(stopped, folder / "c")
    on_one = copied(stopped, folder / "d")
    resumed = on_ranks(
        [
            config(folder / "b", "zero", *shape_, **saving),
            config(under_ddp, "ddp", *shape_, **saving),
        ]
    )
    one = alone(
        [
            config(on_one, "zero", *shape_, **saving),
            config(folder / "e", "ddp", *shape_, **saving),
        ]
    )
    expected = first[0]
    assert_bitwise_equal(resumed[0]["model"], expected["model"])
    assert_bitwise_equal(resumed[0]["optimizer"], expected["optimizer"])
    assert_states_close(resumed[1], expected)
    assert_states_close(one[0], one[1])
