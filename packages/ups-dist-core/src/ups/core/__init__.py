"""ups-dist-core: the engine of ups — run context, config, training loop, plugin contract, CLI.

The parts a hand-written loop uses (:class:`RunContext` and :func:`distributed_session`,
:func:`decide`, :class:`LossWindow`, :class:`Preemption`, :class:`Watchdog`) import without the
engine: ``TrainResult``, ``train``, ``run_processes``, ``Registry`` and ``load_plugins`` load it
on first use (see docs/own-loop.md).
"""

import importlib
from typing import TYPE_CHECKING, Any

from .collectives import Failure, RankFailedError, all_mean, decide, gather_failures
from .config import Config, config_from_mapping, load_config, read_yaml
from .context import RunContext, distributed_session
from .errors import ConfigError, UsageError
from .markers import hookimpl
from .metrics import LossWindow, PendingReport
from .preemption import Preemption
from .records import (
    TERMINAL,
    CheckpointBackendPlugin,
    Checkpointer,
    CommandPlugin,
    CommHookPlugin,
    Launcher,
    LauncherPlugin,
    LaunchRequest,
    Loaded,
    NoOptions,
    SamplerPlugin,
)
from .step import Step, StepError
from .structure import above, at_least, structure
from .watchdog import Watchdog

if TYPE_CHECKING:
    from .engine import TrainResult
    from .launch import run_processes, train
    from .plugins import Registry, load_plugins

_LAZY = {
    "TrainResult": "engine",
    "run_processes": "launch",
    "train": "launch",
    "Registry": "plugins",
    "load_plugins": "plugins",
}
"""Names whose modules import the engine: loaded when first asked for, so that a loop of its own
using the parts above never imports it."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "TERMINAL",
    "CheckpointBackendPlugin",
    "Checkpointer",
    "CommandPlugin",
    "CommHookPlugin",
    "Config",
    "ConfigError",
    "Failure",
    "LaunchRequest",
    "Launcher",
    "LauncherPlugin",
    "Loaded",
    "LossWindow",
    "NoOptions",
    "PendingReport",
    "Preemption",
    "RankFailedError",
    "Registry",
    "RunContext",
    "SamplerPlugin",
    "Step",
    "StepError",
    "TrainResult",
    "UsageError",
    "Watchdog",
    "above",
    "all_mean",
    "at_least",
    "config_from_mapping",
    "decide",
    "distributed_session",
    "gather_failures",
    "hookimpl",
    "load_config",
    "load_plugins",
    "read_yaml",
    "run_processes",
    "structure",
    "train",
]
