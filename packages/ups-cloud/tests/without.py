"""Run ``ups`` as it runs where some packages are not installed.

:func:`without` puts a ``sitecustomize`` on ``PYTHONPATH`` for the processes a test starts
(:func:`ups.core.testing.run_ups`): it places a finder first on ``sys.meta_path`` that answers
an import of the named packages (and of their modules) as Python answers one of a package that
is not there, with ``ModuleNotFoundError``. Everything else comes from the same environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

VARIABLE = "UPS_TEST_WITHOUT"
SITECUSTOMIZE = f'''"""Imports of the packages named in ${VARIABLE} fail, as if not installed."""
import os
import sys
from importlib.abc import MetaPathFinder

_ABSENT = frozenset(filter(None, os.environ.get("{VARIABLE}", "").split(",")))


class _Absent(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _Absent())
'''


def without(monkeypatch: pytest.MonkeyPatch, folder: Path, *packages: str) -> None:
    """Have the processes started from now on lack ``packages`` (``sitecustomize`` in
    ``folder``); checks that they do."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    paths = [str(folder), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    monkeypatch.setenv(VARIABLE, ",".join(packages))
    for package in packages:
        tried = subprocess.run(
            [sys.executable, "-c", f"import {package}"], capture_output=True, text=True, check=False
        )
        assert f"ModuleNotFoundError: No module named '{package}'" in tried.stderr, tried
