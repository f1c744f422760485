"""ups-dist-core's test modules, loaded from their files for their helpers (configs, models,
samplers, runs): the strategies here are checked on the same runs as ``ddp`` is there."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

CORE_TESTS = Path(__file__).resolve().parents[2] / "ups-dist-core" / "tests"


def core_tests(name: str) -> types.ModuleType:
    """ups-dist-core's ``tests/<name>.py``, as a module of its own."""
    return loaded(CORE_TESTS / f"{name}.py")


def loaded(path: Path) -> types.ModuleType:
    """The Python file at ``path``, as a module of its own (named after the file)."""
    spec = importlib.util.spec_from_file_location(f"ups_core_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
