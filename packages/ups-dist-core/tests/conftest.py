"""Fixtures shared by ups-dist-core's tests."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

MODEL_AND_DATA = """
import torch
from torch import nn
from torch.utils.data import TensorDataset


def build_model(width=8):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))


def build_dataset(n=64):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def not_a_model():
    return 42
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A folder with a tiny model/data module and a config ``run.yaml`` that trains it."""
    (tmp_path / "tiny.py").write_text(MODEL_AND_DATA)
    (tmp_path / "run.yaml").write_text(
        textwrap.dedent(
            f"""\
            run: {{name: tiny, output_dir: {tmp_path / "runs"}, log_every: 2}}
            model: {{factory: tiny.py:build_model}}
            data: {{factory: tiny.py:build_dataset, options: {{n: 64}}}}
            training: {{epochs: 2, batch_size: 8, lr: 0.05}}
            """
        )
    )
    return tmp_path
