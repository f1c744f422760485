"""The bundled example's trained model out of its run folder: a few steps of
``ups train examples/pde_multitask.yaml --nproc 2``, ``ups export``, and
``ups.core.load_model`` in a fresh process (no process group) predicting with it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from ups.core.testing import assert_bitwise_equal, read_checkpoint, run_ups

ROOT = Path(__file__).resolve().parents[1]

PREDICT = """
import sys
import torch
import torch.distributed as dist
import ups.core

model = ups.core.load_model(sys.argv[1]).eval()
inputs = torch.load(sys.argv[2], weights_only=True)
with torch.no_grad():
    print(tuple(model(inputs).shape), dist.is_initialized())
torch.save(model.state_dict(), sys.argv[3])
"""


def test_the_example_s_model_exports_and_loads_in_a_fresh_process(tmp_path: Path) -> None:
    trained = run_ups(
        *("train", str(ROOT / "examples" / "pde_multitask.yaml"), "--nproc", "2"),
        *("-o", f"run.output_dir={tmp_path}", "-o", "training.max_steps=4"),
        *("-o", "eval.every_steps=1000", "-o", "eval.options.samples_per_task=4"),
        cwd=tmp_path,
        timeout=300,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    run_dir = tmp_path / "pde-multitask"
    saved = dict(read_checkpoint(run_dir / "checkpoints" / "step-4")["state"]["model"])

    output = tmp_path / "model.pt"
    exported = run_ups("export", str(run_dir), "--output", str(output))
    assert exported.returncode == 0, exported.stderr
    assert exported.stdout.strip() == (
        f"ups: wrote the weights of {run_dir / 'checkpoints' / 'step-4'} to {output}"
    )
    assert_bitwise_equal(dict(torch.load(output, weights_only=True)), saved)

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from pde_multitask import build_dataset
    finally:
        sys.path.remove(str(ROOT / "examples"))
    dataset = build_dataset(samples_per_task=2)
    torch.save(torch.stack([dataset[i][0] for i in range(4)]), tmp_path / "inputs.pt")
    loaded = tmp_path / "loaded.pt"
    fresh = subprocess.run(
        [sys.executable, "-c", PREDICT, str(run_dir), str(tmp_path / "inputs.pt"), str(loaded)],
        capture_output=True,
        text=True,
    )
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert fresh.stdout.split("\n")[-2] == "(4, 64) False"
    assert_bitwise_equal(dict(torch.load(loaded, weights_only=True)), saved)
