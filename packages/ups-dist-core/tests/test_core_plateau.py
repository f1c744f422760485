"""Plateau-driven training: ``ReduceLROnPlateau`` as ``training.scheduler`` and the schedule's
``plateau`` trigger (early stopping, repeated LR cuts), on one process and on 2 gloo ranks,
resumed bitwise, and their bad input refused in one line."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_refused
from hypothesis import given, settings
from hypothesis import strategies as st

from ups.core import ConfigError, RunContext, load_config, train
from ups.core.engine._optim import step_on_plateau
from ups.core.engine._schedule import (
    Action,
    Plateau,
    Rule,
    Schedule,
    Trigger,
    apply_lr_multiplier,
)
from ups.core.testing import assert_bitwise_equal, read_checkpoint, run_ups, tiny_project

EVAL = {"factory": "tiny.py:build_dataset", "options": {"n": 67}, "every_steps": 2}


def plateau_rule(**plateau: Any) -> Rule:
    return Rule(when=Trigger(plateau=Plateau(**plateau)), do=Action(save=True))


def reload(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` after a trip through a checkpoint file that refuses code (weights_only)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


# --- the trigger against a plain-Python reference ----------------------------------------------


def reference(plateau: Plateau, values: Sequence[float]) -> list[int]:
    """The evaluations (indices) at which a plateau rule fires, as Keras' ``patience`` counts."""
    fired, best, bad = [], None, 0
    sign = 1.0 if plateau.mode == "min" else -1.0
    for index, value in enumerate(values):
        better = not math.isnan(value) and (
            best is None or sign * value < sign * best - plateau.min_delta
        )
        best, bad = (value, 0) if better else (best, bad + 1)
        if bad >= plateau.patience and (plateau.repeat or not fired):
            fired.append(index)
            bad = 0
    return fired


plateaus = st.builds(
    Plateau,
    patience=st.integers(1, 4),
    min_delta=st.sampled_from([0.0, 0.01, 0.5]),
    mode=st.sampled_from(["min", "max"]),
    repeat=st.booleans(),
)
value_lists = st.lists(
    st.one_of(st.floats(-3, 3, allow_nan=False), st.just(float("nan")), st.just(1.0)),
    max_size=25,
)


def firings(schedule: Schedule, values: Sequence[float], start: int = 0) -> list[int]:
    """Decide after each value (evaluation ``start + i`` at step ``start + i + 1``)."""
    fired = []
    for index, value in enumerate(values, start):
        decision = schedule.decide(RunContext(), index + 1, value)
        if decision is not None:
            fired.append(index)
    return fired


@settings(max_examples=200, deadline=None)
@given(plateau=plateaus, values=value_lists)
def test_a_plateau_rule_fires_as_the_reference_counts(
    plateau: Plateau, values: list[float]
) -> None:
    schedule = Schedule([Rule(when=Trigger(plateau=plateau), do=Action(save=True))], batch_size=8)
    assert firings(schedule, values) == reference(plateau, values)


@settings(max_examples=150, deadline=None)
@given(plateau=plateaus, values=value_lists, data=st.data())
def test_a_plateau_rule_resumed_anywhere_fires_as_an_uninterrupted_one(
    plateau: Plateau, values: list[float], data: st.DataObject
) -> None:
    rules = [
        Rule(when=Trigger(at_latest_step=3), do=Action(lr_multiplier=2.0)),
        Rule(when=Trigger(plateau=plateau), do=Action(lr_multiplier=0.5)),
    ]
    split = data.draw(st.integers(0, len(values)))
    whole = Schedule(rules, batch_size=8)
    expected = firings(whole, values)
    first = Schedule(rules, batch_size=8)
    before = firings(first, values[:split])
    resumed = Schedule(rules, batch_size=8)
    resumed.load_state_dict(reload(first.state_dict()))
    assert before + firings(resumed, values[split:], split) == expected
    assert repr(resumed.state_dict()) == repr(whole.state_dict())  # NaN as NaN


