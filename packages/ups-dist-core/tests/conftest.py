"""Fixtures shared by ups-dist-core's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from ups.core.testing import tiny_project


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A folder with ``tiny.py`` and ``run.yaml``: 2 epochs of the tiny regression problem."""
    tiny_project(tmp_path, training={"epochs": 2})
    return tmp_path
