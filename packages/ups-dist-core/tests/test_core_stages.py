"""A run of several stages (``stages``) on 2 gloo ranks: two stages train as two runs of the same
configs one after the other (bitwise, the second's steps numbered on); a later stage's factory
gets an earlier stage's trained model, frozen; a run stopped in its second stage resumes
bitwise; ``metrics.jsonl`` numbers its steps on across stages; a stage override of an unknown
key is one line before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ups.core import config_from_mapping, load_model, train
from ups.core.config._config import stage_config
from ups.core.testing import (
    assert_bitwise_equal,
    install_plugin,
    read_checkpoint,
    run_ups,
    tiny_project,
)

EVAL = {"factory": "tiny.py:build_dataset", "options": {"n": 24}, "every_steps": 2}

RESIDUAL = """
import torch
from torch import nn


class Residual(nn.Module):
    def __init__(self, operator, width):
        super().__init__()
        self.operator = operator
        self.correction = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))

    def forward(self, x):
        with torch.no_grad():
            predicted = self.operator(x)
        return predicted + self.correction(x)


def build_residual(operator, width=4):
    assert not operator.training, "the earlier stage's model comes in eval() mode"
    assert not any(p.requires_grad for p in operator.parameters()), "and frozen"
    return Residual(operator, width)
"""


def _state(run_dir: Path, step: int) -> dict[str, Any]:
    state = read_checkpoint(run_dir / "checkpoints" / f"step-{step}")["state"]
    return dict(state)


def _train_lines(run_dir: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line["kind"] == "train"]


@pytest.mark.slow
def test_two_stages_train_as_two_runs_of_their_configs_one_after_the_other(
    tmp_path: Path,
) -> None:
    first = tiny_project(tmp_path / "first", training={"max_steps": 3})
    assert train(first, nproc=2).steps == 3
    first_dir = tmp_path / "first" / "runs" / "tiny"
    second = tiny_project(
        tmp_path / "second",
        training={"max_steps": 3, "lr": 0.02},
        model={"factory": "tiny.py:build_model", "init_from": {"path": str(first_dir)}},
    )
    assert train(second, nproc=2).steps == 3
    second_dir = tmp_path / "second" / "runs" / "tiny"
    staged = tiny_project(
        tmp_path / "staged",
        stages=[
            {"name": "warm", "max_steps": 3},
            {
                "name": "fine",
                "max_steps": 3,
                "overrides": {"training": {"lr": 0.02}, "model": {"init_from": {"stage": "warm"}}},
            },
        ],
    )
    result = train(staged, nproc=2)
    assert result.steps == 6
    run_dir = tmp_path / "staged" / "runs" / "tiny"
    for key in ("model", "optimizer"):
        assert_bitwise_equal(_state(run_dir, 6)[key], _state(second_dir, 3)[key], key)
    kept = torch.load(run_dir / "stages" / "warm" / "model.pt", weights_only=True)
    assert_bitwise_equal(kept, dict(_state(first_dir, 3)["model"]), "kept")
    assert _state(run_dir, 6)["stage"] == 1
    # metrics.jsonl: the second stage's steps numbered on from the first's, its losses the same
    lines = _train_lines(run_dir)
    by_hand = _train_lines(first_dir) + [
        {**line, "step": line["step"] + 3} for line in _train_lines(second_dir)
    ]
    assert [line["step"] for line in lines] == [2, 3, 5, 6]
    assert [(line["step"], line["loss"]) for line in lines] == [
        (line["step"], line["loss"]) for line in by_hand
    ]
    assert result.losses == tuple(line["loss"] for line in lines)
    report = run_ups("report", str(run_dir))
    assert report.returncode == 0, report.stderr


@pytest.mark.slow
def test_a_later_stage_gets_an_earlier_stages_trained_model_frozen(tmp_path: Path) -> None:
    config = tiny_project(
        tmp_path,
        stages=[
            {"name": "operator", "max_steps": 2},
            {
                "name": "residual",
                "max_steps": 2,
                "overrides": {
                    "model": {
                        "factory": "residual.py:build_residual",
                        "options": {"operator": {"stage": "operator"}, "width": 4},
                    }
                },
            },
        ],
    )
    (tmp_path / "residual.py").write_text(RESIDUAL)
    checked = run_ups("validate", str(config), cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert train(config, nproc=2).steps == 4
    run_dir = tmp_path / "runs" / "tiny"
    operator = torch.load(run_dir / "stages" / "operator" / "model.pt", weights_only=True)
    model = _state(run_dir, 4)["model"]
    assert_bitwise_equal({k: model[f"operator.{k}"] for k in operator}, operator, "operator")
    assert set(model) == {f"operator.{k}" for k in operator} | {
        f"correction.{k}" for k in ("0.weight", "0.bias", "2.weight", "2.bias")
    }
    loaded = load_model(run_dir)  # the model of the stage that saved it, as that stage built it
    assert type(loaded).__name__ == "Residual"
    assert_bitwise_equal(dict(loaded.state_dict()), dict(model), "load_model")


TRACKER = """
import json
import os