def test_an_early_stopping_rule_is_armed_from_the_start_whatever_the_stages() -> None:
    rules = [
        Rule(when=Trigger(at_latest_step=100), do=Action(batch_size=16)),
        Rule(when=Trigger(plateau=Plateau(patience=2)), do=Action(stop=True)),
    ]
    schedule = Schedule(rules, batch_size=8)
    assert firings(schedule, [1.0, 0.5, 0.6, 0.7]) == [3]  # the stage before never fired
    assert schedule.stopped
    assert schedule.position == 0


def test_a_repeated_plateau_cut_composes_with_the_stages_multipliers() -> None:
    rules = [
        Rule(when=Trigger(at_latest_step=2), do=Action(lr_multiplier=4.0)),
        Rule(when=Trigger(plateau=Plateau(patience=1, repeat=True)), do=Action(lr_multiplier=0.5)),
    ]
    schedule = Schedule(rules, batch_size=8)
    firings(schedule, [1.0, 1.0, 1.0, 0.1, 0.2])
    assert schedule.lr_multiplier == 4.0 * 0.5**3


def test_an_own_loop_names_the_values_it_reports_when_a_monitor_is_missing() -> None:
    schedule = Schedule([plateau_rule(monitor="val_accuracy")], batch_size=8)
    with pytest.raises(
        ConfigError,
        match=r"^schedule\[0\].when.plateau.monitor: 'val_accuracy' is not reported by the "
        r"run's evaluation; it reports: val_loss, val_mae$",
    ):
        schedule.decide(RunContext(), 1, metrics={"val_loss": 1.0, "val_mae": 0.5})


# --- ReduceLROnPlateau and the schedule's multiplier -------------------------------------------


