"""A research run with everything on at once (EMA of the weights, a plateau rule that cuts the
LR again and again, keep-best checkpoints), stopped mid-way and resumed on 2 gloo ranks, ends
bitwise equal to the run never stopped: its weights, optimizer, schedule, EMA, kept-best set,
checkpoint folders and every line of its metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ups.core import TrainResult, load_config, train
from ups.core.testing import assert_bitwise_equal, read_checkpoint, tiny_project

EVAL = {"factory": "tiny.py:build_dataset", "options": {"n": 67}, "every_steps": 2}
PLATEAU = {"monitor": "val_loss", "patience": 1, "min_delta": 10.0, "repeat": True}
"""No evaluation improves by 10: the LR is halved at every evaluation after the first."""


def run(folder: Path, max_steps: int, resume: str = "none") -> TrainResult:
    """The tiny project trained on 2 ranks (4 epochs of 4 steps) up to ``max_steps``."""
    config = tiny_project(
        folder,
        eval=EVAL,
        training={
            "epochs": 4,
            "max_steps": max_steps,
            "ema": {"decay": 0.9, "warmup": True},
        },
        schedule=[{"when": {"plateau": PLATEAU}, "do": {"lr_multiplier": 0.5}}],
        checkpoint={
            "resume": resume,
            "every_steps": 5,
            "options": {"keep_best": {"monitor": "val_loss_ema", "count": 2}, "keep_last": 1},
        },
    )
    return train(load_config(config), nproc=2)


def lines(folder: Path) -> list[dict[str, Any]]:
    """The run's metrics, without what differs between any two runs (times, speeds, and the
    step phases' lines: times)."""
    found = []
    for line in (folder / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] != "phases":
            found.append({k: v for k, v in record.items() if "time" not in k and "per_s" not in k})
    return found


def test_stopped_and_resumed_it_ends_bitwise_as_the_run_never_stopped(tmp_path: Path) -> None:
    whole = run(tmp_path / "whole", 20)
    run(tmp_path / "halves", 11)  # stops between evaluations (its last evaluates at step 11)
    resumed = run(tmp_path / "halves", 20, resume="latest")
    expected, found = (read_checkpoint(r.checkpoint)["state"] for r in (whole, resumed))
    for key in ("model", "optimizer", "schedule", "ema", "best"):
        assert_bitwise_equal(found[key], expected[key], key)
    assert expected["ema"] and len(expected["best"]) == 2
    multipliers = {g.get("ups_lr_multiplier") for g in expected["optimizer"]["param_groups"]}
    assert multipliers == {0.5**7}, multipliers  # 16 steps: 8 evaluations, the first sets the best
    assert resumed.best == whole.best is not None
    folders = [
        sorted(p.name for p in (tmp_path / name / "runs" / "tiny" / "checkpoints").glob("step-*"))
        for name in ("whole", "halves")
    ]
    assert folders[0] == folders[1] and len(folders[0]) >= 2, folders
    # after the stop: every line, but the first report's (the stopped run reported step 11)
    after = [
        [r for r in lines(tmp_path / n) if r.get("step", 0) > (12 if r["kind"] == "train" else 11)]
        for n in ("halves", "whole")
    ]
    assert after[0] == after[1] and len(after[0]) >= 8, after
