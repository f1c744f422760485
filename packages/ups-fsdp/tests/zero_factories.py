"""The model and data :mod:`test_fsdp_zero`'s runs name by file path (a test module cannot be
loaded so: hypothesis refuses a ``@given`` defined while another runs)."""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.utils.data import TensorDataset


def build_model(width: int = 8, layers: int = 2) -> nn.Module:
    """``layers`` linear layers of ``width`` (tanh between), from 4 inputs to 2 outputs."""
    torch.manual_seed(0)
    sizes = [4, *[width] * (layers - 1), 2]
    modules: list[nn.Module] = []
    for inputs, outputs in itertools.pairwise(sizes):
        modules += [nn.Linear(inputs, outputs), nn.Tanh()]
    return nn.Sequential(*modules[:-1])


def build_tuples(n: int) -> TensorDataset:
    """``n`` ``(inputs, targets)`` tuples of a smooth function of 4 inputs to 2 outputs."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=generator)
    return TensorDataset(x, torch.sin(x @ torch.randn(4, 2, generator=generator)))
