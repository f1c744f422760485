"""Optimizers and LR schedulers named in the config: a torch name or an import path."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeGuard

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from ..config._errors import ConfigError, did_you_mean, one_of
from ..config._user_code import load_object
from ..dist._context import RunContext
from ._schedule import agreed_value


def _classes(module: object, base: type) -> dict[str, type]:
    return {
        name.lower(): cls
        for name, cls in vars(module).items()
        if inspect.isclass(cls)
        and issubclass(cls, base)
        and cls is not base
        and not name.startswith("_")
    }


OPTIMIZERS = _classes(torch.optim, torch.optim.Optimizer)
"""torch's optimizers by lowercase name: ``adamw``, ``sgd``, ..."""
SCHEDULERS = _classes(torch.optim.lr_scheduler, LRScheduler)
"""torch's LR schedulers by lowercase name: ``cosineannealinglr``, ``steplr``, ..."""


def resolve(name: str, table: Mapping[str, type], key: str) -> Callable[..., Any]:
    """A class of ``table`` by (case-insensitive) name, or the callable an import path names."""
    if ":" in name:
        return load_object(name, key)
    if name.lower() in table:
        return table[name.lower()]
    raise ConfigError(
        key,
        f"unknown {name!r}; allowed: a torch name ({one_of(table)}) or package.module:callable"
        f"{did_you_mean(name.lower(), table)}",
    )


def build_optimizer(
    name: str,
    params: Iterable[torch.nn.Parameter],
    *,
    lr: float,
    weight_decay: float,
    options: Mapping[str, Any],
    device: torch.device,
) -> torch.optim.Optimizer:
    """Build the optimizer ``name`` names; ``fused=True`` where it has that option and the
    parameters live on CUDA (unless the options say otherwise)."""
    cls = resolve(name, OPTIMIZERS, "training.optimizer")
    kwargs = {"lr": lr, "weight_decay": weight_decay, **options}
    if device.type == "cuda" and "fused" in _parameters(cls):
        kwargs.setdefault("fused", True)
    try:
        optimizer = cls(params, **kwargs)
    except TypeError as error:
        raise ConfigError("training.optimizer_options", str(error)) from None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError("training.optimizer", f"{name!r} did not build a torch optimizer")
    return optimizer


MONITOR = "monitor"
"""The key of ``training.scheduler_options`` naming the value a plateau scheduler watches
(ups's, not passed to the scheduler); ``val_loss`` when left out."""


def is_plateau(scheduler: object) -> TypeGuard[ReduceLROnPlateau]:
    """Whether ``scheduler`` is stepped with a value after each evaluation (a
    ``ReduceLROnPlateau``), not once per optimizer step."""
    return isinstance(scheduler, ReduceLROnPlateau)


def build_scheduler(
    name: str | None, optimizer: torch.optim.Optimizer, options: Mapping[str, Any]
) -> LRScheduler | None:
    """Build the LR scheduler ``name`` names, or none: stepped once per optimizer step, or,
    a ``ReduceLROnPlateau``, after each evaluation (its ``monitor`` option is ups's)."""
    if name is None:
        return None
    cls = resolve(name, SCHEDULERS, "training.scheduler")
    if inspect.isclass(cls) and issubclass(cls, ReduceLROnPlateau):
        options = {key: value for key, value in options.items() if key != MONITOR}
    try:
        scheduler = cls(optimizer, **options)
    except TypeError as error:
        raise ConfigError("training.scheduler_options", str(error)) from None
    if not isinstance(scheduler, LRScheduler):
        raise ConfigError("training.scheduler", f"{name!r} did not build an LR scheduler")
    return scheduler


def step_on_plateau(
    ctx: RunContext,
    scheduler: ReduceLROnPlateau,
    values: Mapping[str, float],
    monitor: str = "val_loss",
) -> None:
    """Step a plateau ``scheduler`` after an evaluation with the value ``monitor`` names in
    ``values`` (``val_loss``, ``val_<metric>``), as rank 0 reads it, on every rank: every rank
    calls this after the same evaluations, so their schedulers (their best value, their count
    of evaluations without improvement, the LR) stay identical. A collective.

    :raises ConfigError: on every rank, before the collective, when ``values`` has no
        ``monitor`` (naming ``training.scheduler_options.monitor`` and the values it has).
    """
    scheduler.step(agreed_value(ctx, values, monitor, f"training.scheduler_options.{MONITOR}"))


def _parameters(cls: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return {}
