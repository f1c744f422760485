"""NCCL through the engine: ``ups train`` as the only rank of a torchrun job (a process group
of world size 1 on one GPU, DDP and its comm hook in place), with every comm hook; each run
resumes bitwise. Ours ``bf16``/``fp16`` hooks against torch's own ``bf16_compress_hook`` and
``fp16_compress_hook``, which DDP accepts on NCCL only: bitwise equal."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_runs import BITWISE_KEYS, checkpoint, events, losses, nccl_world_of_one, ups
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ups.core import CommHookPlugin, distributed_session, load_plugins
from ups.core.testing import assert_bitwise_equal, tiny_project

pytestmark = pytest.mark.gpu

HOOKS: dict[str, dict[str, Any]] = {
    "none": {},
    "allreduce": {},
    "bf16": {},
    "fp16": {},
    "powersgd": {"matrix_approximation_rank": 1, "start_powersgd_iter": 2},
    # Started later: these two, coarser, make the tiny model's loss rise if started at step 2.
    "batched_powersgd": {"matrix_approximation_rank": 1, "start_powersgd_iter": 8},
    "topk": {"ratio": 0.1, "start_iter": 8},
}
STEPS, STOP = 16, 11
"""The runs' steps, and where the stopped run stops: mid-epoch, every hook compressing."""


def train(folder: Path, hook: str, steps: int) -> subprocess.CompletedProcess[str]:
    """The tiny project (a model of width 64; 64 samples in batches of 8: 16 steps in 2 epochs)
    on NCCL, world size 1, with ``hook``, deterministic; resuming from ``folder`` if it can."""
    config = tiny_project(
        folder,
        model={"options": {"width": 64}},
        training={"epochs": 2, "max_steps": steps},
        distributed={"enabled": True, "backend": "nccl"},
        comm_hook={"name": hook, "options": HOOKS[hook]},
        checkpoint={"resume": "latest"},
        run={"log_every": 4},
    )
    return ups("train", str(config), cwd=folder, deterministic=True, env=nccl_world_of_one())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every hook's whole run, and its run stopped at step 11 and resumed."""
    found = {}
    for hook in HOOKS:
        folder = tmp_path_factory.mktemp(hook)
        whole = train(folder / "whole", hook, STEPS)
        stopped = train(folder / "parts", hook, STOP)
        resumed = train(folder / "parts", hook, STEPS)
        found[hook] = {
            "whole": whole,
            "resumed": resumed,
            "stopped_at": [e["steps"] for e in events(stopped, "done")],
            "final": checkpoint(folder / "whole" / "runs" / "tiny", STEPS),
            "final_resumed": checkpoint(folder / "parts" / "runs" / "tiny", STEPS),
        }
    return found


@pytest.mark.parametrize("hook", list(HOOKS))
def test_every_hook_trains_on_nccl_and_resumes_bitwise(
    runs: dict[str, dict[str, Any]], hook: str
) -> None:
    run = runs[hook]
    (start,) = events(run["whole"], "training")
    assert (start["backend"], start["world_size"], start["device"]) == ("nccl", 1, "cuda:0")
    curve = losses(run["whole"])
    assert curve[-1] < curve[0], curve
    assert run["stopped_at"] == [STOP]
    assert [e["step"] for e in events(run["resumed"], "resumed")] == [STOP]
    for key in BITWISE_KEYS:
        assert_bitwise_equal(run["final_resumed"][key], run["final"][key], key)
    last = events(run["whole"], "step")[-1]
    assert last["allreduce_bytes"] > 0
    if hook in ("none", "allreduce"):
        assert last["comm_ratio"] == 1
    elif hook in ("bf16", "fp16"):
        assert last["comm_ratio"] == 0.5
    else:  # compressing after start_iter (the small last layer and biases go as they are)
        assert last["comm_ratio"] < 0.6


def test_ours_allreduce_is_ddps_own_bit_for_bit(runs: dict[str, dict[str, Any]]) -> None:
    assert_bitwise_equal(runs["allreduce"]["final"]["model"], runs["none"]["final"]["model"])
    with pytest.raises(AssertionError):  # bf16 rounds: it is not
        assert_bitwise_equal(runs["bf16"]["final"]["model"], runs["none"]["final"]["model"])


TORCH_HOOKS = {
    "bf16": (default_hooks.bf16_compress_hook, torch.bfloat16),
    "fp16": (default_hooks.fp16_compress_hook, torch.float16),
}


# ProcessGroupNCCL warns (as Python warnings) about guessing the device of a barrier.
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", list(TORCH_HOOKS))
def test_ours_16_bit_hooks_equal_torchs_bitwise_on_nccl(name: str) -> None:
    """World size 1: torch's hook casts, then divides by 1 in 16 bits; ours divides by 1,
    then casts: both round each float32 gradient to 16 bits once."""
    theirs, dtype = TORCH_HOOKS[name]
    registry = load_plugins()
    with distributed_session(True, "nccl", env=nccl_world_of_one()) as ctx:
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 1)).to(ctx.device)
        models = {side: copy.deepcopy(base) for side in ("ours", "torch", "plain")}
        # A small bucket cap: several buckets, so each hook runs more than once.
        ddps = {
            side: DistributedDataParallel(m, device_ids=[ctx.device], bucket_cap_mb=0.25)
            for side, m in models.items()
        }
        record, options = registry.select("comm_hook", name, {}, "comm_hook")
        assert isinstance(record, CommHookPlugin)
        record.factory(ddps["ours"], ctx=ctx, options=options)
        ddps["torch"].register_comm_hook(None, theirs)
        x = torch.randn(64, 256, device=ctx.device) * 10
        for ddp in ddps.values():
            ddp(x).square().mean().backward()
        for ours, torchs, plain in zip(*(m.parameters() for m in models.values()), strict=True):
            assert ours.grad is not None and torchs.grad is not None and plain.grad is not None
            assert torch.equal(ours.grad, torchs.grad)
            assert torch.equal(ours.grad, plain.grad.to(dtype).float())
            assert not torch.equal(ours.grad, plain.grad)  # the hook did round
