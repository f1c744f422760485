"""The GPU suite (``nox -s gpu``): every test here is marked ``gpu``, and where torch sees no
CUDA device each is skipped with the reason ``no CUDA device``, so a CPU machine collects the
whole suite and says why nothing ran (``pytest tests/gpu -rs``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
NO_CUDA = "no CUDA device"

# Deterministic cuBLAS reads this when its first handle is made: before any test runs one
# (docs/fault-tolerance.md, "What is bitwise equal"). The runs in subprocesses inherit it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = torch.cuda.is_available()
    for item in items:
        if HERE not in item.path.parents:
            continue
        if item.get_closest_marker("gpu") is None:
            raise pytest.UsageError(
                f"{item.nodeid}: every test of tests/gpu needs the gpu marker "
                "(pytestmark = pytest.mark.gpu)"
            )
        if not cuda:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))
