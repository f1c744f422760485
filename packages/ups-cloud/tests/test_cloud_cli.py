"""``ups launch``, ``status``, ``logs`` and ``cancel`` with the ``local`` launcher: each command
a process of its own, as from a later shell, on real training jobs of the tiny project."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ups.cloud import LocalLauncher, LocalLauncherOptions
from ups.core.testing import run_ups, tiny_project


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    """The tiny project choosing the ``local`` launcher; a job left running is cancelled."""
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


def ups(project: Path, *args: str) -> tuple[int, str, str]:
    result = run_ups(*args, cwd=project)
    return result.returncode, result.stdout, result.stderr


def test_dry_run_prints_the_torchrun_command_and_writes_nothing(project: Path) -> None:
    status, out, err = ups(
        project, "launch", "run.yaml", "--dry-run", "--nproc", "2", "-o", "run.seed=3"
    )
    assert status == 0, err
    assert out == (
        f"{sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 "
        f"-m ups.core train {project / 'run.yaml'} -o run.seed=3\n"
    )
    assert sorted(p.name for p in project.iterdir()) == ["run.yaml", "tiny.py"]


@pytest.mark.slow
def test_a_launched_run_is_followed_from_other_processes_to_success(project: Path) -> None:
    status, out, err = ups(
        project, "launch", "run.yaml", "--nproc", "2", "-o", "training.max_steps=3"
    )
    assert status == 0, err
    folder = project / "runs" / "tiny"
    assert out.splitlines()[0] == f"launched 'tiny' with local: {folder}"
    record = json.loads((folder / "launch.json").read_text())
    assert (record["launcher"], record["handle"]) == ("local", str(folder))
    assert record["options"] == {"cancel_grace_s": 2}
    assert record["request"]["nproc_per_node"] == 2

    status, out, err = ups(project, "logs", "tiny", "--follow", "--interval", "0.2")
    assert status == 0, out + err
    assert err.strip().splitlines()[-1] == "ups: tiny: SUCCEEDED"
    done = [json.loads(line) for line in out.splitlines() if '"event": "done"' in line]
    assert len(done) == 1 and done[0]["steps"] == 3, out
    assert out == (folder / "launch.log").read_text()  # each line once
    assert ups(project, "status", "tiny")[:2] == (0, "SUCCEEDED\n")
    assert ups(project, "logs", str(folder))[1] == out


@pytest.mark.slow
def test_cancel_ends_a_long_run_cancelled(project: Path) -> None:
    status, _, err = ups(
        project,
        "launch",
        "run.yaml",
        "--nproc",
        "2",
        "-o",
        "training.epochs=100000",
        "-o",
        "run.log_every=1",
    )
    assert status == 0, err
    log = project / "runs" / "tiny" / "launch.log"
    deadline = time.monotonic() + 120
    while '"event": "step"' not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ups(project, "status", "tiny")[:2] == (0, "RUNNING\n"), log.read_text()
    status, _, err = ups(project, "launch", "run.yaml")
    assert status == 2 and "is RUNNING; cancel it" in err, err

    assert ups(project, "cancel", "tiny")[:2] == (0, "CANCELLED\n")
    assert ups(project, "status", "tiny")[:2] == (0, "CANCELLED\n")
    status, _, err = ups(project, "logs", "tiny", "--follow")
    assert status == 1
    assert err.strip().splitlines()[-1] == "ups: tiny: CANCELLED"
