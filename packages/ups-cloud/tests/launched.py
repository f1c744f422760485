"""What the launchers' tests share: the tiny project to launch, and a launcher that remembers
what it submitted (so a test's teardown cancels any job left running). The JSON events of a
job's log and waiting for a condition are :func:`ups.core.testing.events` and
:func:`~ups.core.testing.wait_for`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ups.core import LaunchRequest
from ups.core.testing import tiny_project


def tiny(folder: Path) -> Path:
    """The tiny project (``ups.core.testing.tiny_project``) in ``folder``: 2 gloo ranks."""
    tiny_project(folder, distributed={"backend": "gloo", "timeout_s": 60})
    return folder


class Tidy:
    """Mixed into a launcher class: remembers the handles ``submit`` returned."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.handles: list[str] = []

    def submit(self, request: LaunchRequest) -> str:
        handle: str = super().submit(request)  # type: ignore[misc]
        self.handles.append(handle)
        return handle


@contextmanager
def cancelling(launcher: Any) -> Iterator[Any]:
    """``launcher``; every job it submitted is cancelled on the way out."""
    try:
        yield launcher
    finally:
        for handle in launcher.handles:
            launcher.cancel(handle)
