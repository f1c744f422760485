"""The training loop through the Python API, on one and on two real processes."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from ups.core import load_config, train
from ups.core.config._config import EvalConfig
from ups.core.testing import events, read_checkpoint


def test_two_processes_train_and_return_rank_0s_result(project: Path) -> None:
    result = train(project / "run.yaml", nproc=2, overrides=["training.epochs=10"])
    # 64 samples / 2 ranks / batch 8 = 4 steps an epoch.
    assert (result.steps, result.epochs) == (40, 10)
    assert len(result.losses) == 20
    assert result.losses[-1] < result.losses[0] / 2
    assert result.checkpoint is not None
    saved = read_checkpoint(result.checkpoint)
    state = saved["state"]
    assert state["step"] == 40
    # each rank's own generators
    assert [set(own["rng"]) for own in saved["ranks"]] == [{"torch", "numpy", "python"}] * 2
    assert set(state["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # unwrapped from DDP
    # DDP's own all-reduce sends every float32 gradient each step
    grad_bytes = sum(t.numel() * 4 for t in state["model"].values())
    for metrics in result.metrics:
        assert metrics["comm_bytes"] == metrics["allreduce_bytes"] == grad_bytes
        assert metrics["comm_ratio"] == 1
    # every rank's own log, at info level, whatever its console shows
    for rank in (0, 1):
        logged = events(project / "runs" / "tiny" / "logs" / f"rank{rank}.jsonl")
        assert {e["rank"] for e in logged} == {rank}
        assert logged[0]["event"] == "training"
        assert [e["steps"] for e in logged if e["event"] == "done"] == [40]


def test_one_process_trains_in_place_and_stops_at_max_steps(project: Path) -> None:
    config = load_config(project / "run.yaml", ["training.max_steps=5", "checkpoint.every_steps=2"])
    result = train(config)
    assert result.steps == 5
    folder = project / "runs" / "tiny" / "checkpoints"
    # every 2 steps, then the final one; the simple backend keeps the last 2
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-4", "step-5"]


def test_the_run_folder_holds_the_resolved_config_and_every_metric(project: Path) -> None:
    config = load_config(project / "run.yaml", ["training.lr=0.02"])
    config = attrs.evolve(
        config,
        eval=EvalConfig(factory=config.data.factory, options={"n": 20}, every_steps=4),
    )
    result = train(config)
    folder = project / "runs" / "tiny"
    assert load_config(folder / "config.yaml") == config  # repeatable as it ran
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    train_lines = [line for line in lines if line["kind"] == "train"]
    assert [line["step"] for line in train_lines] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert [line["loss"] for line in train_lines] == pytest.approx(list(result.losses))
    assert [line["step"] for line in lines if line["kind"] == "eval"] == [4, 8, 12, 16]
