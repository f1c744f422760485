"""How a run spreads its model over the ranks (``strategy: {name, options}``): the built-in
``ddp`` (every rank holds the whole model, gradients all-reduced by DDP), and the contract
that sharded strategies (ups-fsdp's ``zero`` and ``fsdp``) fill in.

The engine asks a :class:`Strategy` for everything that differs between them: what the steps
run through (:meth:`~Strategy.wrap`), how micro-batches before the last accumulate gradients
without synchronising (:meth:`~Strategy.unsynced`, :meth:`~Strategy.backward_unsynced`), the
optimizer over the wrapped parameters, the global gradient norm, the full (unsharded) state a
checkpoint holds (:meth:`~Strategy.gathered`, and :meth:`~Strategy.scattered` back), and what
an evaluation runs under. Checkpoints hold full tensors under every strategy, so any backend
stores them, a run resumes under another strategy or number of ranks, and ``ups export``
needs no process group.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ..config._config import Config
from ..dist._context import RunContext

BuildOptimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
"""Builds the run's optimizer (``training.optimizer`` and its options) over parameters."""


class Strategy:
    """The ``ddp`` strategy, and the base of every other: subclass it and override what
    differs. One is built per rank by its plugin's factory, before the model is wrapped.

    :param ctx: this rank's run context.
    :param config: the run's validated configuration (``distributed`` holds DDP's options).
    """

    comm_hooks: ClassVar[bool] = True
    """Whether DDP communication hooks (``comm_hook``) apply: a strategy without DDP's reducer
    refuses any but ``none``."""
    local_passes: ClassVar[bool] = True
    """Whether a micro-batch can go forward and backward on one rank with no collective (DDP's
    bare module): what agreeing on out-of-memory before the synchronising pass needs
    (``training.skip_oom``), and ``ups tune``'s trials on one rank."""
    replicated: ClassVar[bool] = True
    """Whether every rank holds the whole model, the same after each step: what the check that
    ranks are in sync compares (``distributed.desync_check_every``)."""
    reweighs: ClassVar[bool] = True
    """Whether the gradients that unsynchronised passes accumulate are the parameters' ``.grad``
    before the synchronising backward, where the engine weighs them by the step's count;
    otherwise every pass is weighed alike and the synchronised gradients rescaled after."""

    def __init__(self, ctx: RunContext, config: Config) -> None:
        self.ctx, self.config = ctx, config

    def wrap(self, model: nn.Module) -> nn.Module:
        """What the synchronising passes run through: ``model`` (compiled, where
        ``training.compile`` asks) in DDP with ``distributed``'s options, or alone on one
        process. A collective: DDP broadcasts rank 0's weights."""
        if self.config.training.compile:
            model = typing.cast(nn.Module, torch.compile(model))
        if not self.ctx.distributed:
            return model
        d = self.config.distributed
        buffers: dict[str, Any] = {}
        if not d.broadcast_buffers:
            # torch >= 2.12 renamed it; the new name still syncs buffers once, at construction.
            params = inspect.signature(DistributedDataParallel).parameters
            renamed = "forward_sync_buffers" in params
            buffers = {"forward_sync_buffers" if renamed else "broadcast_buffers": False}
        return DistributedDataParallel(
            model,
            device_ids=[self.ctx.device] if self.ctx.device.type == "cuda" else None,
            bucket_cap_mb=d.bucket_cap_mb,
            static_graph=d.static_graph,
            gradient_as_bucket_view=d.gradient_as_bucket_view,
            find_unused_parameters=d.find_unused_parameters,
            **buffers,
        )

    def optimizer(self, build: BuildOptimizer, model: nn.Module) -> torch.optim.Optimizer:
        """The run's optimizer over ``model``'s parameters (once wrapped): ``build``'s."""
        return build(model.parameters())

    def unsynced(self, wrapped: nn.Module) -> nn.Module:
        """What a micro-batch before a step's last goes through: DDP's bare module (no
        collective), or ``wrapped`` itself when it is not DDP."""
        if isinstance(wrapped, DistributedDataParallel):
            return typing.cast(nn.Module, wrapped.module)
        return wrapped

    def backward_unsynced(self, loss: torch.Tensor, model: nn.Module) -> None:
        """Backward ``loss`` of an :meth:`unsynced` pass, adding its gradients to ``model``'s
        ``.grad`` on this rank only: the step's synchronising backward then reduces the sum.

        Not ``ddp.no_sync()``: with ``static_graph=True`` it trips an internal assert in DDP's
        reducer (pytorch/pytorch#143580, huggingface/accelerate#3679). ``autograd.grad`` never
        runs the gradient accumulators, where the reducer's hooks sit.
        """
        if not self.ctx.distributed:
            loss.backward()  # type: ignore[no-untyped-call]
            return
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        for param, grad in zip(params, grads, strict=True):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad.detach().clone()
            else:
                param.grad.add_(grad)

    def clip_grad_norm(self, parameters: Iterable[nn.Parameter], max_norm: float) -> float:
        """Clip the gradients to the global norm ``max_norm``; return the norm before, the
        same number on every rank."""
        # Gradients are averaged over ranks already: every rank computes the same norm.
        return float(nn.utils.clip_grad_norm_(parameters, max_norm))

    def grad_norm(self, parameters: Iterable[nn.Parameter]) -> float:
        """The global norm of the gradients of ``parameters``, the same number on every rank
        (``training.guard`` without clipping). Sharded gradients (DTensors) are summed over
        the shards: a collective then, which every rank calls."""
        grads = [p.grad for p in parameters if p.grad is not None]
        if _plain(grads):  # one device and dtype: one foreach norm, as get_total_norm's own
            return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
        norm = nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def gathered(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (a model's state dict, the EMA's averages) with full tensors: what a
        checkpoint or a kept file holds. A collective where tensors are sharded: every rank
        calls it with states of the same structure."""
        return state

    def scattered(self, state: Mapping[str, Any], like: Mapping[str, Any]) -> dict[str, Any]:
        """The full tensors of ``state`` placed as the same names are in ``like`` (this rank's
        state, say the sharded model's): what ``load_state_dict`` takes."""
        return dict(state)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's full state, by parameter index as ``Optimizer.state_dict`` gives
        it: what rank 0 saves. A collective where the state is sharded."""
        return optimizer.state_dict()

    def load_optimizer_state(
        self, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
    ) -> None:
        """Load a full state that :meth:`optimizer_state` gave (under any strategy, at any
        number of ranks) into ``optimizer``."""
        optimizer.load_state_dict(dict(state))

    def own_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """A copy of the optimizer state this rank holds, taken with no collective: what the
        guard's in-memory snapshot keeps (``training.guard.action: rollback``), for
        :meth:`load_own_optimizer_state` on the same rank of the same run."""
        return copy.deepcopy(optimizer.state_dict())

    def load_own_optimizer_state(
        self, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
    ) -> None:
        """Put back what :meth:`own_optimizer_state` gave (copied again: ``state`` stays as it
        was, for another rollback)."""
        optimizer.load_state_dict(copy.deepcopy(dict(state)))

    @contextlib.contextmanager
    def evaluating(self, model: nn.Module) -> Iterator[None]:
        """What an evaluation's forward passes run under: the ranks' shares of an evaluation
        set may differ in length, so no pass may need a collective. Nothing for DDP (its bare
        module runs alone)."""
        yield


def _plain(tensors: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` are plain tensors (no DTensor) of one device and dtype."""
    first = tensors[0] if tensors else None
    return first is not None and all(
        type(t) is torch.Tensor and t.device == first.device and t.dtype == first.dtype
        for t in tensors
    )


def ddp(*, ctx: RunContext, config: Config, options: object) -> Strategy:
    """The built-in ``ddp`` strategy (it takes no options)."""
    return Strategy(ctx, config)
