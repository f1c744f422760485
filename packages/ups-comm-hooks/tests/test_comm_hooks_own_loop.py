"""``ups.comm_hooks.register_hook`` in a loop of one's own: a hook by name, with options, on a
user's DDP model over real gloo ranks; its state counts bytes and checkpoints. Bad arguments are
refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from ups.comm_hooks import PowerSGDHookState, TopKOptions, TopKState, register_hook
from ups.core import ConfigError, RunContext
from ups.core.testing import run_ranks


def _steps(ctx: RunContext) -> dict[str, Any]:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(16, 16))
    state = register_hook(ddp, "powersgd", ctx=ctx, options={"start_powersgd_iter": 2})
    for _ in range(3):
        ddp(torch.randn(4, 16)).sum().backward()
    topk = register_hook(
        DistributedDataParallel(torch.nn.Linear(4, 4)), "topk", ctx=ctx, options=TopKOptions()
    )
    return {
        "type": type(state).__name__,
        "topk": type(topk).__name__,
        "bytes": state.comm_metrics(3)["comm_bytes"],
        "saved": sorted(state.state_dict()),
    }


@pytest.mark.slow
def test_a_hook_by_name_on_a_user_s_ddp_model() -> None:
    for result in run_ranks(_steps, 2):
        assert result["type"] == PowerSGDHookState.__name__
        assert result["topk"] == TopKState.__name__
        assert result["bytes"] > 0
        assert result["saved"]  # a state to checkpoint with the model


def test_bad_arguments_are_refused_naming_them() -> None:
    ctx = RunContext()
    module = torch.nn.Linear(2, 2)
    with pytest.raises(
        ConfigError,
        match=r"^name: must be one of 'allreduce', .*, not 'powersdg'; "
        r"did you mean 'powersgd'\?$",
    ):
        register_hook(module, "powersdg", ctx=ctx)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^options.matrix_approximation_rank: expected"):
        register_hook(
            module,  # type: ignore[arg-type]
            "powersgd",
            ctx=ctx,
            options={"matrix_approximation_rank": "two"},
        )
    with pytest.raises(ConfigError, match=r"^options: expected a mapping"):
        register_hook(module, "bf16", ctx=ctx, options=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^ddp: must be a DistributedDataParallel model, not a"):
        register_hook(module, "bf16", ctx=ctx)  # type: ignore[arg-type]
