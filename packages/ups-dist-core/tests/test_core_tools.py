"""The engine's tools on real ranks: ``ups tune`` (the collective batch-size finder) and
``ups train --profile`` (traces and the communication profile)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ups.core import load_config, train
from ups.core.launch._processes import tune
from ups.core.testing import run_ups, tiny_project

LIMITED_MODULE = '''
import os

import torch
from torch import nn


class Limited(nn.Module):
    """Runs out of memory on batches larger than its rank's limit."""

    def __init__(self, limits):
        super().__init__()
        self.inner = nn.Linear(4, 1)
        self.limit = limits[int(os.environ.get("RANK", "0"))]

    def forward(self, x):
        if len(x) > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory: {len(x)} > {self.limit}")
        return self.inner(x)


def build_model(limits):
    return Limited(limits)
'''


def limited_project(folder: Path, limits: list[int]) -> Path:
    """The tiny project, with a model that fits batches up to ``limits[rank]``."""
    model = {"factory": "limited.py:build_model", "options": {"limits": limits}}
    config = tiny_project(folder, model=model)
    (folder / "limited.py").write_text(LIMITED_MODULE)
    return config


def test_tune_on_one_process_finds_the_largest_batch_that_fits(tmp_path: Path) -> None:
    config = load_config(limited_project(tmp_path, [40]))
    assert tune(config, nproc=1) == 40
    assert tune(config, nproc=1, limit=16) == 16
    assert not (tmp_path / "runs").exists()  # it trains nothing and writes nothing there


@pytest.mark.slow
def test_tune_on_two_ranks_agrees_on_what_fits_everywhere(tmp_path: Path) -> None:
    config = limited_project(tmp_path, [40, 23])
    run = run_ups("tune", str(config), "--nproc", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-1] == "training.batch_size: 23 fits on every rank (2 processes)"


@pytest.mark.slow
def test_profile_writes_a_trace_per_rank_and_the_communication_profile(tmp_path: Path) -> None:
    config = tiny_project(tmp_path, training={"epochs": 2}, run={"profile_steps": 2})
    result = train(config, nproc=2)
    assert result.steps == 8
    folder = tmp_path / "runs" / "tiny" / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["comm.json", "rank0.json", "rank1.json"]
    for rank in (0, 1):
        steps = {
            e["name"]
            for e in json.loads((folder / f"rank{rank}.json").read_text())["traceEvents"]
            if e.get("name", "").startswith("ProfilerStep#")
        }
        assert steps == {"ProfilerStep#2", "ProfilerStep#3"}  # after the skipped and warm-up
    comm = json.loads((folder / "comm.json").read_text())
    assert [r["rank"] for r in comm["ranks"]] == [0, 1]
    for rank in comm["ranks"]:
        assert rank["total_s"] > 0 and 0 <= rank["comm_share"] <= 1
        assert rank["peak_memory_mb"] > 0


COUNTED_MODULE = """
from torch import nn


class Counted(nn.Linear):
    flops_per_sample = 6e6
    tokens_per_sample = 4

    def __init__(self):
        super().__init__(4, 1)


def build_model():
    return Counted()
"""


def test_a_model_that_counts_gets_tokens_tflops_and_mfu_in_its_reports(tmp_path: Path) -> None:
    config = tiny_project(
        tmp_path, model={"factory": "counted.py:build_model"}, training={"peak_flops": 1e9}
    )
    (tmp_path / "counted.py").write_text(COUNTED_MODULE)
    result = train(config)
    for report in result.metrics:
        rate = report["samples_per_s"]
        assert rate == pytest.approx(report["samples"] / (report["step_time_s"] * 2))
        assert report["tokens_per_s"] == pytest.approx(4 * rate)
        assert report["tflops"] == pytest.approx(6e6 * rate / 1e12)
        assert report["mfu"] == pytest.approx(6e6 * rate / 1e9)
