"""The model, data and steps :mod:`test_core_weighting`'s runs name by file path (a test
module cannot be loaded so: hypothesis refuses a ``@given`` defined while another runs)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from ups.core import Step

TOKENS = 4
"""Items per sample of :class:`TokenStep`'s loss, of which each sample counts 1 to 4."""


def build_model(outputs: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, outputs))


class Samples(Dataset[dict[str, torch.Tensor]]):
    """``n`` samples as dicts: inputs ``x``, targets ``y`` (``TOKENS`` of them) and a ``mask``
    of the first 1 to ``TOKENS`` targets, a sample's counted items."""

    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 4, generator=generator)
        self.y = torch.sin(self.x @ torch.randn(4, TOKENS, generator=generator))
        tokens = torch.randint(1, TOKENS + 1, (n, 1), generator=generator)
        self.mask = (torch.arange(TOKENS) < tokens).float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "y": self.y[index], "mask": self.mask[index]}


def build_dicts(n: int) -> Samples:
    return Samples(n)


def build_tuples(n: int) -> TensorDataset:
    """:class:`Samples`' inputs and first two targets, as ``(inputs, targets)`` tuples."""
    samples = Samples(n)
    return TensorDataset(samples.x, samples.y[:, :2])


class DictStep(Step):
    """One loss per sample, on dict batches (no tasks)."""

    task = None

    def forward(self, model: nn.Module, batch: Any) -> Any:
        return model(batch["x"])

    def loss(self, outputs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return ((outputs - batch["y"][:, :2]) ** 2).mean(dim=1)


class TokenStep(DictStep):
    """A mean over the batch's counted items (its unmasked targets), with their count."""

    def loss(self, outputs: Any, batch: Any) -> tuple[torch.Tensor, int]:  # type: ignore[override]
        mask = batch["mask"]
        count = int(mask.sum())
        return ((outputs - batch["y"]) ** 2 * mask).sum() / count, count


class MeanStep(DictStep):
    """The batch's mean loss, 0-d, without a count."""

    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        return super().loss(outputs, batch).mean()


class MixedStep(DictStep):
    """One loss per sample, but a 0-d mean for a batch of 2 samples or fewer."""

    def loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        per_sample = super().loss(outputs, batch)
        return per_sample if len(per_sample) > 2 else per_sample.mean()
