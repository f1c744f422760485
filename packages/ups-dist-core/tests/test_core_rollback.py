"""The guard's rollback and quarantine (``training.guard: {action: rollback}``) on real gloo
ranks: a NaN planted on one rank rolls every rank back to its in-memory snapshot, the offending
global step quarantined in ``guard.jsonl``; the run ends bitwise equal to the same run passing
over that step through the quarantine, with or without an LR cut, and after a kill and a
restart too."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from ups.core import ConfigError, RunContext, load_config, load_plugins
from ups.core.engine import train_rank
from ups.core.engine._faults import ENV
from ups.core.testing import assert_bitwise_equal, read_checkpoint, run_ranks, run_ups, tiny_project


def ended(ctx: RunContext, config_path: Path) -> dict[str, Any]:
    """Train on this rank: its steps, reports and final checkpoint's state."""
    result = train_rank(load_config(config_path), ctx, load_plugins())
    assert result.checkpoint is not None
    return {
        "steps": result.steps,
        "metrics": result.metrics,
        "state": read_checkpoint(result.checkpoint)["state"],
    }


MEASURED = """
def measured():
    def fn(outputs, targets):
        return {"error": (outputs - targets).abs().mean(), "seen": outputs.new_ones(len(outputs))}

    return fn
"""
"""A user metric of the batch's values, and one per sample: what a report adds up."""


