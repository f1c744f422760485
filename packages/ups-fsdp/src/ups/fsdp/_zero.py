"""The ``zero`` strategy: DDP as ``ddp`` runs it, the optimizer's state sharded over the ranks
(ZeRO-1, torch's :class:`~torch.distributed.optim.ZeroRedundancyOptimizer`).

Each rank keeps the optimizer state of its share of the parameters (whole parameters, shared
out by size) and updates only them; the updated parameters are then broadcast from their
owners, so every rank holds the whole model after each step, as under ``ddp``. Gradients,
accumulation, clipping and comm hooks are DDP's. Checkpoints hold the full optimizer state in
the format of a plain ``Optimizer.state_dict()``: a ``zero`` checkpoint resumes under ``ddp``,
on one process or another number of ranks, and a ``ddp`` one under ``zero``.
"""

from __future__ import annotations

import copy
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ups.core import Config, RunContext, Strategy

with warnings.catch_warnings():
    # torch.distributed.optim uses torch.jit.script and torch.jit.interface as it is imported,
    # which torch >= 2.13 warns are deprecated: torch's own code, not ours.
    warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated", DeprecationWarning)
    from torch.distributed.optim import ZeroRedundancyOptimizer

BuildOptimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
"""Builds the run's optimizer over parameters (or param groups), as the engine passes it."""


class ZeroStrategy(Strategy):
    """DDP with the optimizer's state sharded (``strategy: {name: zero}``; no options). On one
    process there is nothing to shard: the run's optimizer is the configured one."""

    def optimizer(self, build: BuildOptimizer, model: nn.Module) -> torch.optim.Optimizer:
        """A :class:`ZeroRedundancyOptimizer` over ``model``'s parameters whose local optimizer
        (of this rank's share) is ``build``'s, the configured one with its options (``fused``,
        ``foreach``, ...); ``build``'s alone on one process.

        Its ``param_groups`` are the ones LR schedulers and LR multipliers read and write: each
        step hands them to the local optimizer first (and takes its own back after)."""
        if not self.ctx.distributed:
            return build(model.parameters())
        # ZeroRedundancyOptimizer builds its local optimizer as optimizer_class(param_groups,
        # **defaults): ``build`` takes the groups (no defaults: the configuration holds them).
        return ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=typing.cast(type[torch.optim.Optimizer], build)
        )

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The full optimizer state, by parameter index as a plain ``Optimizer.state_dict()``
        gives it (its tensors on the CPU), on rank 0; ``{}`` on every other rank.

        A collective: every rank sends its shard to rank 0. A checkpoint keeps rank 0's state
        only (the ``simple`` backend writes rank 0's; a backend writing every rank's share
        writes tensors no other rank offers from rank 0), so the other ranks hold none of it.
        Rank 0 lets go of the consolidated state once it has it: it keeps only its shard
        between saves."""
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            return super().optimizer_state(optimizer)
        optimizer.consolidate_state_dict(to=0)
        if not self.ctx.is_main:
            return {}
        try:
            return optimizer.state_dict()
        finally:
            # torch keeps it (on the CPU) until the next consolidation: the whole state.
            optimizer._all_state_dicts = []  # type: ignore[attr-defined]

    def load_optimizer_state(
        self, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
    ) -> None:
        """Load a full state (saved under ``zero`` at any number of ranks, or ``ddp``, or one
        process) into ``optimizer``: each rank keeps the state of its own parameters."""
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            super().load_optimizer_state(optimizer, state)
            return
        # ZeroRedundancyOptimizer sets the states other ranks own to None in the mapping it is
        # given (hence a copy), and loads that mapping into the state of the optimizer it
        # exposes too, which its steps never use: emptied, that holds no second copy, and a
        # later save mixes in neither stale states nor a None (a parameter with no state yet).
        optimizer.load_state_dict({**state, "state": dict(state["state"])})
        optimizer.state.clear()
        # It moves every 0-d state (Adam's ``step``) to the CPU, where a fused or capturable
        # CUDA optimizer refuses it: the local optimizer's own load places each as it needs.
        local = optimizer.optim
        local.load_state_dict(local.state_dict())

    def own_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """A copy of this rank's shard (its local optimizer's state) and of the groups'
        hyperparameters that schedulers set, with no collective: the guard's snapshot."""
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            return super().own_optimizer_state(optimizer)
        groups = [
            {k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups
        ]
        return copy.deepcopy({"local": optimizer.optim.state_dict(), "groups": groups})

    def load_own_optimizer_state(
        self, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
    ) -> None:
        """Put back what :meth:`own_optimizer_state` gave on this rank."""
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            super().load_own_optimizer_state(optimizer, state)
            return
        optimizer.optim.load_state_dict(copy.deepcopy(state["local"]))
        for group, saved in zip(optimizer.param_groups, state["groups"], strict=True):
            group.update(copy.deepcopy(saved))


def zero(*, ctx: RunContext, config: Config, options: object) -> Strategy:
    """The ``zero`` strategy (it takes no options)."""
    return ZeroStrategy(ctx, config)
