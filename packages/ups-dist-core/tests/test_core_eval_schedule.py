"""Exact evaluation over uneven shards, and the schedule wired into the loop, on real ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ups.core import ConfigError, load_config, load_plugins, train
from ups.core.config._user_code import load_object
from ups.core.config._validate import validate
from ups.core.testing import read_checkpoint, tiny_project

EVAL = {"factory": "tiny.py:build_dataset", "options": {"n": 67}, "every_steps": 2}


@pytest.mark.slow
def test_evaluation_on_two_uneven_shards_counts_every_sample_once(tmp_path: Path) -> None:
    config = tiny_project(tmp_path, eval=EVAL, training={"epochs": 1, "batch_size": 8})
    result = train(config, nproc=2)  # 67 eval samples: shards of 34 and 33
    assert len(result.eval_metrics) == 2  # at step 2 and at the end (step 4)
    assert result.eval_metrics[-1]["samples"] == 67

    # The same loss, computed here in one process over the whole set, from the final weights.
    assert result.checkpoint is not None
    model = load_object(f"{tmp_path / 'tiny.py'}:build_model", "model")()
    model.load_state_dict(read_checkpoint(result.checkpoint)["state"]["model"])
    inputs, targets = load_object(f"{tmp_path / 'tiny.py'}:build_dataset", "data")(n=67).tensors
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(model(inputs), targets).item()
    assert result.eval_metrics[-1]["loss"] == pytest.approx(expected, rel=1e-6)


def test_a_scheduled_lr_change_and_stop_happen_at_their_steps(tmp_path: Path) -> None:
    config = tiny_project(
        tmp_path,
        run={"log_every": 2},
        training={"epochs": 5},
        schedule=[
            {"when": {"at_latest_step": 4}, "do": {"lr_multiplier": 0.5}},
            {"when": {"at_latest_step": 6}, "do": {"stop": True}},
        ],
    )
    result = train(config)
    assert result.steps == 6
    assert [m["lr"] for m in result.metrics] == pytest.approx([0.05, 0.05, 0.025])
    assert result.checkpoint is not None
    state = read_checkpoint(result.checkpoint)["state"]["schedule"]
    assert [f["step"] for f in state["fired"]] == [4, 6]


@pytest.mark.slow
def test_a_validation_loss_rule_fires_on_every_rank_at_the_first_evaluation(tmp_path: Path) -> None:
    config = tiny_project(
        tmp_path,
        eval=EVAL,
        training={"epochs": 5, "accumulation_steps": 1},
        schedule=[
            {"when": {"val_loss_below": 1e9}, "do": {"accumulation_steps": 2, "save": True}},
            {"when": {"at_latest_step": 5}, "do": {"stop": True}},
        ],
    )
    result = train(config, nproc=2)
    # Steps 1-2 take one micro-batch each, then two: 64 samples / 2 ranks / 8 = 4 batches an
    # epoch; epoch 1: steps 1, 2, 3 (2 batches); epoch 2: steps 4, 5 -> stop at 5.
    assert result.steps == 5
    assert result.epochs == 2


def test_a_validation_loss_rule_needs_evaluations_during_training(tmp_path: Path) -> None:
    config = load_config(
        tiny_project(tmp_path, schedule=[{"when": {"val_loss_below": 0.1}, "do": {"stop": True}}])
    )
    with pytest.raises(
        ConfigError, match=r"^schedule\[0\].when.val_loss_below: needs an evaluation loss"
    ):
        validate(config, load_plugins(env={"UPS_DISABLE_PLUGIN_AUTOLOAD": "1"}))


@pytest.mark.parametrize(
    ("section", "name", "message"),
    [
        (
            "sampler",
            "shard",
            r"^sampler.name: 'shard' gives every sample to one rank.*training: torch$",
        ),
        (
            "eval",
            "torch",
            r"^eval.sampler.name: 'torch' pads the ranks' shares.*evaluation: shard$",
        ),
    ],
)
def test_training_and_evaluation_take_samplers_of_their_kind(
    tmp_path: Path, section: str, name: str, message: str
) -> None:
    choice = {"name": name}
    eval_section = {**EVAL, "sampler": choice} if section == "eval" else EVAL
    overrides = {"sampler": choice} if section == "sampler" else {}
    config = load_config(tiny_project(tmp_path, eval=eval_section, **overrides))
    with pytest.raises(ConfigError, match=message):
        validate(config, load_plugins(env={"UPS_DISABLE_PLUGIN_AUTOLOAD": "1"}))
