"""The training loop: build what the config names, wrap it in DDP, train, report, checkpoint."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import attrs
import structlog
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from .collectives import all_mean
from .config import Config
from .context import RunContext
from .errors import ConfigError
from .imports import load_object
from .plugins import Registry
from .records import Checkpointer

log = structlog.get_logger()

LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mse": nn.functional.mse_loss,
    "l1": nn.functional.l1_loss,
    "cross_entropy": nn.functional.cross_entropy,
}
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}


@attrs.frozen(kw_only=True)
class TrainResult:
    """What a run leaves behind; the same on every rank."""

    steps: int
    """Optimizer steps taken."""
    epochs: int
    """Epochs started."""
    losses: tuple[float, ...]
    """The training loss at each report, averaged over the interval and over all ranks."""
    checkpoint: str | None
    """Where the final checkpoint went."""


def build_model(config: Config) -> nn.Module:
    """Call ``model.factory(**model.options)``; check that it returns a module."""
    model = load_object(config.model.factory, "model.factory")(**config.model.options)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            "model.factory", f"returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def build_dataset(config: Config) -> Any:
    """Call ``data.factory(**data.options)``; check that it returns a sized dataset."""
    dataset = load_object(config.data.factory, "data.factory")(**config.data.options)
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ConfigError(
            "data.factory", f"returned {type(dataset).__name__}, not a map-style dataset"
        )
    return dataset


def wrap(model: nn.Module, ctx: RunContext, config: Config) -> nn.Module:
    """Wrap ``model`` in DDP with the config's options (``model`` itself on one process)."""
    if not ctx.distributed:
        return model
    d = config.distributed
    buffers: dict[str, Any] = {}
    if not d.broadcast_buffers:
        # torch >= 2.12 renamed it; the new name still syncs buffers once, at construction.
        renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        buffers = {"forward_sync_buffers" if renamed else "broadcast_buffers": False}
    return DistributedDataParallel(
        model,
        device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
        bucket_cap_mb=d.bucket_cap_mb,
        static_graph=d.static_graph,
        gradient_as_bucket_view=d.gradient_as_bucket_view,
        find_unused_parameters=d.find_unused_parameters,
        **buffers,
    )


def train(config: Config, ctx: RunContext, registry: Registry) -> TrainResult:
    """Train the configured model on this rank; every rank of the job calls this together."""
    hook = registry.manager.hook
    try:
        result = _train(config, ctx, registry)
    except BaseException as error:
        hook.ups_error(ctx=ctx, error=error)
        raise
    hook.ups_run_end(ctx=ctx, result=result)
    return result


def _train(config: Config, ctx: RunContext, registry: Registry) -> TrainResult:
    hook = registry.manager.hook
    torch.manual_seed(config.run.seed)
    model = build_model(config).to(ctx.device)
    dataset = build_dataset(config)
    sampler_plugin, sampler_options = registry.select(
        "sampler", config.sampler.name, config.sampler.options, "sampler"
    )
    sampler = sampler_plugin.factory(
        dataset, ctx=ctx, seed=config.run.seed, options=sampler_options
    )
    loader = DataLoader(dataset, batch_size=config.training.batch_size, sampler=sampler)
    ddp = wrap(model, ctx, config)
    if isinstance(ddp, DistributedDataParallel):
        comm_plugin, comm_options = registry.select(
            "comm_hook", config.comm_hook.name, config.comm_hook.options, "comm_hook"
        )
        comm_plugin.factory(ddp, ctx=ctx, options=comm_options)
    ckpt_plugin, ckpt_options = registry.select(
        "checkpoint", config.checkpoint.name, config.checkpoint.options, "checkpoint"
    )
    checkpointer: Checkpointer = ckpt_plugin.factory(
        ctx=ctx, directory=config.run_dir, options=ckpt_options
    )
    t = config.training
    optimizer = OPTIMIZERS[t.optimizer](ddp.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    loss_fn = LOSSES[t.loss]

    hook.ups_run_start(ctx=ctx, config=config)
    log.info(
        "training",
        world_size=ctx.world_size,
        backend=ctx.backend,
        device=str(ctx.device),
        samples=len(dataset),
        steps_per_epoch=len(loader),
        epochs=t.epochs,
    )

    def checkpoint(step: int, epoch: int) -> str:
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
            "epoch": epoch,
            "config_digest": config.digest(),
        }
        location = checkpointer.save(state, step=step)
        hook.ups_checkpoint_saved(ctx=ctx, step=step, location=location)
        log.info("checkpoint saved", step=step, location=location)
        return location

    step, epoch, losses = 0, 0, []
    window = torch.zeros(2, dtype=torch.float64)  # loss sum, batches since the last report
    location, saved_at = None, -1
    ddp.train()
    while epoch < t.epochs and (t.max_steps is None or step < t.max_steps):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        epoch += 1
        for batch in loader:
            inputs, targets = batch[0].to(ctx.device), batch[1].to(ctx.device)
            loss = loss_fn(ddp(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            step += 1
            window += torch.tensor([loss.item(), 1.0], dtype=torch.float64)
            if step % config.run.log_every == 0:
                mean = float(all_mean(ctx, window[0:1] / window[1])[0])
                window.zero_()
                losses.append(mean)
                log.info("step", step=step, epoch=epoch, loss=round(mean, 6))
                hook.ups_step_end(ctx=ctx, step=step, metrics={"loss": mean})
            if config.checkpoint.every_steps and step % config.checkpoint.every_steps == 0:
                location, saved_at = checkpoint(step, epoch), step
            if t.max_steps is not None and step >= t.max_steps:
                break
    if window[1] > 0:
        losses.append(float(all_mean(ctx, window[0:1] / window[1])[0]))
    if saved_at != step:
        location = checkpoint(step, epoch)
    log.info("done", steps=step, epochs=epoch, loss=round(losses[-1], 6) if losses else None)
    return TrainResult(steps=step, epochs=epoch, losses=tuple(losses), checkpoint=location)
