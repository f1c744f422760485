"""ups-dist-core: the engine of ups — run context, config, training loop, plugin contract, CLI."""

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
from .structure import above, at_least, structure

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
