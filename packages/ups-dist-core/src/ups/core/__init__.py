"""ups-dist-core: the engine of ups — run context, config, training loop, plugin contract, CLI.

Its names are imported when first used (PEP 562), so that ``import ups.core`` (the command line,
a plugin module) does not import torch until something that needs it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_exports
from .structure import above, at_least, structure  # eager: ``structure`` is a module's name too

if TYPE_CHECKING:
    from .cli import EXIT_PREEMPTED
    from .collectives import Failure, RankFailedError, all_mean, decide, gather_failures
    from .config import Config, config_from_mapping, load_config, read_yaml
    from .context import RunContext, distributed_session
    from .errors import ConfigError, UsageError
    from .files import fsync_dir, write_atomically
    from .launch import (
        AGENT_ENV,
        agent_args,
        agent_exports,
        free_port,
        run_processes,
        train,
        train_args,
    )
    from .markers import hookimpl
    from .plugins import Registry, load_plugins
    from .records import (
        TERMINAL,
        CheckpointBackendPlugin,
        Checkpointer,
        CheckpointFactory,
        CommandPlugin,
        CommHookPlugin,
        Launcher,
        LauncherPlugin,
        LaunchRequest,
        Loaded,
        NoOptions,
        SamplerPlugin,
        TrainResult,
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
    "EXIT_PREEMPTED": ".cli",
    "ConfigError": ".errors",
    "UsageError": ".errors",
    "fsync_dir": ".files",
    "write_atomically": ".files",
    "AGENT_ENV": ".launch",
    "agent_args": ".launch",
    "agent_exports": ".launch",
    "free_port": ".launch",
    "run_processes": ".launch",
    "train": ".launch",
    "train_args": ".launch",
    "hookimpl": ".markers",
    "Registry": ".plugins",
    "load_plugins": ".plugins",
    "CheckpointBackendPlugin": ".records",
    "Checkpointer": ".records",
    "CheckpointFactory": ".records",
    "CommHookPlugin": ".records",
    "CommandPlugin": ".records",
    "LaunchRequest": ".records",
    "Launcher": ".records",
    "LauncherPlugin": ".records",
    "Loaded": ".records",
    "NoOptions": ".records",
    "SamplerPlugin": ".records",
    "TERMINAL": ".records",
    "TrainResult": ".records",
    "Step": ".step",
    "StepError": ".step",
}
"""Each public name and the module of this package that defines it."""

__all__ = [
    "AGENT_ENV",
    "EXIT_PREEMPTED",
    "TERMINAL",
    "CheckpointBackendPlugin",
    "CheckpointFactory",
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
    "agent_args",
    "agent_exports",
    "all_mean",
    "at_least",
    "config_from_mapping",
    "decide",
    "distributed_session",
    "free_port",
    "fsync_dir",
    "gather_failures",
    "hookimpl",
    "load_config",
    "load_plugins",
    "read_yaml",
    "run_processes",
    "structure",
    "train",
    "train_args",
    "write_atomically",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
