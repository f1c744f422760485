"""A run folder holds one run's history: a resumed run's record reads as one history, a fresh
run moves an earlier one aside, and a folder in use is locked. Real ``ups train`` processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ups.core.testing import events, run_ups, tiny_project, wait_for

pytestmark = pytest.mark.slow

BLOCKED = {"UPS_BLOCK_PLUGINS": "tensorboard,wandb,mlflow"}


def ups(*args: str, cwd: Path, faults: str = "") -> subprocess.CompletedProcess[str]:
    """``ups ARGS`` with ``UPS_FAULTS=faults`` and the trackers blocked."""
    return run_ups(*args, cwd=cwd, env=BLOCKED | {"UPS_FAULTS": faults}, timeout=180)


def lines(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_2_rank_run_killed_and_restarted_reports_each_step_once_from_the_resumed_attempt(
    tmp_path: Path,
) -> None:
    config = tiny_project(
        tmp_path,
        training={"epochs": 3},  # 12 steps on 2 ranks
        checkpoint={"every_steps": 4},
        eval={"factory": "tiny.py:build_dataset", "options": {"n": 16}, "every_steps": 3},
    )
    # Rank 0 dies in step 8: after the checkpoint of step 4, the report of step 6 and the
    # evaluation of step 6; the agent restarts both ranks, which resume from step 4.
    done = ups(
        "train", str(config), "--nproc=2", "--max-restarts=1", faults="kill@0:8", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "tiny"
    assert [e["step"] for e in events(run_dir / "logs" / "rank0.jsonl", "resumed")] == [4]
    assert not (tmp_path / "runs" / "tiny.1").exists()  # a restart continues the folder
    records = lines(run_dir)
    kinds_steps = [(r["kind"], r["step"]) for r in records]
    assert sorted(kinds_steps) == sorted(
        [
            *(("train", step) for step in range(2, 13, 2)),
            *(("phases", step) for step in range(2, 13, 2)),  # the ranks' step times
            *(("eval", step) for step in (3, 6, 9, 12)),
        ]
    )
    assert [step for _, step in kinds_steps] == sorted(step for _, step in kinds_steps)
    # Each report after the checkpoint is the resumed attempt's: its timing, as logged then.
    logged = events(run_dir / "logs" / "rank0.jsonl")
    resumed = next(i for i, e in enumerate(logged) if e.get("event") == "resumed")
    before, after = (
        {e["step"]: e["step_time_s"] for e in part if e.get("event") == "step"}
        for part in (logged[:resumed], logged[resumed:])
    )
    assert 6 in before  # the killed attempt had reported a step after the checkpoint
    assert {
        r["step"]: round(r["step_time_s"], 6)
        for r in records
        if r["kind"] == "train" and r["step"] > 4
    } == after


def test_a_fresh_run_in_a_used_folder_moves_the_earlier_run_aside_intact(tmp_path: Path) -> None:
    config = tiny_project(tmp_path, checkpoint={"every_steps": 4})  # 8 steps on one process
    first = ups("train", str(config), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    runs = tmp_path / "runs"
    metrics = (runs / "tiny/metrics.jsonl").read_bytes()
    again = ups("train", str(config), "-o", "training.max_steps=4", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    old, new = runs / "tiny.1", runs / "tiny"
    assert [r["step"] for r in lines(new) if r["kind"] == "train"] == [2, 4]
    assert sorted(p.name for p in (new / "checkpoints").glob("step-*")) == ["step-4"]
    assert (old / "metrics.jsonl").read_bytes() == metrics
    assert sorted(p.name for p in (old / "checkpoints").glob("step-*")) == ["step-4", "step-8"]
    moved = [line for line in again.stderr.splitlines() if "held an earlier run" in line]
    assert len(moved) == 1, again.stderr[-3000:]
    assert f"moved it to {old}" in moved[0]


def test_a_second_run_on_a_folder_in_use_exits_2_naming_the_pid_and_the_folder_stays(
    tmp_path: Path,
) -> None:
    config = tiny_project(tmp_path)
    run_dir = tmp_path / "runs" / "tiny"
    env = os.environ | BLOCKED | {"UPS_LOG_FORMAT": "json", "UPS_FAULTS": "hang@0:3"}
    command = [sys.executable, "-m", "ups.core", "train", str(config)]
    first = subprocess.Popen(command, env=env, cwd=tmp_path, stderr=subprocess.DEVNULL)
    try:
        asleep = "the first run asleep in its step 3"
        wait_for(lambda: _logged(run_dir, "fault injected"), 120, asleep, process=first)
        refusal = f"run folder {run_dir} is in use by the run of process {first.pid} on "
        # ups train's launcher refuses before starting any rank
        second = ups("train", str(config), "--nproc=2", cwd=tmp_path)
        assert second.returncode == 2, second.stderr[-3000:]
        errors = [line for line in second.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and errors[0].startswith(f"ups: error: {refusal}"), errors
        assert "Traceback" not in second.stderr
        # ranks started by torchrun alone: rank 0 refuses, and every rank with it
        torchrun = "--standalone", "--nproc-per-node=2", "-m", "ups.core", "train", str(config)
        ranks = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", *torchrun],
            capture_output=True,
            text=True,
            env=env | {"UPS_FAULTS": ""},
            cwd=tmp_path,
            timeout=180,
        )
        assert ranks.returncode != 0
        # (the agent may stop rank 1 once rank 0 has exited)
        assert f"UsageError: {refusal}" in ranks.stderr, ranks.stderr[-3000:]
        assert "exitcode  : 2" in ranks.stderr, ranks.stderr[-3000:]
        assert first.poll() is None and not (tmp_path / "runs/tiny.1").exists()
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # the killed run's lock died with it: a new run starts, moving it aside
    after = ups("train", str(config), "-o", "training.max_steps=2", cwd=tmp_path)
    assert after.returncode == 0, after.stderr[-3000:]
    assert (tmp_path / "runs/tiny.1/logs/rank0.jsonl").is_file()


def _logged(run_dir: Path, name: str) -> bool:
    path = run_dir / "logs" / "rank0.jsonl"
    return path.is_file() and f'"event": "{name}"' in path.read_text()
