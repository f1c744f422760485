"""Hooks of the end-to-end tests."""

from __future__ import annotations

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building the install tests' venvs once they are collected, so that pip's waits
    on downloads and disks overlap the tests that run before them (test_e2e_install.py)."""
    for item in session.items:
        if isinstance(item, pytest.Function) and item.path.name == "test_e2e_install.py":
            item.module.start_installs()
            return
