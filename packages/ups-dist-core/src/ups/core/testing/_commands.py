"""The ``ups`` command in a subprocess, the events of its logs, waiting for what it does, and
processes in which chosen packages are not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest


def run_ups(
    *args: str,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run the ``ups`` command (``python -m ups.core ARGS``) as users do, logging JSON, in
    ``cwd``, with ``env``'s variables added to this process's environment (``UPS_FAULTS``,
    ``PYTHONPATH``); return its exit status, stdout and stderr (never raising for the status).

    :raises subprocess.TimeoutExpired: when it runs longer than ``timeout`` seconds.
    """
    return subprocess.run(
        [sys.executable, "-m", "ups.core", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ | {"UPS_LOG_FORMAT": "json"} | dict(env or {}),
        cwd=cwd,
        check=False,
    )


def events(log: Path | str, name: str | None = None) -> list[dict[str, Any]]:
    """The JSON log events of ``log``, in order: of a log file when a :class:`~pathlib.Path`
    (a rank's ``logs/rank<N>.jsonl``, every attempt's; each line must be one), else of the text
    itself (``stderr`` from :func:`run_ups`, what a console got), whose lines that are not JSON
    objects (the launcher's own words) are left out. With ``name``, only the events so named.
    """
    if isinstance(log, Path):
        found = [json.loads(line) for line in log.read_text().splitlines()]
    else:
        found = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    return [e for e in found if name is None or e.get("event") == name]


def wait_for(
    condition: Callable[[], object],
    timeout: float,
    what: str,
    *,
    process: subprocess.Popen[Any] | None = None,
    details: Callable[[], str] | None = None,
) -> None:
    """Return once ``condition()`` is true, checking every 50 ms.

    :raises AssertionError: ``timed out after TIMEOUT s while waiting for WHAT``, or, once
        ``process`` (the one expected to bring the condition about) has exited, ``the
        process PID exited with status N while waiting for WHAT``; then ``details()`` (what
        the process logged, say) on the lines below.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            problem = f"the process {process.pid} exited with status {process.returncode}"
        elif time.monotonic() > deadline:
            problem = f"timed out after {timeout:g} s"
        else:
            time.sleep(0.05)
            continue
        more = f"\n{details()}" if details is not None else ""
        raise AssertionError(f"{problem} while waiting for {what}{more}")


WITHOUT = "UPS_TEST_WITHOUT"
"""The packages (comma-separated) that :func:`without` makes processes lack."""


SITECUSTOMIZE = f'''"""Imports of the packages named in ${WITHOUT} fail, as if not installed."""
import os
import sys
from importlib.abc import MetaPathFinder

_ABSENT = frozenset(filter(None, os.environ.get("{WITHOUT}", "").split(",")))


class _Absent(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _Absent())
'''
"""A ``sitecustomize`` module: on ``PYTHONPATH``, the interpreter runs it at start-up, and a
finder first on ``sys.meta_path`` answers an import of the packages :data:`WITHOUT` names (and
of their modules) as Python answers one of a package that is not there."""


def without(monkeypatch: pytest.MonkeyPatch, folder: Path, *packages: str) -> None:
    """Have the processes a test starts from now on (:func:`run_ups`, ``subprocess``) run as
    where ``packages`` are not installed (everything else from the same environment), through
    a ``sitecustomize`` in ``folder``; checks that they do."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    paths = [str(folder), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    monkeypatch.setenv(WITHOUT, ",".join(packages))
    for package in packages:
        tried = subprocess.run(
            [sys.executable, "-c", f"import {package}"], capture_output=True, text=True, check=False
        )
        assert f"ModuleNotFoundError: No module named '{package}'" in tried.stderr, tried
