"""The training guard and the straggler timing on a CUDA device (``training.guard``,
``run.straggler_threshold``): a NaN planted in a bf16 run rolls back and ends bitwise equal to
the run passing over that step through the quarantine; under fp16 the gradient scaler keeps the
steps with infinite gradients and the guard only counts them; the step timer's CUDA events see a
slow forward pass; and neither adds a device-to-host synchronisation per micro-batch."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_runs import MULTITASK, checkpoint, events, losses, ups

from ups.core import RunContext, load_config, load_plugins
from ups.core.engine import train_rank
from ups.core.engine._faults import ENV, SLOW_S
from ups.core.observe._phases import FORWARD, PHASES
from ups.core.testing import assert_bitwise_equal, tiny_project

pytestmark = pytest.mark.gpu

NAME = "pde-multitask"


def train(
    folder: Path, *overrides: str, steps: int = 30, faults: str = "", precision: str = "bf16"
) -> Any:
    """``ups train`` of the multitask example on the GPU, deterministic, ``steps`` steps,
    reporting every 5, one checkpoint at the end, no evaluation, with ``overrides``
    (``-o`` items) and ``UPS_FAULTS=faults``."""
    folder.mkdir(parents=True, exist_ok=True)
    extra = [item for override in overrides for item in ("-o", override)]
    return ups(
        *("train", str(MULTITASK), "--nproc", "1", "-o", f"run.output_dir={folder}"),
        *("-o", f"training.precision={precision}", "-o", f"training.max_steps={steps}"),
        *("-o", "run.log_every=5", "-o", "checkpoint.every_steps=1000", "-o", "eval=null"),
        *extra,
        cwd=folder,
        deterministic=True,
        env={ENV: faults},
    )


def test_a_nan_on_cuda_rolls_back_and_ends_bitwise_as_the_run_skipping_its_quarantine(
    tmp_path: Path,
) -> None:
    rolled = train(
        tmp_path / "rolled",
        "training.guard.action=rollback",
        "training.guard.snapshot_every=5",
        faults="nan@0:12",
    )
    assert [e["kind"] for e in events(rolled, "fault injected")] == ["nan"]
    assert events(rolled, "step")[-1]["guard_rollbacks"] == 1
    quarantine = tmp_path / "rolled" / NAME / "guard.jsonl"
    (record,) = map(json.loads, quarantine.read_text().splitlines())
    assert record["ranks"][0]["finite"] is False and record["ranks"][0]["indices"]

    skipped = train(
        tmp_path / "skipped",
        "training.guard.action=skip",
        f"training.guard.quarantine={quarantine}",
    )
    assert all(math.isfinite(loss) for loss in losses(skipped))
    expected = checkpoint(tmp_path / "skipped" / NAME, 30)
    found = checkpoint(tmp_path / "rolled" / NAME, 30)
    for part in ("model", "optimizer", "scheduler", "step"):
        assert_bitwise_equal(found[part], expected[part], part)


def test_fp16_leaves_an_infinite_gradient_to_its_scaler_and_the_guard_counts_it(
    tmp_path: Path,
) -> None:
    result = train(
        tmp_path, "training.guard.action=skip", steps=20, faults="inf@0:12", precision="fp16"
    )
    assert [e["kind"] for e in events(result, "fault injected")] == ["inf"]
    last = events(result, "step")[-1]
    assert last["guard_skipped"] == 0  # the scaler skipped it: the guard did not act
    assert last["scaler_skipped"] >= 1
    curve = losses(result)
    assert all(math.isfinite(loss) for loss in curve) and curve[-1] < curve[0]


def phase_lines(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "phases"]


def test_the_step_timers_cuda_events_see_a_slow_forward_pass(tmp_path: Path) -> None:
    for name, faults in (("slow", "slow@0:1"), ("even", "")):
        events(train(tmp_path / name, steps=20, faults=faults))
    for name, slow in (("slow", True), ("even", False)):
        lines = phase_lines(tmp_path / name / NAME)
        assert [line["step"] for line in lines] == [5, 10, 15, 20]
        for line in lines:
            assert line["phases"] == list(PHASES)
            (row,) = line["ranks"]
            assert min(row) >= 0
            assert (row[FORWARD] >= SLOW_S) is slow, (name, row)
            assert row[FORWARD] < SLOW_S + 1


def synchronisations(folder: Path, accumulation: int, on: bool) -> int:
    """The synchronising CUDA operations (``torch.cuda.set_sync_debug_mode``) of 12 optimizer
    steps of the tiny project trained in this process on the GPU, with ``accumulation``
    micro-batches a step; ``on``: with the guard (``skip``) and the step timer, else neither."""
    config = tiny_project(
        folder,
        run={"log_every": 4, "straggler_threshold": 0.2 if on else None},
        data={"options": {"n": 512}},
        training={
            "epochs": 4,
            "max_steps": 12,
            "accumulation_steps": accumulation,
            "guard": {"action": "skip"} if on else None,
        },
    )
    ctx = RunContext(device=torch.device("cuda", 0))
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            result = train_rank(load_config(config), ctx, load_plugins())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert result.steps == 12
    return sum("synchronizing" in str(w.message) for w in seen)


def test_the_guard_and_the_timer_add_no_synchronisation_per_micro_batch(tmp_path: Path) -> None:
    """What they add is the same with 4 micro-batches a step as with 1: one a step (the guard
    reads the step's gradient norm) and one a report (the timer reads its events' times)."""
    counts = {
        (accumulation, on): synchronisations(tmp_path / f"{accumulation}-{on}", accumulation, on)
        for accumulation in (1, 4)
        for on in (False, True)
    }
    assert counts[1, False] > 0, counts  # the counter counts: a report reads its losses
    added = {a: counts[a, True] - counts[a, False] for a in (1, 4)}
    assert added[4] == added[1], counts
    assert added[1] == 12 + 3, counts  # 12 steps, 3 reports
