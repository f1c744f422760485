"""The training loop through the Python API, on one and on two real processes."""

from __future__ import annotations

from pathlib import Path

import torch

from ups.core import load_config, train


def test_two_processes_train_and_return_rank_0s_result(project: Path) -> None:
    result = train(project / "run.yaml", nproc=2, overrides=["training.epochs=10"])
    # 64 samples / 2 ranks / batch 8 = 4 steps an epoch.
    assert (result.steps, result.epochs) == (40, 10)
    assert len(result.losses) == 20
    assert result.losses[-1] < result.losses[0] / 2
    assert result.checkpoint is not None
    state = torch.load(result.checkpoint, weights_only=True)
    assert state["step"] == 40
    assert set(state["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # unwrapped from DDP


def test_one_process_trains_in_place_and_stops_at_max_steps(project: Path) -> None:
    config = load_config(project / "run.yaml", ["training.max_steps=5", "checkpoint.every_steps=2"])
    result = train(config)
    assert result.steps == 5
    folder = project / "runs" / "tiny" / "checkpoints"
    # every 2 steps, then the final one; the simple backend keeps the last 2
    assert sorted(p.name for p in folder.iterdir()) == ["step-000000004.pt", "step-000000005.pt"]
