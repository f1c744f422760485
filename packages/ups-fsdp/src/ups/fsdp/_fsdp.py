"""The ``fsdp`` strategy: FSDP2 (``torch.distributed.fsdp.fully_shard``) over a device mesh.

Each rank holds a shard (dim 0) of every parameter, of its gradient and of the optimizer's
state; a block's parameters are all-gathered before its forward (and again before its
backward, where ``reshard_after_forward``), its gradients reduce-scattered after its backward.
With ``replicate > 1`` (HSDP) the ranks form a ``(replicate, shard)`` mesh: shards within a
group, gradients all-reduced between the groups.

Checkpoints hold full tensors, as under ``ddp``: :meth:`FSDPStrategy.gathered` all-gathers the
model's (and the EMA's) DTensors, :meth:`FSDPStrategy.optimizer_state` the optimizer's, in the
plain ``Optimizer.state_dict()`` format by parameter index; loading takes each rank's own shard
of the full tensors (no collective). A ``ddp`` checkpoint resumes under ``fsdp`` and back, at
any number of ranks.

Limits. Every forward and backward pass gathers parameters, the micro-batches before a step's
last too (their gradients stay unreduced on the rank, ``set_requires_gradient_sync(False)``):
every rank must take as many micro-batches in a step. A training sampler that deals one rank
fewer batches in an epoch's last step than another (``ddp`` takes it: its unsynchronised
passes run alone) leaves the ranks waiting in different collectives until the watchdog stops
them. Evaluations may differ in length (:meth:`FSDPStrategy.evaluating`).

Precision. Under ``training.precision: bf16`` the blocks gather their parameters in bfloat16
(``MixedPrecisionPolicy(param_dtype=bf16)``) and reduce-scatter gradients in
``reduce_dtype`` (bf16 unless ``strategy.options.reduce_dtype: fp32``); the sharded parameters,
the optimizer's state and the reduced gradients stay fp32 (under ``fp32``,
``reduce_dtype: bf16`` alone halves the gradients' traffic, as DDP's bf16 compression hook
would). The engine's autocast stays on over
it, so operations autocast runs in fp32 (losses, softmax, norms on CUDA) run in fp32 as under
``ddp``. What differs from ``ddp`` + autocast: a parameter is rounded to bf16 once per gather,
for every operation (under ``ddp`` autocast rounds it only for the operations it runs in
bf16: a norm's weight is then seen in full fp32), and the gradients of a micro-batch are bf16,
added up over micro-batches and reduced in ``reduce_dtype`` (under ``ddp`` they are fp32 from
the parameter's cast on, and all-reduced in fp32).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from ups.core import Config, ConfigError, RunContext, Strategy

from ._options import FSDPOptions

BLOCKS_KEY = "strategy.options.blocks"
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
"""Whose children are the blocks where ``blocks`` names none."""
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The dtype blocks gather their parameters in, by ``training.precision`` (fp32: their own)."""
REDUCE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class FSDPStrategy(Strategy):
    """FSDP2 over all ranks (or HSDP): see the module's docstring. On one process the model
    is not sharded, as under ``ddp``."""

    replicated: ClassVar[bool] = False
    reweighs: ClassVar[bool] = False

    def __init__(self, ctx: RunContext, config: Config, options: FSDPOptions) -> None:
        super().__init__(ctx, config)
        self.options = options
        if options.cpu_offload and ctx.device.type != "cuda":
            raise ConfigError(
                "strategy.options.cpu_offload",
                f"offloads from CUDA memory, and this run is on {ctx.device.type}; allowed: false",
            )
        if ctx.world_size % options.replicate:
            raise ConfigError(
                "strategy.options.replicate",
                f"{options.replicate} groups do not divide the {ctx.world_size} ranks; allowed: "
                "a divisor of the number of ranks",
            )

    def wrap(self, model: nn.Module) -> nn.Module:
        """``model`` with rank 0's weights (as DDP broadcasts them), every block, then the
        root, sharded (``fully_shard``), each block compiled first where ``training.compile``
        asks; the model itself on one process. A collective."""
        blocks = self._blocks(model)  # checked on one process too
        if not self.ctx.distributed:
            return super().wrap(model)
        if self.config.training.compile:
            for block in blocks or [model]:
                block.compile()
        with torch.no_grad():
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0)
        options = self.options
        sharding: dict[str, Any] = {
            "mesh": self._mesh(),
            "reshard_after_forward": options.reshard_after_forward,
            "mp_policy": self._precision(),
            "offload_policy": CPUOffloadPolicy() if options.cpu_offload else OffloadPolicy(),
        }
        for module in [*blocks, model]:  # fully_shard changes each module in place
            fully_shard(module, **sharding)
        return model

    def _mesh(self) -> DeviceMesh:
        """All ranks in one shard group, or ``(replicate, shard)`` groups."""
        world, replicate = self.ctx.world_size, self.options.replicate
        if replicate == 1:
            return init_device_mesh(self.ctx.device.type, (world,), mesh_dim_names=("shard",))
        return init_device_mesh(
            self.ctx.device.type,
            (replicate, world // replicate),
            mesh_dim_names=("replicate", "shard"),
        )

    def _precision(self) -> MixedPrecisionPolicy:
        """Parameters gathered in ``training.precision``'s half dtype (none under fp32),
        gradients reduced in ``reduce_dtype``, else in that dtype."""
        param = COMPUTE_DTYPES.get(self.config.training.precision)
        reduce = self.options.reduce_dtype
        return MixedPrecisionPolicy(
            param_dtype=param, reduce_dtype=REDUCE_DTYPES[reduce] if reduce else param
        )

    def _blocks(self, model: nn.Module) -> list[nn.Module]:
        """The modules sharded one by one, innermost first (``strategy.options.blocks``).

        :raises ConfigError: naming ``strategy.options.blocks``, for a class name that no module
            of the model has, or a callable that cannot be loaded.
        """
        named = self.options.blocks
        if not named:
            chosen = {
                id(child)
                for module in model.modules()
                if isinstance(module, CONTAINERS)
                for child in module.children()
                if any(True for _ in child.parameters())
            }
        else:
            chosen = set()
            classes = {type(module).__name__ for module in model.modules()}
            for name in named:
                if ":" in name:
                    chosen |= {id(block) for block in _load(name)(model)}
                elif name in classes:
                    chosen |= {id(m) for m in model.modules() if type(m).__name__ == name}
                else:
                    raise ConfigError(
                        BLOCKS_KEY,
                        f"no module of the model is a {name!r}; its classes: "
                        f"{', '.join(sorted(classes))}",
                    )
        chosen.discard(id(model))
        return [module for module in reversed(list(model.modules())) if id(module) in chosen]

    def unsynced(self, wrapped: nn.Module) -> nn.Module:
        """The sharded model itself: :meth:`backward_unsynced` keeps its gradients apart."""
        return wrapped

    def backward_unsynced(self, loss: torch.Tensor, model: nn.Module) -> None:
        """Backward with FSDP's gradient reduction off: the unsharded gradients add up on
        this rank, and the step's synchronising backward reduce-scatters their sum."""
        if not isinstance(model, FSDPModule):
            super().backward_unsynced(loss, model)
            return
        model.set_requires_gradient_sync(False)
        try:
            loss.backward()  # type: ignore[no-untyped-call]
        finally:
            model.set_requires_gradient_sync(True)

    def clip_grad_norm(self, parameters: Iterable[nn.Parameter], max_norm: float) -> float:
        """The global norm of the sharded gradients (:meth:`~ups.core.Strategy.grad_norm`: the
        shards' norms all-reduced), the gradients clipped to ``max_norm``."""
        params = list(parameters)
        norm = self.grad_norm(params)
        nn.utils.clip_grads_with_norm_(params, max_norm, torch.tensor(norm))
        return norm

    def gathered(self, state: dict[str, Any]) -> dict[str, Any]:
        """Every DTensor of ``state`` all-gathered into a full tensor on the CPU."""
        return {name: _full(value) for name, value in state.items()}

    def scattered(self, state: Mapping[str, Any], like: Mapping[str, Any]) -> dict[str, Any]:
        """Each full tensor of ``state`` cut to this rank's shard where ``like`` holds a
        DTensor of the same name (no collective: every rank holds the full tensor)."""
        return {
            name: _placed(value, like[name]) if isinstance(like.get(name), DTensor) else value
            for name, value in state.items()
        }

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state by parameter index, every DTensor gathered to a full tensor
        on the CPU: a plain ``Optimizer.state_dict()``. A collective."""
        saved = optimizer.state_dict()
        state = {index: self.gathered(values) for index, values in saved["state"].items()}
        return {**saved, "state": state}

    def load_optimizer_state(
        self, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
    ) -> None:
        """Load a full state: each tensor shaped like its parameter cut to this rank's shard
        of it; the rest (Adam's ``step``) as it is."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        placed = {}
        for index, values in state["state"].items():
            param = params[index]
            placed[index] = {
                name: _placed(value, param)
                if isinstance(param, DTensor)
                and isinstance(value, torch.Tensor)
                and value.shape == param.shape
                else value
                for name, value in values.items()
            }
        optimizer.load_state_dict({**state, "state": placed})

    @contextlib.contextmanager
    def evaluating(self, model: nn.Module) -> Iterator[None]:
        """Every block's parameters gathered once, before the passes (all ranks together),
        and kept through them, so that no pass runs a collective however many each rank
        takes; sharded again after."""
        sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if not sharded:
            yield
            return
        for module in sharded:
            module.unshard()
        sharded[0].set_reshard_after_forward(False)  # the root's: recursive
        try:
            yield
        finally:
            for module in sharded:
                module.set_reshard_after_forward(
                    self.options.reshard_after_forward and module is not model, recurse=False
                )
                module.reshard()


def _full(value: Any) -> Any:
    """A DTensor's full tensor on the CPU (a collective); anything else as it is."""
    return value.full_tensor().cpu() if isinstance(value, DTensor) else value


def _placed(full: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's shard of ``full``, placed as ``like`` (no collective)."""
    return distribute_tensor(
        full.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None
    )


def _load(spec: str) -> Callable[[nn.Module], Iterable[nn.Module]]:
    """The callable ``module:function`` or ``path.py:function`` names.

    :raises ConfigError: naming ``strategy.options.blocks`` where it cannot be loaded.
    """
    target, _, attr = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            path = Path(target).resolve()
            found = importlib.util.spec_from_file_location(f"ups_blocks_{path.stem}", path)
            if found is None or found.loader is None or not path.is_file():
                raise ConfigError(BLOCKS_KEY, f"no such file: {path}")
            module = importlib.util.module_from_spec(found)
            sys.modules[found.name] = module
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        return typing.cast(Callable[[nn.Module], Iterable[nn.Module]], getattr(module, attr))
    except (ImportError, AttributeError) as error:
        raise ConfigError(BLOCKS_KEY, f"cannot load {spec!r}: {error}") from None


def fsdp(*, ctx: RunContext, config: Config, options: FSDPOptions) -> Strategy:
    """The ``fsdp`` strategy.

    :raises ConfigError: for ``cpu_offload`` off CUDA, or ``replicate`` not dividing the
        ranks.
    """
    return FSDPStrategy(ctx, config, options)
