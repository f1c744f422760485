"""ups-dist-core: the engine of ups — run context, config, training loop, plugin contract, CLI.

Its names are imported when first used (PEP 562), so that ``import ups.core`` (the command line,
a plugin module) does not import torch until something that needs it is used, and a hand-written
loop using its parts (:class:`RunContext` and :func:`distributed_session`, :func:`decide`,
:class:`LossWindow`, :class:`Preemption`, :class:`Watchdog`) never imports the engine (see
docs/own-loop.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import imported, lazy_exports
from .structure import above, at_least, structure  # eager: ``structure`` is a module's name too

if TYPE_CHECKING:
    from .builtins import SimpleCheckpointOptions, probe_checkpoints
    from .checkpoint_errors import CheckpointError, DiskFullError, UnsafeCheckpointError
    from .cli import EXIT_PREEMPTED
    from .collectives import (
        Agreement,
        Failure,
        RankFailedError,
        RankUsageError,
        all_mean,
        decide,
        gather_failures,
    )
    from .commit import COMMIT_FILE, LATEST_FILE, CheckpointStorage, Committed, Committing
    from .config import Config, config_from_mapping, load_config, read_config, read_yaml
    from .context import RunContext, distributed_session
    from .errors import ConfigError, UsageError, did_you_mean, one_line, one_of
    from .files import check_writable, fsync_dir, write_atomically
    from .launch import (
        AGENT_ENV,
        agent_args,
        agent_exports,
        free_port,
        rank_failures,
        run_processes,
        train,
        train_args,
    )
    from .manifest import Manifest
    from .markers import hookimpl
    from .metrics import LossWindow, PendingReport
    from .plugins import Registry, load_plugins
    from .preemption import Preemption
    from .records import (
        TERMINAL,
        CheckpointBackendPlugin,
        Checkpointer,
        CheckpointFactory,
        CheckpointProbe,
        CommandPlugin,
        CommHookPlugin,
        JobState,
        Launcher,
        LauncherPlugin,
        LaunchRequest,
        Loaded,
        NoOptions,
        SamplerPlugin,
        SectionPlugin,
        TrainResult,
    )
    from .report import read_metrics, write_report
    from .retention import expired
    from .serialize import FileRecord, checksum, dump, load
    from .simple_checkpoint import FolderStorage, SimpleCheckpointer
    from .step import Step, StepError
    from .watchdog import Watchdog

_EXPORTS = {
    "CheckpointError": ".checkpoint_errors",
    "DiskFullError": ".checkpoint_errors",
    "UnsafeCheckpointError": ".checkpoint_errors",
    "Agreement": ".collectives",
    "Failure": ".collectives",
    "RankFailedError": ".collectives",
    "RankUsageError": ".collectives",
    "all_mean": ".collectives",
    "decide": ".collectives",
    "gather_failures": ".collectives",
    "COMMIT_FILE": ".commit",
    "LATEST_FILE": ".commit",
    "CheckpointStorage": ".commit",
    "Committed": ".commit",
    "Committing": ".commit",
    "Config": ".config",
    "config_from_mapping": ".config",
    "load_config": ".config",
    "read_config": ".config",
    "read_yaml": ".config",
    "RunContext": ".context",
    "distributed_session": ".context",
    "EXIT_PREEMPTED": ".cli",
    "ConfigError": ".errors",
    "UsageError": ".errors",
    "did_you_mean": ".errors",
    "one_of": ".errors",
    "one_line": ".errors",
    "check_writable": ".files",
    "fsync_dir": ".files",
    "write_atomically": ".files",
    "AGENT_ENV": ".launch",
    "agent_args": ".launch",
    "agent_exports": ".launch",
    "free_port": ".launch",
    "rank_failures": ".launch",
    "run_processes": ".launch",
    "train": ".launch",
    "train_args": ".launch",
    "hookimpl": ".markers",
    "LossWindow": ".metrics",
    "PendingReport": ".metrics",
    "Preemption": ".preemption",
    "Watchdog": ".watchdog",
    "Registry": ".plugins",
    "load_plugins": ".plugins",
    "CheckpointBackendPlugin": ".records",
    "Checkpointer": ".records",
    "CheckpointFactory": ".records",
    "CheckpointProbe": ".records",
    "CommHookPlugin": ".records",
    "CommandPlugin": ".records",
    "JobState": ".records",
    "LaunchRequest": ".records",
    "Launcher": ".records",
    "LauncherPlugin": ".records",
    "Loaded": ".records",
    "NoOptions": ".records",
    "SamplerPlugin": ".records",
    "SectionPlugin": ".records",
    "TERMINAL": ".records",
    "TrainResult": ".records",
    "read_metrics": ".report",
    "write_report": ".report",
    "expired": ".retention",
    "FileRecord": ".serialize",
    "checksum": ".serialize",
    "dump": ".serialize",
    "load": ".serialize",
    "SimpleCheckpointOptions": ".builtins",
    "probe_checkpoints": ".builtins",
    "FolderStorage": ".simple_checkpoint",
    "SimpleCheckpointer": ".simple_checkpoint",
    "Manifest": ".manifest",
    "Step": ".step",
    "StepError": ".step",
}
"""Each public name and the module of this package that defines it."""

__all__ = [
    "AGENT_ENV",
    "Agreement",
    "EXIT_PREEMPTED",
    "TERMINAL",
    "CheckpointBackendPlugin",
    "CheckpointFactory",
    "CheckpointProbe",
    "Checkpointer",
    "CommandPlugin",
    "CommHookPlugin",
    "Config",
    "ConfigError",
    "Failure",
    "JobState",
    "LaunchRequest",
    "Launcher",
    "LauncherPlugin",
    "Loaded",
    "LossWindow",
    "NoOptions",
    "PendingReport",
    "Preemption",
    "RankFailedError",
    "RankUsageError",
    "Registry",
    "RunContext",
    "SamplerPlugin",
    "SectionPlugin",
    "Step",
    "StepError",
    "TrainResult",
    "UsageError",
    "Watchdog",
    "above",
    "agent_args",
    "agent_exports",
    "all_mean",
    "at_least",
    "check_writable",
    "config_from_mapping",
    "decide",
    "did_you_mean",
    "distributed_session",
    "free_port",
    "rank_failures",
    "fsync_dir",
    "gather_failures",
    "hookimpl",
    "imported",
    "lazy_exports",
    "load_config",
    "load_plugins",
    "one_line",
    "one_of",
    "read_metrics",
    "read_config",
    "read_yaml",
    "run_processes",
    "structure",
    "train",
    "train_args",
    "write_atomically",
    "write_report",
    "CheckpointError",
    "DiskFullError",
    "UnsafeCheckpointError",
    "COMMIT_FILE",
    "LATEST_FILE",
    "CheckpointStorage",
    "Committed",
    "Committing",
    "expired",
    "FileRecord",
    "checksum",
    "dump",
    "load",
    "SimpleCheckpointOptions",
    "FolderStorage",
    "SimpleCheckpointer",
    "probe_checkpoints",
    "Manifest",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
