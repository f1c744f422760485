"""The training guard's promise on the bundled example, as a user runs it (``ups train --nproc 2``):
a NaN planted on rank 1 at step 40 with ``training.guard: {action: rollback}`` rolls every rank
back; the run finishes, reports one rollback, records the step, and ends bitwise equal to the
same run passing over that global step through the quarantine."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

from ups.core.engine._faults import ENV
from ups.core.testing import assert_bitwise_equal, events, read_checkpoint, run_ups

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pde_multitask.yaml"
STEPS = 60
"""Two and a half epochs of the example on 2 ranks (24 steps an epoch)."""


def train(folder: Path, *overrides: str, faults: str = "") -> subprocess.CompletedProcess[str]:
    """The example on 2 ranks for :data:`STEPS` steps, no evaluation, one checkpoint at the
    end, with ``overrides`` and ``UPS_FAULTS=faults``."""
    folder.mkdir(parents=True)
    extra = [item for override in overrides for item in ("-o", override)]
    result = run_ups(
        *("train", str(EXAMPLE), "--nproc", "2", "-o", f"run.output_dir={folder}"),
        *("-o", f"training.max_steps={STEPS}", "-o", "eval=null"),
        *("-o", "checkpoint.every_steps=1000", *extra),
        cwd=folder,
        env={ENV: faults},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_a_nan_at_step_40_rolls_back_and_ends_as_the_run_passing_over_that_step(
    tmp_path: Path,
) -> None:
    rolled = train(
        tmp_path / "rolled",
        "training.guard.action=rollback",
        "training.guard.snapshot_every=25",
        faults="nan@1:40",
    )
    run_dir = tmp_path / "rolled" / "pde-multitask"
    steps = events(rolled.stderr, "step")
    assert steps[-1]["step"] == STEPS and steps[-1]["guard_rollbacks"] == 1
    assert all(math.isfinite(e["loss"]) for e in steps)
    (record,) = map(json.loads, (run_dir / "guard.jsonl").read_text().splitlines())
    assert (record["step"], record["action"], record["epoch"]) == (40, "rollback", 2)
    assert [r["finite"] for r in record["ranks"]] == [True, False]
    assert all(len(r["indices"]) == 32 and r["tasks"] for r in record["ranks"])

    train(
        tmp_path / "passed",
        "training.guard.action=skip",
        f"training.guard.quarantine={run_dir / 'guard.jsonl'}",
    )
    found = read_checkpoint(run_dir / "checkpoints" / f"step-{STEPS}")["state"]
    passed = tmp_path / "passed" / "pde-multitask" / "checkpoints" / f"step-{STEPS}"
    expected = read_checkpoint(passed)["state"]
    for part in ("model", "optimizer", "scheduler", "schedule", "sampler", "step", "epoch"):
        assert_bitwise_equal(found[part], expected[part], part)