def test_reduce_lr_on_plateau_composes_with_the_schedules_lr_multiplier() -> None:
    """It has no base_lrs: its cuts scale the group's LR, the multiplier scales it too."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.8)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
    schedule = Schedule(
        [Rule(when=Trigger(at_latest_step=2), do=Action(lr_multiplier=3.0))], batch_size=8
    )
    for step, loss in enumerate([1.0, 1.0, 1.0, 0.5], 1):  # cuts after evaluations 2 and 3
        step_on_plateau(RunContext(), scheduler, {"val_loss": loss})
        decision = schedule.decide(RunContext(), step, loss)
        if decision is not None and decision.lr_multiplier is not None:
            apply_lr_multiplier(optimizer, decision.lr_multiplier, scheduler)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.8 * 0.5 * 0.5 * 3.0)


# --- the engine: one process, 2 gloo ranks, resumed bitwise ------------------------------------

REDUCE = {"scheduler": "ReduceLROnPlateau", "scheduler_options": {"patience": 0, "factor": 0.5}}
CUT = [
    {
        "when": {"plateau": {"patience": 1, "min_delta": 0.01, "repeat": True}},
        "do": {"lr_multiplier": 0.5},
    }
]
STOP = [{"when": {"plateau": {"patience": 2}}, "do": {"stop": True}}]


def test_reduce_lr_on_plateau_steps_after_each_evaluation(tmp_path: Path) -> None:
    """It used to be stepped per optimizer step, without a metric: a TypeError at step 1."""
    config = tiny_project(tmp_path, eval=EVAL, training={"epochs": 3, **REDUCE})
    result = train(load_config(config))
    lrs = [m["lr"] for m in result.metrics]
    assert lrs[0] == 0.05 and lrs[-1] < 0.05  # cut once the eval loss stopped falling
    assert result.checkpoint is not None
    saved = read_checkpoint(result.checkpoint)["state"]["scheduler"]
    assert saved["last_epoch"] == len(result.eval_metrics)  # stepped once per evaluation


def test_early_stopping_on_a_plateau_ends_the_run(tmp_path: Path) -> None:
    config = tiny_project(tmp_path, eval=EVAL, training={"epochs": 6}, schedule=STOP)
    result = train(load_config(config))
    assert result.steps < 48
    assert result.checkpoint is not None
    fired = read_checkpoint(result.checkpoint)["state"]["schedule"]["fired"]
    assert [(f["reason"], f["step"]) for f in fired] == [("plateau", result.steps)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("training", "schedule"), [(REDUCE, STOP), ({}, CUT)], ids=["scheduler", "rule"]
)
def test_on_two_gloo_ranks_every_rank_cuts_the_lr_alike(
    tmp_path: Path, training: dict[str, Any], schedule: list[Any]
) -> None:
    config = tiny_project(
        tmp_path,
        eval=EVAL,
        training={"epochs": 4, **training},
        schedule=schedule,
        distributed={"desync_check_every": 1},  # the ranks' parameters compared every step
    )
    result = train(load_config(config), nproc=2)
    assert [m["lr"] for m in result.metrics][-1] < 0.05


@pytest.mark.slow
@pytest.mark.parametrize(
    ("training", "schedule"), [(REDUCE, STOP), ({}, CUT)], ids=["scheduler", "rule"]
)
def test_a_run_resumed_mid_way_ends_bitwise_as_one_never_stopped(
    tmp_path: Path, training: dict[str, Any], schedule: list[Any]
) -> None:
    def run(folder: Path, max_steps: int, resume: str = "none") -> Any:
        config = tiny_project(
            folder,
            eval=EVAL,
            training={"epochs": 4, "max_steps": max_steps, **training},
            schedule=schedule,
            checkpoint={"resume": resume},
        )
        return train(load_config(config), nproc=2)

    whole = run(tmp_path / "whole", 20)
    run(tmp_path / "halves", 15)  # between the first cut (step 14) and the next evaluation
    resumed = run(tmp_path / "halves", 20, resume="latest")
    assert resumed.steps == whole.steps
    assert [m["lr"] for m in resumed.metrics] == [m["lr"] for m in whole.metrics][
        -len(resumed.metrics) :
    ]
    expected, found = (read_checkpoint(r.checkpoint)["state"] for r in (whole, resumed))
    for key in ("model", "optimizer", "scheduler", "schedule"):
        assert_bitwise_equal(found[key], expected[key], key)


# --- bad input: one line, exit 2, before any rank starts ---------------------------------------


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {
                "eval": EVAL,
                "schedule": [{"when": {"plateau": {"monitor": "val_acc"}}, "do": {"stop": True}}],
            },
            "ups: error: schedule[0].when.plateau.monitor: 'val_acc' is not reported by the run's "
            "evaluation; it reports: val_loss, val_samples",
        ),
        (
            {"schedule": STOP},
            "ups: error: schedule[0].when.plateau: counts evaluations during training, and this "
            "run evaluates at the end only, if at all; set eval.every_steps",
        ),
        (
            {"training": REDUCE},
            "ups: error: training.scheduler: 'ReduceLROnPlateau' steps after each evaluation "
            "during training, and this run evaluates at the end only, if at all; set "
            "eval.every_steps",
        ),
        (
            {"eval": EVAL, "training": REDUCE, "schedule": CUT},
            "ups: error: training.scheduler: 'ReduceLROnPlateau' and schedule[0] (a plateau rule "
            "with lr_multiplier) both change the LR on a plateau; keep one",
        ),
        (
            {"eval": EVAL, "training": {**REDUCE, "scheduler_options": {"monitor": "val_los"}}},
            "ups: error: training.scheduler_options.monitor: 'val_los' is not reported by the "
            "run's evaluation; it reports: val_loss, val_samples; did you mean 'val_loss'?",
        ),
        (
            {"schedule": [{"when": {"plateau": {}, "at_latest_step": 3}, "do": {"stop": True}}]},
            "ups: error: ",
        ),
    ],
)
@pytest.mark.parametrize("command", ["validate", "train"])
def test_bad_plateau_input_is_one_line_and_exit_2(
    tmp_path: Path, sections: dict[str, Any], message: str, command: str
) -> None:
    result = run_ups(command, str(tiny_project(tmp_path, **sections)), cwd=tmp_path)
    assert_refused(result, message, tmp_path)
