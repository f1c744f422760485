"""The bundled example trained in two short stages on 2 gloo ranks (``stages`` given with
``-o``): the second starts from the first's kept weights at a lower LR, its steps numbered on
from the first's in ``metrics.jsonl``, and ``ups report`` and ``ups export`` read the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ups.core.testing import assert_bitwise_equal, read_checkpoint, run_ups

ROOT = Path(__file__).resolve().parents[1]

STAGES = (
    "stages=[{name: first, max_steps: 2}, {name: second, max_steps: 2, overrides: "
    "{training: {lr: 1.0e-4}, model: {init_from: {stage: first}}}}]"
)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_example_trains_in_two_stages(tmp_path: Path, strategy: str) -> None:
    """Under ``fsdp`` too: the first stage's kept weights (full tensors) warm-start the
    second's sharded model, and its EMA of the shards is kept whole."""
    trained = run_ups(
        *("train", str(ROOT / "examples" / "pde_multitask.yaml"), "--nproc", "2"),
        *("-o", f"run.output_dir={tmp_path}", "-o", "run.log_every=1", "-o", STAGES),
        *("-o", "eval.every_steps=1000", "-o", "eval.options.samples_per_task=4"),
        *("-o", f"strategy.name={strategy}", "-o", "training.ema={decay: 0.5}"),
        cwd=tmp_path,
        timeout=300,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    run_dir = tmp_path / "pde-multitask"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if line["kind"] == "train"] == [1, 2, 3, 4]
    assert [line["lr"] for line in lines if line["kind"] == "train"][2:] == [1.0e-4, 1.0e-4]
    assert json.loads((run_dir / "stages" / "first" / "stage.json").read_text())["end"] == 2
    assert json.loads((run_dir / "stages" / "second" / "stage.json").read_text())["start"] == 2
    state = read_checkpoint(run_dir / "checkpoints" / "step-4")["state"]
    assert state["stage"] == 1
    kept = torch.load(run_dir / "stages" / "second" / "model.pt", weights_only=True)
    assert_bitwise_equal(kept, dict(state["model"]))
    ema = torch.load(run_dir / "stages" / "first" / "ema.pt", weights_only=True)
    assert ema.keys() == kept.keys() and all(type(t) is torch.Tensor for t in ema.values())
    report = run_ups("report", str(run_dir))
    assert report.returncode == 0, report.stderr
    output = tmp_path / "model.pt"
    exported = run_ups("export", str(run_dir), "--output", str(output))
    assert exported.returncode == 0, exported.stderr
    assert_bitwise_equal(dict(torch.load(output, weights_only=True)), kept)
