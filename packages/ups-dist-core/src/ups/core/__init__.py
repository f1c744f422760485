"""ups-dist-core: the engine of ups — run context, config, training loop, plugin contract, CLI."""

from .collectives import Failure, RankFailedError, all_mean, decide, gather_failures
from .config import Config, load_config
from .context import RunContext, distributed_session
from .engine import TrainResult
from .errors import ConfigError, UsageError
from .launch import run_processes, train
from .markers import hookimpl
from .plugins import Registry, load_plugins
from .records import (
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
from .structure import above, at_least

__all__ = [
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
    "TrainResult",
    "UsageError",
    "above",
    "all_mean",
    "at_least",
    "decide",
    "distributed_session",
    "gather_failures",
    "hookimpl",
    "load_config",
    "load_plugins",
    "run_processes",
    "train",
]
