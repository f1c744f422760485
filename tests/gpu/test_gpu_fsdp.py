"""ups-fsdp's strategies on a CUDA device through the engine: ``ups train`` as the only rank of
a torchrun job (a NCCL process group of world size 1), ``fsdp`` sharding over a one-rank mesh:
bf16 with CPU offload (CUDA only) and fp16 with its gradient scaler over DTensor gradients
train, and resume bitwise; ``zero`` on NCCL resumes bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gpu_runs import BITWISE_KEYS, checkpoint, events, losses, nccl_world_of_one, ups

from ups.core.testing import assert_bitwise_equal, tiny_project

pytestmark = pytest.mark.gpu

STEPS, STOP = 16, 11
CASES: dict[str, dict[str, Any]] = {
    "fsdp-bf16-offload": {
        "strategy": {"name": "fsdp", "options": {"cpu_offload": True}},
        "precision": "bf16",
    },
    "fsdp-fp16": {"strategy": {"name": "fsdp"}, "precision": "fp16"},
    "zero-fp32": {"strategy": {"name": "zero"}, "precision": "fp32"},
}


def train(folder: Path, case: str, steps: int) -> Any:
    """The tiny project (width 64, 16 steps in 2 epochs) under ``case`` on NCCL, world size 1,
    deterministic, resuming from ``folder`` if it can."""
    config = tiny_project(
        folder,
        model={"options": {"width": 64}},
        training={
            "epochs": 2,
            "max_steps": steps,
            "precision": CASES[case]["precision"],
            "optimizer": "adamw",
            "grad_clip_norm": 1.0,
        },
        distributed={"enabled": True, "backend": "nccl"},
        strategy=CASES[case]["strategy"],
        checkpoint={"resume": "latest"},
        run={"log_every": 4},
    )
    return ups("train", str(config), cwd=folder, deterministic=True, env=nccl_world_of_one())


@pytest.mark.parametrize("case", list(CASES))
def test_a_strategy_trains_on_cuda_and_resumes_bitwise(tmp_path: Path, case: str) -> None:
    whole = train(tmp_path / "whole", case, STEPS)
    (start,) = events(whole, "training")
    assert (start["backend"], start["device"]) == ("nccl", "cuda:0")
    curve = losses(whole)
    assert curve[-1] < curve[0], curve
    train(tmp_path / "parts", case, STOP)
    resumed = train(tmp_path / "parts", case, STEPS)
    assert [e["step"] for e in events(resumed, "resumed")] == [STOP]
    found = checkpoint(tmp_path / "parts" / "runs" / "tiny", STEPS)
    expected = checkpoint(tmp_path / "whole" / "runs" / "tiny", STEPS)
    for key in BITWISE_KEYS:
        assert_bitwise_equal(found[key], expected[key], key)
