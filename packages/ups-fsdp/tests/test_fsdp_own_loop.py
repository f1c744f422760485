"""``ups.fsdp.strategy`` in a hand-written loop, on 2 gloo ranks: ``zero`` and ``fsdp`` train
as a hand-written DDP loop does (to 1e-5), accumulating with ``backward_unsynced`` and
clipping; the state they give for a checkpoint is full and loads back into the shards; bad
arguments are refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ups.core import ConfigError, RunContext, distributed_session
from ups.core.testing import assert_params_close, run_ranks
from ups.fsdp import strategy

STEPS, MICRO = 4, 3


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 1)
    )


def batches(rank: int) -> list[list[torch.Tensor]]:
    """Each step's micro-batches of this rank."""
    generator = torch.Generator().manual_seed(rank)
    return [[torch.randn(4, 6, generator=generator) for _ in range(MICRO)] for _ in range(STEPS)]


def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) - x[:, :1]).square().mean() / MICRO


def trained(ctx: RunContext, name: str | None) -> dict[str, torch.Tensor]:
    """The loop under strategy ``name`` (``None``: plain DDP, ``no_sync`` between micro-batches),
    the full model after it, saved (the optimizer's state: rank 0's, as a checkpoint keeps
    it) and loaded back through the strategy first."""
    if name is None:
        model: nn.Module = DistributedDataParallel(build())
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        for step in batches(ctx.rank):
            with model.no_sync():
                for x in step[:-1]:
                    loss(model, x).backward()
            loss(model, step[-1]).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            optimizer.step()
            optimizer.zero_grad()
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    s = strategy(name, ctx=ctx)
    model = build()
    wrapped = s.wrap(model)  # zero: in DDP; fsdp: the model itself, sharded in place
    optimizer = s.optimizer(lambda params: torch.optim.AdamW(params, lr=0.01), model)
    for step in batches(ctx.rank):
        for x in step[:-1]:
            s.backward_unsynced(loss(s.unsynced(wrapped), x), model)
        loss(wrapped, step[-1]).backward()
        s.clip_grad_norm(model.parameters(), 0.05)
        optimizer.step()
        optimizer.zero_grad()
    saved_model = s.gathered(model.state_dict())
    saved = [s.optimizer_state(optimizer)]  # rank 0's is the full state (zero: others {})
    dist.broadcast_object_list(saved)  # as every rank reads rank 0's checkpoint
    saved_optimizer = saved[0]
    assert len(saved_optimizer["state"]) == len(list(build().parameters()))
    model.load_state_dict(s.scattered(saved_model, model.state_dict()))
    s.load_optimizer_state(optimizer, saved_optimizer)
    assert s.gathered(model.state_dict()).keys() == saved_model.keys()
    return saved_model


@pytest.mark.parametrize("name", ["zero", "fsdp"])
def test_a_hand_written_loop_trains_as_ddp_under_a_strategy(name: str) -> None:
    expected = run_ranks(trained, 2, None)[0]
    found = run_ranks(trained, 2, name)[0]
    assert all(type(t) is torch.Tensor for t in found.values())  # full tensors to save
    assert_params_close(found, expected, atol=1e-5)


def test_bad_arguments_are_refused_by_name() -> None:
    with distributed_session() as ctx:
        with pytest.raises(
            ConfigError,
            match=r"^name: must be one of 'fsdp', 'zero', not 'FSDP'; did you mean 'fsdp'\?$",
        ):
            strategy("FSDP", ctx=ctx)
        with pytest.raises(ConfigError, match=r"^options\.replicate: expected an integer"):
            strategy("fsdp", ctx=ctx, options={"replicate": "two"})
        with pytest.raises(TypeError, match=r"^ctx"):
            strategy("fsdp", ctx=None)  # type: ignore[arg-type]