def project(
    folder: Path,
    guard: dict[str, Any],
    checkpoint: dict[str, Any] | None = None,
    strategy: str = "ddp",
    **training: Any,
) -> Path:
    """The tiny project (4 batches of 8 a rank an epoch on 2 ranks) for 2 epochs, reporting
    every 2 steps with :data:`MEASURED`'s metrics, Adam with a step LR schedule, with
    ``training.guard: guard``, under ``strategy``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "measured.py").write_text(MEASURED)
    return tiny_project(
        folder,
        run={"log_every": 2},
        metrics={"factory": "measured.py:measured", "reduce": {"seen": "sum"}},
        checkpoint=checkpoint or {},
        strategy={"name": strategy},
        training={
            "epochs": 2,
            "guard": guard,
            "scheduler": "StepLR",
            "scheduler_options": {"step_size": 1, "gamma": 0.9},
            **training,
        },
    )


def assert_same_end(found: dict[str, Any], expected: dict[str, Any]) -> None:
    assert found["steps"] == expected["steps"]
    for part in ("model", "optimizer", "scheduler"):
        assert_bitwise_equal(found["state"][part], expected["state"][part], part)


@pytest.mark.slow
@pytest.mark.parametrize(("accumulation", "fault", "steps"), [(1, 4, 7), (2, 2, 3)])
@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_a_rollback_ends_bitwise_as_the_run_passing_over_its_quarantined_step(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    accumulation: int,
    fault: int,
    steps: int,
    factor: float,
) -> None:
    """Snapshots every 2 steps (and at the first epoch's start): the NaN at attempt ``fault``
    rolls back to the snapshot before it, replays, and passes over the offending batches."""
    guard = {"action": "rollback", "snapshot_every": 2, "lr_factor": factor, "lr_steps": 2}
    monkeypatch.setenv(ENV, f"nan@1:{fault}")
    rolled = run_ranks(
        ended, 2, project(tmp_path / "rolled", guard, accumulation_steps=accumulation)
    )
    monkeypatch.delenv(ENV)
    run_dir = tmp_path / "rolled" / "runs" / "tiny"
    (record,) = [json.loads(line) for line in (run_dir / "guard.jsonl").read_text().splitlines()]
    first = (fault - 1) * accumulation + 1
    assert (record["step"], record["epoch"], record["batches"]) == (
        fault,
        1,
        [first, first + accumulation - 1],
    )
    assert [r["finite"] for r in record["ranks"]] == [True, False]
    assert all(len(r["indices"]) == 8 * accumulation for r in record["ranks"])
    assert rolled[0]["steps"] == steps and rolled[0]["metrics"][-1]["guard_rollbacks"] == 1
    assert all(math.isfinite(m["loss"]) for m in rolled[0]["metrics"])
    reported = [
        json.loads(line)["step"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if json.loads(line).get("kind", "train") == "train"
    ]
    assert reported == sorted(set(reported))  # the replayed steps' reports superseded
    quarantined = project(
        tmp_path / "quarantined",
        {**guard, "action": "skip", "quarantine": str(run_dir / "guard.jsonl")},
        accumulation_steps=accumulation,
    )
    passed = run_ranks(ended, 2, quarantined)
    for found, expected in zip(rolled, passed, strict=True):
        assert_same_end(found, expected)
    # Every report counts each step once, the loss and the user metrics alike (a replayed
    # step's are rewound with the snapshot), as the run passing over the step counts them.
    counted = ("loss", "error", "seen")
    assert [{k: m[k] for k in counted} for m in rolled[0]["metrics"]] == [
        {k: m[k] for k in counted} for m in passed[0]["metrics"]
    ]
    if factor != 1:  # the cut made a difference
        uncut = {
            **guard,
            "action": "skip",
            "lr_factor": 1.0,
            "quarantine": str(run_dir / "guard.jsonl"),
        }
        plain = run_ranks(
            ended, 2, project(tmp_path / "uncut", uncut, accumulation_steps=accumulation)
        )
        cut, uncut_weights = (next(iter(r[0]["state"]["model"].values())) for r in (passed, plain))
        assert not cut.equal(uncut_weights)


@pytest.mark.slow
@pytest.mark.parametrize(("snapshot_every", "kill", "factor"), [(100, 5, 1.0), (3, 7, 0.5)])
def test_a_kill_in_or_after_a_replay_resumes_bitwise_as_the_unkilled_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, snapshot_every: int, kill: int, factor: float
) -> None:
    """A NaN on rank 1 at attempt 4 (epoch 1's last batch) rolls back to the snapshot of the
    checkpoint of step 2 (``snapshot_every: 100``) or of step 3; rank 0 is killed at attempt
    ``kill``: in the replay, before the checkpoint after the quarantined step (the restarted
    job resumes from step 2 and passes over the step again, from its own ``guard.jsonl``), or
    after it, within the LR cut (the checkpoint of step 4 keeps the cut's steps left). Either
    way the run ends bitwise as the run never killed."""
    guard = {
        "action": "rollback",
        "snapshot_every": snapshot_every,
        "lr_factor": factor,
        "lr_steps": 3,
    }
    monkeypatch.setenv(ENV, "nan@1:4")
    unkilled = run_ranks(ended, 2, project(tmp_path / "unkilled", guard))[0]
    config = project(tmp_path / "killed", guard, checkpoint={"every_steps": 2})
    monkeypatch.setenv(ENV, f"nan@1:4;kill@0:{kill}")
    run = run_ups("train", str(config), "--nproc", "2", "--max-restarts", "1", timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "restarted by the launcher: resuming" in run.stderr, run.stderr[-3000:]
    run_dir = tmp_path / "killed" / "runs" / "tiny"
    assert len((run_dir / "guard.jsonl").read_text().splitlines()) == 1
    last = max((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
    assert last.name == f"step-{unkilled['steps']}"
    killed = read_checkpoint(last)["state"]
    for part in ("model", "optimizer", "scheduler"):
        assert_bitwise_equal(killed[part], unkilled["state"][part], part)


def test_a_quarantine_file_that_is_not_a_guard_jsonl_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    bad = tmp_path / "guard.jsonl"
    bad.write_text("{}\n")
    config = load_config(project(tmp_path, {"action": "skip", "quarantine": str(bad)}))
    with pytest.raises(
        ConfigError, match=r"training\.guard\.quarantine: line 1 of .* is not a step"
    ):
        train_rank(config, RunContext(), load_plugins())


@pytest.mark.slow
def test_more_rollbacks_than_the_budget_stop_every_rank_and_none_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    guard = {"action": "rollback", "snapshot_every": 2, "max_rollbacks": 1, "window": 10}
    off = run_ranks(ended, 2, project(tmp_path / "off", {"action": "skip"}))
    clean = run_ranks(ended, 2, project(tmp_path / "clean", guard))
    for found, expected in zip(clean, off, strict=True):
        assert_same_end(found, expected)  # snapshots taken, none restored: nothing changed
        assert found["metrics"][-1]["guard_rollbacks"] == 0
    monkeypatch.setenv(ENV, "nan@1:2,4")
    with pytest.raises(Exception, match=r"over training\.guard\.max_rollbacks: 1"):
        run_ranks(ended, 2, project(tmp_path / "stopped", guard))
