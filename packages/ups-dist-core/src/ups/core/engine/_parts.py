"""What a run is built of: its config turned into the run's parts, once, before its loop.

:func:`build_parts` builds them in the order they depend on one another (the step and the
model; the data, its sampler and loaders, checked; the strategy, which wraps the model (in
DDP, or sharded); the optimizer and scheduler over its parameters; the comm hook; the
checkpoint backend) and :class:`Parts` holds them, frozen: the loop
(:mod:`~ups.core.engine._run`) uses them and replaces none. ``ups tune`` builds only what a trial
step needs (``to_train=False``: no evaluation data, no checkpoint backend).
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from ..config._config import Config
from ..config._validate import check_data, check_loader, check_strategy, select_sampler
from ..dist._collectives import Agreement, first_failure
from ..dist._context import RunContext
from ..observe._profiling import CommCounter
from ..plugin._manager import Registry
from ..plugin._records import Checkpointer
from ._loader import build_dataset, data_loader
from ._optim import build_optimizer, build_scheduler
from ._step import Step, build_model, build_step
from ._strategy import Strategy


@attrs.frozen(kw_only=True)
class Parts:
    """One rank's run, as its config builds it."""

    step: Step
    model: nn.Module
    """The user's module on the rank's device (its batch norms synchronised if asked)."""
    ddp: nn.Module
    """What steps run: the model (compiled if asked) as the strategy wraps it (in DDP, or
    sharded), or the model itself alone."""
    strategy: Strategy
    local_passes: bool
    """Whether the strategy runs a micro-batch on one rank with no collective
    (:attr:`~ups.core.plugin._records.StrategyPlugin.local_passes`)."""
    dataset: Any
    sampler: Any
    even: bool
    """Whether the sampler deals every rank the same number of samples per batch."""
    loader: DataLoader[Any]
    """The training data's loader at the batch size the run starts with."""
    eval_loader: DataLoader[Any] | None
    comm: CommCounter
    comm_state: object | None
    """What the comm hook keeps between steps (saved per rank if it has a ``state_dict``)."""
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler | None
    checkpointer: Checkpointer | None
    """``None`` for a run built not to train (``ups tune``)."""


def build_parts(
    config: Config, ctx: RunContext, registry: Registry, *, batch_size: int, to_train: bool = True
) -> Parts:
    """Build the run's parts from ``config`` on this rank (a collective: DDP's construction
    broadcasts rank 0's weights); ``batch_size``: the training loader's, as the run starts."""
    t = config.training
    # What each rank builds alone, agreed before the strategy's first collective: bad input
    # fails every rank alike, and every rank then names the lowest rank's error (no rank left
    # waiting).
    with Agreement(ctx, first_failure(ctx.rank)):
        check_loader(config.data.loader)
        step = build_step(config)
        model = build_model(config).to(ctx.device)
        if ctx.distributed and config.distributed.sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # type: ignore[no-untyped-call]
        dataset, sampler, even = _data(config, ctx, registry)
        loader = run_loader(config, ctx, dataset, sampler, batch_size)
        eval_loader = _eval_loader(config, ctx, registry) if to_train else None
        check_data(config, loader, eval_loader, ctx.world_size)
        chosen, options = registry.select(
            "strategy", config.strategy.name, config.strategy.options, "strategy"
        )
        check_strategy(config, chosen)
        strategy = chosen.factory(ctx=ctx, config=config, options=options)
    wrapped = strategy.wrap(model)  # a collective: DDP broadcasts rank 0's weights
    with Agreement(ctx, first_failure(ctx.rank)):  # over the wrapped (maybe sharded) parameters
        optimizer = strategy.optimizer(
            functools.partial(
                build_optimizer,
                t.optimizer,
                lr=t.lr,
                weight_decay=t.weight_decay,
                options=t.optimizer_options,
                device=ctx.device,
            ),
            model,
        )
        scheduler = build_scheduler(t.scheduler, optimizer, t.scheduler_options)
    comm, comm_state = _comm_hook(config, ctx, registry, wrapped)
    checkpointer = None
    if to_train:
        plugin, ckpt_options = registry.select(
            "checkpoint", config.checkpoint.name, config.checkpoint.options, "checkpoint"
        )
        checkpointer = plugin.factory(ctx=ctx, directory=config.run_dir, options=ckpt_options)
    return Parts(
        step=step,
        model=model,
        ddp=wrapped,
        strategy=strategy,
        local_passes=chosen.local_passes,
        dataset=dataset,
        sampler=sampler,
        even=even,
        loader=loader,
        eval_loader=eval_loader,
        comm=comm,
        comm_state=comm_state,
        optimizer=optimizer,
        scheduler=scheduler,
        checkpointer=checkpointer,
    )


def run_loader(
    config: Config,
    ctx: RunContext,
    dataset: Any,
    sampler: Any,
    batch_size: int,
    *,
    persistent: bool = False,
) -> DataLoader[Any]:
    """A loader as ``data.loader`` says; its workers kept between passes where
    ``persistent``, whatever ``persistent_workers`` says."""
    options = config.data.loader
    if persistent and options.num_workers:
        options = attrs.evolve(options, persistent_workers=True)
    return data_loader(
        dataset,
        sampler,
        batch_size,
        options,
        device=ctx.device,
        seed=config.run.seed,
        rank=ctx.rank,
        world_size=ctx.world_size,
    )


def _data(config: Config, ctx: RunContext, registry: Registry) -> tuple[Any, Any, bool]:
    """The training data, its sampler, and whether the sampler deals ranks evenly."""
    dataset = build_dataset(config.data, "data")
    plugin, options = select_sampler(registry, config.sampler, "sampler", exact=False)
    sampler = plugin.factory(dataset, ctx=ctx, seed=config.run.seed, options=options)
    return dataset, sampler, plugin.even


def _eval_loader(config: Config, ctx: RunContext, registry: Registry) -> DataLoader[Any] | None:
    """The evaluation data's loader, if the config evaluates. Its workers are kept between
    evaluations: an evaluation set does not change, and every fork of a rank's workers risks
    Python's fork hang (own-model.md, 8)."""
    if config.eval is None:
        return None
    dataset = build_dataset(config.eval, "eval")
    plugin, options = select_sampler(registry, config.eval.sampler, "eval.sampler", exact=True)
    shards = plugin.factory(dataset, ctx=ctx, seed=config.run.seed, options=options)
    size = config.eval.batch_size or config.training.batch_size
    return run_loader(config, ctx, dataset, shards, size, persistent=True)


def _comm_hook(
    config: Config, ctx: RunContext, registry: Registry, ddp: nn.Module
) -> tuple[CommCounter, object | None]:
    """The comm hook registered on ``ddp`` (none on one process): what counts the bytes it
    hands to collectives, and its state."""
    if not isinstance(ddp, DistributedDataParallel):
        return CommCounter(), None
    plugin, options = registry.select(
        "comm_hook", config.comm_hook.name, config.comm_hook.options, "comm_hook"
    )
    state = plugin.factory(ddp, ctx=ctx, options=options)
    return CommCounter(ddp, state), state
