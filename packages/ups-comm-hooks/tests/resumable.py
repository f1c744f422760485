"""A small DDP training run with a comm hook of this package that can be saved and resumed: the
tests of the hooks' checkpointed state train, save, go on, and resume from what was saved."""

from __future__ import annotations

import copy
import io
from typing import Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ups.comm_hooks import plugin
from ups.core import CommHookPlugin, RunContext, load_plugins


def registry_select(name: str, options: dict[str, Any]) -> tuple[CommHookPlugin, Any]:
    """The plugin ``name`` and its options built from ``options``, as the engine gets them."""
    registry = load_plugins(
        extra=[("ups-comm-hooks", plugin)], env={"UPS_DISABLE_PLUGIN_AUTOLOAD": "1"}
    )
    record, built = registry.select("comm_hook", name, options, "comm_hook")
    assert isinstance(record, CommHookPlugin)
    return record, built


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 4)
    )


class Run:
    """A DDP model with the hook ``hook``, its optimizer, and this rank's data: step ``t`` is
    the same batch whichever run trains it. ``resume``: what :meth:`saved` returned, the hook's
    state under ``hook`` (``None``: start the hook afresh)."""

    def __init__(
        self,
        ctx: RunContext,
        options: dict[str, Any],
        bucket_cap_mb: float,
        resume: dict[str, Any] | None = None,
        hook: str = "powersgd",
    ) -> None:
        self.ctx = ctx
        self.module = model(seed=1)
        if resume is not None:
            self.module.load_state_dict(resume["model"])
        self.ddp = DistributedDataParallel(self.module, bucket_cap_mb=bucket_cap_mb)
        record, built = registry_select(hook, options)
        self.state: Any = cast(Any, record.factory(self.ddp, ctx=ctx, options=built))
        self.optimizer = torch.optim.SGD(self.ddp.parameters(), lr=0.1, momentum=0.9)
        if resume is not None:
            # A copy: SGD keeps the momentum tensors it is given and updates them in place, and
            # one saved state resumes more than one run.
            self.optimizer.load_state_dict(copy.deepcopy(resume["optimizer"]))
            if resume.get("hook") is not None:
                self.state.load_state_dict(resume["hook"])

    def train(self, steps: range) -> None:
        for step in steps:
            g = torch.Generator().manual_seed(1000 * self.ctx.rank + step)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            self.optimizer.zero_grad()
            torch.autograd.backward(nn.functional.mse_loss(self.ddp(x), y))
            self.optimizer.step()

    def saved(self) -> dict[str, Any]:
        """The model's, optimizer's and hook's states, the hook's through ``torch.save`` and
        ``torch.load(weights_only=True)`` as a checkpoint keeps it (its bytes: ``hook_bytes``)."""
        buffer = io.BytesIO()
        torch.save(self.state.state_dict(), buffer)
        buffer.seek(0)
        return {
            "model": copy.deepcopy(self.module.state_dict()),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "hook": torch.load(buffer, weights_only=True),
            "hook_bytes": buffer.getvalue(),
        }

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.module.parameters()]
