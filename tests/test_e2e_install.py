"""A user installs one plugin distribution into a fresh venv: it brings ups-dist-core and torch,
and nothing of the other ups distributions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str | Path, cwd: Path) -> str:
    result = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=900, cwd=cwd
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


def test_installing_ups_samplers_alone(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    # torch pinned to the build on this machine's disk; ups-samplers itself asks for any torch >= 2.2
    run(
        python,
        "-m",
        "pip",
        "install",
        "-q",
        "torch==2.13.0",
        ROOT / "packages" / "ups-samplers",
        cwd=tmp_path,
    )
    installed = run(python, "-m", "pip", "list", "--format=freeze", cwd=tmp_path).lower()
    names = {line.split("==")[0] for line in installed.split()}
    assert {"ups-dist-core", "ups-samplers", "torch"} <= names
    assert not names & {"ups-ckpt", "ups-comm-hooks", "ups-cloud"}
    listing = run(venv / "bin" / "ups", "plugins", cwd=tmp_path)
    rows = [line.split() for line in listing.splitlines()]
    assert ["sampler", "tensor", "ups-samplers", "ups-samplers", "0.1.0", "enabled"] in rows
    assert ["sampler", "torch", "ups-dist-core", "ups-dist-core", "0.1.0", "enabled"] in rows
