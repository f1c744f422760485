"""The commands that do not train import no torch (issue 18, item 8): ``ups --help``,
``plugins``, ``launch --dry-run``, ``status``, ``logs`` and ``cancel`` (of a run record of the
``local`` launcher of ups-cloud, whose job folder the launcher finds empty: one usage error
after the launcher is built) run with every distribution of packages/ installed, each in a
fresh interpreter, which then prints whether ``torch`` is in ``sys.modules``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ups.core.launch_record import new_record
from ups.core.records import LaunchRequest

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import contextlib, io, sys
from ups.core.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        status = main(sys.argv[1:])
    except SystemExit as exit:  # --help
        status = exit.code
sys.stderr.write(out.getvalue())
print(status, "torch" in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))[:3])
"""
"""Runs ``ups ARGS`` in-process; prints the exit status and whether torch was imported."""


def ups(*args: str, cwd: Path) -> tuple[int, bool]:
    # ups-blocks, the one-file example of docs/plugins.md, imports torch with its module (a
    # plugin of plugins/: not installed where these tests run, but left out wherever it is).
    env = {**os.environ, "UPS_BLOCK_PLUGINS": "blocks", "UPS_LOG_FORMAT": "json"}
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    status, imported, _ = result.stdout.split(maxsplit=2)
    return int(status), imported == "True"


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("project")
    config = (ROOT / "examples" / "pde_multitask.yaml").read_text()
    (folder / "run.yaml").write_text(config)
    (folder / "pde_multitask.py").write_text((ROOT / "examples" / "pde_multitask.py").read_text())
    request = LaunchRequest(
        config=folder / "run.yaml", nproc_per_node=1, nnodes=1, overrides=(), run_dir=folder
    )
    new_record("local", {}, str(folder / "job"), request).write(folder / "runs" / "run")
    return folder


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["--help"], id="help"),
        pytest.param(["plugins"], id="plugins"),
        pytest.param(["launch", "run.yaml", "--launcher", "local", "--dry-run"], id="dry-run"),
        pytest.param(["status", "runs/run"], id="status"),
        pytest.param(["logs", "runs/run"], id="logs"),
        pytest.param(["cancel", "runs/run"], id="cancel"),
    ],
)
def test_a_command_that_does_not_train_imports_no_torch(args: list[str], project: Path) -> None:
    status, imported = ups(*args, cwd=project)
    assert status in (0, 2)  # status, logs, cancel: the job's folder is empty
    assert not imported
