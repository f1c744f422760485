"""ups-dist-core: the engine of ups — run context, config, training loop, plugin contract, CLI.

Its names are imported when first used (PEP 562), so that ``import ups.core`` (the command line,
a plugin module) does not import torch until something that needs it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_exports
from .structure import above, at_least, structure  # eager: ``structure`` is a module's name too

if TYPE_CHECKING:
    from .collectives import Failure, RankFailedError, all_mean, decide, gather_failures
    from .config import Config, config_from_mapping, load_config, read_yaml
    from .context import RunContext, distributed_session
    from .engine import TrainResult
    from .errors import ConfigError, UsageError
    from .launch import run_processes, train
    from .markers import hookimpl
    from .plugins import Registry, load_plugins
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

_EXPORTS = {
    "Failure": ".collectives",
    "RankFailedError": ".collectives",
    "all_mean": ".collectives",
    "decide": ".collectives",
    "gather_failures": ".collectives",
    "Config": ".config",
    "config_from_mapping": ".config",
    "load_config": ".config",
    "read_yaml": ".config",
    "RunContext": ".context",
    "distributed_session": ".context",
    "TrainResult": ".engine",
    "ConfigError": ".errors",
    "UsageError": ".errors",
    "run_processes": ".launch",
    "train": ".launch",
    "hookimpl": ".markers",
    "Registry": ".plugins",
    "load_plugins": ".plugins",
    "CheckpointBackendPlugin": ".records",
    "Checkpointer": ".records",
    "CommHookPlugin": ".records",
    "CommandPlugin": ".records",
    "LaunchRequest": ".records",
    "Launcher": ".records",
    "LauncherPlugin": ".records",
    "Loaded": ".records",
    "NoOptions": ".records",
    "SamplerPlugin": ".records",
    "TERMINAL": ".records",
    "Step": ".step",
    "StepError": ".step",
}
"""Each public name and the module of this package that defines it."""

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
    "NoOptions",
    "RankFailedError",
    "Registry",
    "RunContext",
    "SamplerPlugin",
    "Step",
    "StepError",
    "TrainResult",
    "UsageError",
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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