from ups.core import hookimpl


def _write(ctx, **record):
    if ctx.is_main:
        with open(os.environ["TRACKED"], "a") as file:
            file.write(json.dumps(record) + "\\n")


@hookimpl
def ups_run_start(ctx, config):
    _write(ctx, hook="start", stages=[stage.name for stage in config.stages])


@hookimpl
def ups_step_end(ctx, step, metrics):
    _write(ctx, hook="step", step=step)


@hookimpl
def ups_eval_end(ctx, step, metrics):
    _write(ctx, hook="eval", step=step)


@hookimpl
def ups_run_end(ctx, result):
    _write(ctx, hook="end", step=result.steps)
"""


@pytest.mark.slow
def test_a_tracker_sees_one_run_whose_steps_go_on_across_stages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(site, "ups-tracked", "ups_tracked_plugin", TRACKER)
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("TRACKED", str(tmp_path / "tracked.jsonl"))
    config = tiny_project(
        tmp_path / "project",
        eval=EVAL,
        stages=[{"name": "a", "max_steps": 3}, {"name": "b", "max_steps": 4}],
    )
    done = run_ups("train", str(config), "--nproc", "2", cwd=config.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    tracked = [json.loads(line) for line in (tmp_path / "tracked.jsonl").read_text().splitlines()]
    assert tracked[0] == {"hook": "start", "stages": ["a", "b"]}
    assert tracked[-1] == {"hook": "end", "step": 7}
    assert [t["step"] for t in tracked if t["hook"] == "step"] == [2, 3, 5, 7]
    assert [t["step"] for t in tracked if t["hook"] == "eval"] == [2, 3, 5, 7]


def _stopped_project(folder: Path, resume: str, first: int, every: int) -> Path:
    """Stage ``a`` of ``first`` steps, then ``b`` of 6 with its own LR, an EMA, a scheduler and
    saves every ``every`` of its steps; evaluations every 2 of a stage's steps."""
    return tiny_project(
        folder,
        eval=EVAL,
        training={"batch_size": 4},
        checkpoint={"every_steps": 2, "resume": resume, "options": {"keep_last": 10}},
        stages=[
            {"name": "a", "max_steps": first},
            {
                "name": "b",
                "max_steps": 6,
                "overrides": {
                    "model": {"init_from": {"stage": "a"}},
                    "checkpoint": {"every_steps": every},
                    "training": {
                        "lr": 0.01,
                        "ema": {"decay": 0.8},
                        "scheduler": "StepLR",
                        "scheduler_options": {"step_size": 2, "gamma": 0.5},
                    },
                },
            },
        ],
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("first", "every", "fault", "reported"),
    [
        (4, 2, 5, 1),  # stopped in b's 5th step, after b saved its 4th (the run's 8th)
        (2, 4, 3, 3),  # stopped in b's 3rd step, before b saved: b starts over after a's save
    ],
)
def test_a_run_stopped_in_its_second_stage_resumes_bitwise(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    first: int,
    every: int,
    fault: int,
    reported: int,
) -> None:
    end = first + 6
    whole = train(_stopped_project(tmp_path / "whole", "none", first, every), nproc=2)
    assert whole.steps == end
    monkeypatch.setenv("UPS_FAULTS", f"error@0:{fault}")  # stage a takes fewer steps
    with pytest.raises(Exception, match="injected"):
        train(_stopped_project(tmp_path / "parts", "none", first, every), nproc=2)
    monkeypatch.delenv("UPS_FAULTS")
    parts_dir = tmp_path / "parts" / "runs" / "tiny"
    assert (parts_dir / "stages" / "a" / "stage.json").is_file()
    assert not (parts_dir / "stages" / "b").exists()
    rest = train(_stopped_project(tmp_path / "parts", "latest", first, every), nproc=2)
    assert rest.steps == end
    assert len(rest.losses) == reported  # the reports after the step it resumed from
    whole_dir = tmp_path / "whole" / "runs" / "tiny"
    a, b = _state(whole_dir, end), _state(parts_dir, end)
    for key in ("model", "optimizer", "scheduler", "ema", "schedule"):
        assert_bitwise_equal(b[key], a[key], key)
    steps = [line["step"] for line in _train_lines(parts_dir)]
    assert steps == [line["step"] for line in _train_lines(whole_dir)] == list(range(2, end + 1, 2))
    assert [line["loss"] for line in _train_lines(parts_dir)] == [
        line["loss"] for line in _train_lines(whole_dir)
    ]
    # a run resumed once every stage is done has nothing left to train
    assert train(_stopped_project(tmp_path / "parts", "latest", first, every), nproc=2).steps == end


