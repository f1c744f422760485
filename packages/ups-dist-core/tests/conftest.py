"""Fixtures shared by ups-dist-core's tests."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from ups.core.cli._main import main
from ups.core.testing import tiny_project

Result = subprocess.CompletedProcess[str]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A folder with ``tiny.py`` and ``run.yaml``: 2 epochs of the tiny regression problem."""
    tiny_project(tmp_path, training={"epochs": 2})
    return tmp_path


@pytest.fixture
def ups(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., Result]:
    """``ups ARGS`` run by :func:`ups.core.cli._main.main` in this process, in ``cwd`` if given:
    its exit status, stdout and stderr, as :func:`~ups.core.testing.run_ups` gives a process's."""

    def run(*args: str, cwd: Path | None = None) -> Result:
        capsys.readouterr()
        with monkeypatch.context() as patch:
            if cwd is not None:
                patch.chdir(cwd)
            status = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), status, out, err)

    return run


def assert_refused(result: Result, message: str, project: Path) -> None:
    """``result`` is one line of error starting with ``message``, exit status 2, and no rank
    of the tiny project in ``project`` started (its run has no logs)."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), result.stderr
    assert not (project / "runs" / "tiny" / "logs").exists()
