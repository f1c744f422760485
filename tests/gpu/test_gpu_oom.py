"""A real CUDA out-of-memory error in a training step (an allocation past the device's memory),
on one rank: every rank skips the step (``training.skip_oom``, ``auto`` on CUDA),
``training.max_oom_skips`` skips in a row are allowed and one more stops every rank, and the
failed step's memory is freed (the steps after it hold what the steps before held)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_runs import ups

from ups.core.testing import tiny_project

pytestmark = pytest.mark.gpu

MODEL = '''
import os

import torch
from torch import nn

LEAKABLE = 256 * 2**20
"""Bytes a failing forward holds when memory runs out: what a leak of its frames would keep."""


class Greedy(nn.Module):
    """The tiny regression model; in training, the forward of each attempt in ``oom_at`` on
    rank ``rank`` asks for twice the device's memory, as a batch too large would."""

    def __init__(self, oom_at, rank):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.oom_at = set(oom_at) if int(os.environ.get("RANK", "0")) == rank else set()
        self.attempts = 0

    def forward(self, x):
        if self.training:
            self.attempts += 1
            if self.attempts in self.oom_at:
                held = torch.empty(LEAKABLE, dtype=torch.uint8, device=x.device)  # noqa: F841
                total = torch.cuda.get_device_properties(x.device).total_memory
                torch.empty(2 * total, dtype=torch.uint8, device=x.device)
        return self.net(x)


def build_model(oom_at=(), rank=0):
    return Greedy(oom_at, rank)


def allocated():
    """A metric: the MiB allocated on the device after the micro-batch's forward."""
    return lambda outputs, targets: {"allocated_mb": torch.cuda.memory_allocated() / 2**20}
'''


def project(folder: Path, oom_at: list[int], max_oom_skips: int) -> Path:
    """2 epochs of 64 samples in batches of 8 (16 steps on one rank, 8 on two), reported every
    step, with the allocated memory as a metric; ``oom_at``: attempts that run out of memory."""
    config = tiny_project(
        folder,
        model={"factory": "greedy.py:build_model", "options": {"oom_at": oom_at, "rank": 0}},
        metrics={"factory": "greedy.py:allocated"},
        training={"epochs": 2, "max_oom_skips": max_oom_skips},
        run={"log_every": 1},
    )
    (folder / "greedy.py").write_text(MODEL)
    return config


def reports(folder: Path) -> list[dict[str, Any]]:
    lines = (folder / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def nproc_params() -> list[Any]:
    two = pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
    )
    return [pytest.param(1, id="1rank"), pytest.param(2, id="2ranks", marks=two)]


@pytest.mark.parametrize("nproc", nproc_params())
def test_an_oom_is_skipped_by_every_rank_up_to_max_oom_skips_in_a_row_and_freed(
    tmp_path: Path, nproc: int
) -> None:
    # attempt 3 alone, then 6 and 7 in a row: 2 in a row is what max_oom_skips allows
    config = project(tmp_path, oom_at=[3, 6, 7], max_oom_skips=2)
    result = ups("train", str(config), "--nproc", str(nproc), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    attempts = 16 // nproc
    found = reports(tmp_path)
    assert [r["step"] for r in found] == list(range(1, attempts - 3 + 1))
    skipped = [r["oom_skipped"] for r in found]
    assert skipped == [0, 0] + [1] * 2 + [3] * (attempts - 3 - 4)
    # The skipped steps' micro-batches are not counted.
    assert sum(r["samples"] for r in found) == 8 * nproc * (attempts - 3)
    # The steps after each skip hold what the steps before held: the failed forward's 256 MiB
    # (and what its frames referenced) were freed, not kept.
    memory = [r["allocated_mb"] for r in found]
    assert max(memory[2:]) - memory[1] < 64, memory


@pytest.mark.parametrize("nproc", nproc_params())
def test_one_oom_more_than_max_oom_skips_stops_every_rank(tmp_path: Path, nproc: int) -> None:
    config = project(tmp_path, oom_at=[3, 4, 5], max_oom_skips=2)
    result = ups("train", str(config), "--nproc", str(nproc), cwd=tmp_path)
    assert result.returncode == 1
    message = (
        "step 3: out of memory on rank 0 3 times in a row (training.max_oom_skips: 2); "
        "lower training.batch_size (`ups tune` finds the largest that fits)"
    )
    if nproc == 2:  # rank 1 did not run out of memory and stops all the same: said once
        failed = [line for line in result.stderr.splitlines() if line.startswith("ups: rank ")]
        assert len(failed) == 1, failed
        assert failed[0].startswith(f"ups: rank 0 failed: RankFailedError: {message}")