def test_a_stage_override_of_an_unknown_key_is_one_line_before_any_rank(tmp_path: Path) -> None:
    config = tiny_project(
        tmp_path,
        stages=[
            {"name": "a", "max_steps": 2},
            {"name": "b", "max_steps": 2, "overrides": {"training": {"lrr": 0.01}}},
        ],
    )
    result = run_ups("train", str(config), "--nproc", "2", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"ups: error: {config}: stages[1].overrides.training.lrr: unknown key; allowed: "
        "accumulation_steps, batch_size, compile, ema, epochs, grad_clip_norm, guard, loss, lr, "
        "max_oom_skips, max_steps, optimizer, optimizer_options, peak_flops, precision, "
        "scheduler, scheduler_options, skip_oom, weight_decay; did you mean 'lr'?"
    ]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        (
            [{"name": "a", "overrides": {"model": {"init_from": {"stage": "b"}}}}, {"name": "b"}],
            "stages[0].model.init_from.stage: 'b' is no earlier stage; allowed: none (it is "
            "the first stage)",
        ),
        (
            [{"name": "a"}, {"name": "a"}],
            "stages[1].name: 'a' is the name of stages[0] too; name each stage once",
        ),
        (
            [{"name": "a"}, {"name": "b", "overrides": {"run": {"output_dir": "elsewhere"}}}],
            "stages[1].overrides.run.output_dir: is the whole run's, the same in every stage: "
            "set it in the base config",
        ),
        (
            [
                {"name": "a"},
                {
                    "name": "b",
                    "overrides": {"model": {"init_from": {"stage": "a", "weights": "ema"}}},
                },
            ],
            "stages[1].model.init_from.stage: weights ema: stage 'a' keeps no EMA (it has no "
            "training.ema)",
        ),
    ],
)
def test_stages_that_cannot_run_are_refused_in_one_line(
    tmp_path: Path, stages: list[dict[str, Any]], message: str
) -> None:
    config = tiny_project(tmp_path, stages=stages)
    result = run_ups("validate", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"ups: error: {config}: {message}"]


TRAINING = {
    "lr": st.floats(1e-6, 1.0),
    "batch_size": st.integers(1, 64),
    "weight_decay": st.floats(0.0, 0.1),
    "grad_clip_norm": st.none() | st.floats(0.1, 10.0),
    "optimizer_options": st.dictionaries(st.sampled_from(["betas", "eps"]), st.integers(0, 3)),
}


@given(
    overrides=st.fixed_dictionaries({}, optional=TRAINING),
    options=st.none()
    | st.dictionaries(st.sampled_from(["in_features", "bias"]), st.integers(1, 4)),
    max_steps=st.none() | st.integers(1, 100),
)
def test_a_stage_config_is_the_base_config_with_its_overrides_and_nothing_else(
    overrides: dict[str, Any], options: dict[str, Any] | None, max_steps: int | None
) -> None:
    base = {
        "model": {"factory": "torch.nn:Linear", "options": {"in_features": 4, "out_features": 1}},
        "data": {"factory": "torch.nn:Identity"},
        "training": {"lr": 0.5, "epochs": 3, "optimizer_options": {"betas": 9, "amsgrad": 1}},
    }
    stage: dict[str, Any] = {"training": overrides}
    if options is not None:
        stage["model"] = {"options": options}
    config = config_from_mapping(
        {**base, "stages": [{"name": "a", "max_steps": max_steps, "overrides": stage}]}
    )
    found = stage_config(config, 0)
    changed: dict[str, Any] = {**overrides}
    if max_steps is not None:
        changed["max_steps"] = max_steps
    expected = config_from_mapping(base)
    expected = attrs.evolve(expected, training=attrs.evolve(expected.training, **changed))
    if options is not None:  # an options mapping is replaced whole, not merged
        expected = attrs.evolve(expected, model=attrs.evolve(expected.model, options=options))
    assert found == expected
