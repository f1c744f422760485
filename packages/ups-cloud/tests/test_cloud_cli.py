"""``ups launch``, ``status``, ``logs`` and ``cancel`` with the ``local`` launcher: each command
a process of its own, as from a later shell, on real training jobs of the tiny project."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ups.cloud import LocalLauncher, LocalLauncherOptions
from ups.core.testing import events, run_ups, tiny_project, wait_for


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The tiny project choosing the ``local`` launcher, the working directory (where
    :func:`run_ups` runs ``ups``); a job left running is cancelled."""
    monkeypatch.chdir(tmp_path)
    tiny_project(
        tmp_path,
        distributed={"backend": "gloo", "timeout_s": 60},
        launch={"name": "local", "options": {"cancel_grace_s": 2}},
    )
    try:
        yield tmp_path
    finally:
        folder = tmp_path / "runs" / "tiny"
        if (folder / "job.json").exists():
            LocalLauncher(options=LocalLauncherOptions(cancel_grace_s=2)).cancel(str(folder))


def test_dry_run_prints_the_torchrun_command_and_writes_nothing(project: Path) -> None:
    done = run_ups("launch", "run.yaml", "--dry-run", "--nproc", "2", "-o", "run.seed=3")
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        f"{sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 "
        f"-m ups.core train {project / 'run.yaml'} -o run.seed=3\n"
    )
    assert sorted(p.name for p in project.iterdir()) == ["run.yaml", "tiny.py"]


@pytest.mark.slow
def test_a_launched_run_is_followed_from_other_processes_to_success(project: Path) -> None:
    done = run_ups("launch", "run.yaml", "--nproc", "2", "-o", "training.max_steps=3")
    assert done.returncode == 0, done.stderr
    folder = project / "runs" / "tiny"
    assert done.stdout.splitlines()[0] == f"launched 'tiny' with local: {folder}"
    record = json.loads((folder / "launch.json").read_text())
    assert (record["launcher"], record["handle"]) == ("local", str(folder))
    assert record["options"] == {"cancel_grace_s": 2}
    assert record["request"]["nproc_per_node"] == 2

    followed = run_ups("logs", "tiny", "--follow", "--interval", "0.2")
    out = followed.stdout
    assert followed.returncode == 0, out + followed.stderr
    assert followed.stderr.strip().splitlines()[-1] == "ups: tiny: SUCCEEDED"
    done_events = events(out, "done")
    assert len(done_events) == 1 and done_events[0]["steps"] == 3, out
    assert out == (folder / "launch.log").read_text()  # each line once
    status = run_ups("status", "tiny")
    assert (status.returncode, status.stdout) == (0, "SUCCEEDED\n")
    assert run_ups("logs", str(folder)).stdout == out


@pytest.mark.slow
def test_cancel_ends_a_long_run_cancelled(project: Path) -> None:
    long_run = ("-o", "training.epochs=100000", "-o", "run.log_every=1")
    done = run_ups("launch", "run.yaml", "--nproc", "2", *long_run)
    assert done.returncode == 0, done.stderr
    log = project / "runs" / "tiny" / "launch.log"
    wait_for(lambda: '"event": "step"' in log.read_text(), 120, "the first step")
    status = run_ups("status", "tiny")
    assert (status.returncode, status.stdout) == (0, "RUNNING\n"), log.read_text()
    again = run_ups("launch", "run.yaml")
    assert again.returncode == 2 and "is RUNNING; cancel it" in again.stderr, again.stderr

    for command in ("cancel", "status"):
        said = run_ups(command, "tiny")
        assert (said.returncode, said.stdout) == (0, "CANCELLED\n")
    followed = run_ups("logs", "tiny", "--follow")
    assert followed.returncode == 1
    assert followed.stderr.strip().splitlines()[-1] == "ups: tiny: CANCELLED"
