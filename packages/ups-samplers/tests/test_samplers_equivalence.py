"""The promise the samplers keep through the engine: W ranks of batch b train as one process of
batch W·b, step for step, with the ``multitask`` sampler's every mixing and a random transform
in the data, on real gloo ranks (fp32, AdamW with clipping, epochs with a short last batch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ups.core import train
from ups.core.testing import assert_params_close, read_checkpoint, tiny_project

TASKS_MODULE = '''
import torch
from torch import nn
from torch.utils.data import ConcatDataset, Dataset


class Task(Dataset):
    """Samples (x, y, task) of one task; with ``noise``, x gets noise from torch's global
    generator each time it is read (a random transform)."""

    def __init__(self, n, task, noise):
        g = torch.Generator().manual_seed(100 + task)
        self.x = torch.randn(n, 6, generator=g)
        self.y = (self.x * (task + 1)).sum(1, keepdim=True).sin()
        self.task, self.noise = task, noise

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        if self.noise:
            x = x + self.noise * torch.randn(6)
        return x, self.y[i], self.task


def build_dataset(sizes=(96, 48, 24), noise=0.0):
    return ConcatDataset([Task(n, t, noise) for t, n in enumerate(sizes)])


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1))
'''

MIXINGS = [
    {"mixing": "proportional"},
    {"mixing": "balanced"},
    {"mixing": "temperature", "temperature": 3.0},
    {"mixing": "weights", "weights": [1.0, 2.0, 3.0]},
]


def final_params(folder: Path, nproc: int, batch: int, **sections: Any) -> dict[str, Any]:
    """Train 30 steps of the three-task data on ``nproc`` ranks of ``batch``; the parameters."""
    folder.mkdir(parents=True)
    (folder / "tasks.py").write_text(TASKS_MODULE)
    data = {"factory": "tasks.py:build_dataset", "tasks": ["a", "b", "c"], "options": {}}
    config = tiny_project(
        folder,
        model={"factory": "tasks.py:build_model"},
        data={**data, **sections.pop("data", {})},
        training={
            "batch_size": batch,
            "epochs": 5,
            "max_steps": 30,
            "optimizer": "adamw",
            "lr": 0.01,
            "grad_clip_norm": 0.5,
        },
        **sections,
    )
    result = train(config, nproc=nproc)
    assert result.steps == 30
    assert result.checkpoint is not None
    return read_checkpoint(result.checkpoint)["state"]["model"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("options", MIXINGS, ids=[o["mixing"] for o in MIXINGS])
def test_two_ranks_of_b_train_as_one_process_of_2b_with_multitask(
    tmp_path: Path, options: dict[str, Any]
) -> None:
    sampler = {"name": "multitask", "options": options}
    two = final_params(tmp_path / "two", 2, 8, sampler=sampler)
    one = final_params(tmp_path / "one", 1, 16, sampler=sampler)
    assert_params_close(two, one)


def test_a_random_transform_draws_the_same_numbers_on_any_number_of_ranks(
    tmp_path: Path,
) -> None:
    sampler = {"name": "multitask", "options": {"mixing": "temperature"}}
    noisy = {"options": {"noise": 0.3}}
    workers = {"options": {"noise": 0.3}, "loader": {"num_workers": 2}}
    two = final_params(tmp_path / "two", 2, 8, sampler=sampler, data=workers)
    one = final_params(tmp_path / "one", 1, 16, sampler=sampler, data=noisy)
    assert_params_close(two, one)
    torch_two = final_params(tmp_path / "torch-two", 2, 8, data=noisy)  # torch's sampler too
    torch_one = final_params(tmp_path / "torch-one", 1, 16, data=noisy)
    assert_params_close(torch_two, torch_one)
    quiet = final_params(tmp_path / "quiet", 1, 16, sampler=sampler)
    with pytest.raises(AssertionError):
        assert_params_close(quiet, one)  # the noise is there
