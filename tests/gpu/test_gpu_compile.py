"""``training.compile`` through the engine on CUDA: the compiled model trains, alone and inside
DDP on NCCL (world size 1), and ends close to the same run without compiling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_runs import checkpoint, events, losses, nccl_world_of_one, ups

from ups.core.testing import tiny_project

pytestmark = pytest.mark.gpu


def train(folder: Path, compile: bool, nccl: bool) -> dict[str, torch.Tensor]:
    """The tiny project for 2 epochs (16 steps), on the GPU; its final parameters."""
    distributed = {"enabled": True, "backend": "nccl"} if nccl else {}
    config = tiny_project(
        folder, training={"epochs": 2, "compile": compile}, distributed=distributed
    )
    result = ups("train", str(config), cwd=folder, env=nccl_world_of_one() if nccl else None)
    (start,) = events(result, "training")
    assert (start["device"], start["backend"]) == ("cuda:0", "nccl" if nccl else None)
    curve = losses(result)
    assert curve[-1] < curve[0], curve
    model: dict[str, torch.Tensor] = checkpoint(folder / "runs" / "tiny", 16)["model"]
    return model


@pytest.mark.parametrize("nccl", [False, True], ids=["one_process", "ddp_nccl"])
def test_a_compiled_model_trains_like_the_eager_one(tmp_path: Path, nccl: bool) -> None:
    compiled = train(tmp_path / "compiled", True, nccl)
    eager = train(tmp_path / "eager", False, nccl)
    # torch.compile wraps the module: the checkpoint holds the model's own names all the same.
    assert compiled.keys() == eager.keys()
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-4, atol=1e-5, msg=name)
