"""What the GPU tests share: ``ups`` run as users run it, optionally with deterministic
algorithms on, and what a run leaves behind (its events, its checkpoints)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ups.core.launch._processes import free_port
from ups.core.testing import read_checkpoint

ROOT = Path(__file__).resolve().parents[2]
MULTITASK = ROOT / "examples" / "pde_multitask.yaml"
OPERATOR = ROOT / "examples" / "pde_operator" / "pde_operator.yaml"

DETERMINISTIC = (
    "import sys, torch; torch.use_deterministic_algorithms(True); "
    "torch.backends.cudnn.benchmark = False; "
    "from ups.core.cli._main import main; sys.exit(main())"
)
"""``ups`` with ``torch.use_deterministic_algorithms(True)``: what docs/fault-tolerance.md says a
bitwise run on a GPU needs (with ``CUBLAS_WORKSPACE_CONFIG``, set by the conftest)."""

BITWISE_KEYS = (
    "model",
    "optimizer",
    "scheduler",
    "scaler",
    "schedule",
    "sampler",
    "step",
    "epoch",
    "epoch_left",
    "rng",
    "ranks",
)
"""The parts of a checkpoint a resumed run must end bitwise equal in (``ranks``: each rank's
own generators, comm hook state and plugins' states)."""


def ups(
    *args: str,
    cwd: Path,
    deterministic: bool = False,
    env: dict[str, str] | None = None,
    timeout: float = 900,
) -> subprocess.CompletedProcess[str]:
    """Run ``ups ARGS`` in a new process, logging JSON; ``deterministic``: with deterministic
    algorithms on. Never raises for the exit status: the caller checks it."""
    command = ["-c", DETERMINISTIC] if deterministic else ["-m", "ups.core"]
    return subprocess.run(
        [sys.executable, *command, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=os.environ | {"UPS_LOG_FORMAT": "json"} | (env or {}),
        check=False,
    )


def nccl_world_of_one() -> dict[str, str]:
    """The environment torchrun gives the only rank of a one-process job: ``ups train`` then
    joins a real process group of world size 1 (with ``distributed.enabled: true``)."""
    return {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }


def events(result: subprocess.CompletedProcess[str], name: str | None = None) -> list[Any]:
    """The JSON log events of a run (rank 0's and the warnings of the others), or those named
    ``name``; fails with the run's stderr when it did not succeed."""
    assert result.returncode == 0, result.stderr[-4000:]
    found = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    return [e for e in found if name is None or e["event"] == name]


def checkpoint(run_dir: Path, step: int) -> dict[str, Any]:
    """The state the ``simple`` backend saved at ``step``, loaded onto the CPU, with every
    rank's own state as a list under ``ranks``."""
    saved = read_checkpoint(run_dir / "checkpoints" / f"step-{step}")
    return {**saved["state"], "ranks": saved["ranks"]}


def losses(result: subprocess.CompletedProcess[str]) -> list[float]:
    """The training loss of every report."""
    return [e["loss"] for e in events(result, "step")]
