"""A tiny project to train in tests: its model and data module, its config, a plugin installed
as pip would, and a dataset of two tasks."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml
from torch.utils.data import TensorDataset

if TYPE_CHECKING:
    pass


TINY_MODULE = '''"""A tiny regression problem for tests: predict sum(x) from 4 inputs."""
import os
import pathlib
import signal

import torch
from torch import nn
from torch.utils.data import TensorDataset


def build_model(width=8, pid_dir=None, ignore_sigterm=False):
    if pid_dir:  # lets a test find every rank's process
        pathlib.Path(pid_dir, str(os.getpid())).touch()
    if ignore_sigterm:  # a rank that only SIGKILL stops
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))


def build_dataset(n=64):
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(1))
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def not_a_model():
    return 42
'''


def install_plugin(
    site: Path,
    name: str,
    module: str,
    source: str,
    version: str = "0.1",
    entry_point: str | None = None,
) -> None:
    """Install, into the folder ``site``, what pip would leave for a plugin distribution
    ``name``: the module ``module`` with ``source``, and a dist-info folder whose
    ``entry_points.txt`` lists it under the ``ups`` group as ``entry_point`` (default
    ``name``). Put ``site`` on ``sys.path`` (or ``PYTHONPATH``) and
    :func:`~ups.core.load_plugins` finds it."""
    (site / f"{module}.py").write_text(source)
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[ups]\n{entry_point or name} = {module}\n")
    (info / "RECORD").write_text("")


KILLER_MODULE = '''"""A plugin whose process kills itself (SIGKILL) once the checkpoint of step
KILL_AT_STEP (an environment variable) is saved."""
import os
import signal

from ups.core import hookimpl


@hookimpl
def ups_checkpoint_saved(step):
    if step == int(os.environ.get("KILL_AT_STEP", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
'''
"""A plugin's source for :func:`install_plugin`: its run dies as a machine loss would kill it,
right after a checkpoint, to test what a resumed run continues."""


def two_task_dataset(n: int = 64) -> TensorDataset:
    """A ``data.factory`` of two tasks, alternating: the target is the sum of the 4 inputs, or
    its negation; items are ``(inputs, target, task_id)``."""
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    task = torch.arange(n) % 2
    return TensorDataset(x, x.sum(dim=1, keepdim=True) * (1 - 2 * task[:, None]), task)


def tiny_project(folder: Path, **sections: Any) -> Path:
    """Write ``tiny.py`` (:data:`TINY_MODULE`) and a config ``run.yaml`` training it into
    ``folder``; return the config's path.

    The config trains one epoch of 64 samples in batches of 8, reporting every 2 steps, into
    ``folder/runs/tiny``. Each keyword updates that section key by key (a list, such as
    ``schedule``, replaces it):
    ``tiny_project(tmp_path, training={"epochs": 3}, sampler={"name": "tensor"})``.
    """
    config: dict[str, Any] = {
        "run": {"name": "tiny", "output_dir": str(folder / "runs"), "log_every": 2},
        "model": {"factory": "tiny.py:build_model"},
        "data": {"factory": "tiny.py:build_dataset", "options": {"n": 64}},
        "training": {"epochs": 1, "batch_size": 8, "lr": 0.05},
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values} if isinstance(values, Mapping) else values
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny.py").write_text(TINY_MODULE)
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path
