"""ups-dist-core: the engine of ups — run context, config, training loop, plugin contract, CLI."""

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
    SectionPlugin,
)
from .step import Step, StepError
from .structure import above, at_least, structure

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
    "SectionPlugin",
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
