"""The commands that do not train import no torch (issue 18, item 8): ``ups --help``,
``plugins``, ``validate`` of a config whose factories import torch only when called,
``launch --dry-run``, ``status``, ``logs`` and ``cancel`` (of a run record of the ``local``
launcher of ups-cloud, whose job folder the launcher finds empty: one usage error after the
launcher is built) and ``report`` (of a run folder's metrics.jsonl: its table, then the
figure) run with every distribution of packages/ and every plugin of plugins/ installed (nox's
``test-plugins`` session), each in a fresh interpreter, which then prints whether ``torch`` is
in ``sys.modules``."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ups.core.launch._record import new_record
from ups.core.plugin._records import LaunchRequest

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import contextlib, io, sys
from ups.core.cli._main import main
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


FACTORIES = """
def build_model(width=4):
    import torch

    return torch.nn.Linear(width, 1)


def build_dataset(n=64):
    import torch

    x = torch.randn(n, 4)
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
"""
"""Factories that import torch only when called, as ``validate`` never calls them."""
CONFIG = """
run: {name: lazy, output_dir: runs}
model: {factory: lazy.py:build_model}
data: {factory: lazy.py:build_dataset}
training: {batch_size: 8, optimizer: adamw, scheduler: cosineannealinglr,
  scheduler_options: {T_max: 10}}
"""


def ups(*args: str, cwd: Path) -> tuple[int, bool]:
    env = {**os.environ, "UPS_LOG_FORMAT": "json"}
    env.pop("UPS_BLOCK_PLUGINS", None)
    env.pop("UPS_DISABLE_PLUGIN_AUTOLOAD", None)
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
    (folder / "lazy.py").write_text(FACTORIES)
    (folder / "lazy.yaml").write_text(CONFIG)
    (folder / "runs" / "done").mkdir()
    lines = [{"kind": "train", "step": s, "loss": 1.0 / s} for s in (1, 2)]
    (folder / "runs" / "done" / "metrics.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in lines)
    )
    return folder


def test_every_distribution_and_plugin_is_installed() -> None:
    """The test below checks each plugin's module only where it is installed."""
    folders = [*(ROOT / "packages").iterdir(), *(ROOT / "plugins").glob("ups-*")]
    missing = []
    for folder in sorted(folders):
        try:
            importlib.metadata.distribution(folder.name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(folder.name)
    assert not missing, f"not installed: {', '.join(missing)} (nox -s test-plugins installs all)"


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["--help"], id="help"),
        pytest.param(["plugins"], id="plugins"),
        pytest.param(["validate", "lazy.yaml"], id="validate"),
        pytest.param(["launch", "run.yaml", "--launcher", "local", "--dry-run"], id="dry-run"),
        pytest.param(["status", "runs/run"], id="status"),
        pytest.param(["logs", "runs/run"], id="logs"),
        pytest.param(["cancel", "runs/run"], id="cancel"),
        pytest.param(["report", "runs/done"], id="report"),
    ],
)
def test_a_command_that_does_not_train_imports_no_torch(args: list[str], project: Path) -> None:
    status, imported = ups(*args, cwd=project)
    ok = args[0] in ("--help", "plugins", "validate", "report")
    assert status == 0 if ok else status in (0, 2)  # status, logs, cancel: the folder is empty
    assert not imported
