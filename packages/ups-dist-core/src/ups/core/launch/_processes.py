"""Run on several local processes: torchrun's elastic agent for the CLI, a function API for code.

``ups train CONFIG --nproc N`` and :func:`train` start N processes under one elastic agent (what
torchrun does), each of which finds itself launched and trains in place. :func:`run_processes`
does the same for any function, for notebooks and scripts (like Accelerate's notebook_launcher).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..config._config import (
    Config,
    DistributedConfig,
    apply_overrides,
    config_from_mapping,
    load_config,
)
from ..observe import _logs as logs
from ..plugin._manager import load_plugins
from ..plugin._records import TrainResult
from . import _lifeline as lifeline

if TYPE_CHECKING:  # the launcher plugins build command lines with this module: no torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from torch.distributed.launcher.api import LaunchConfig

    from ..dist._context import RunContext

T = TypeVar("T")


AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""What every elastic agent that may restart ranks needs in its environment. Torch's agent
shares its rendezvous store with the ranks, across restarts: a restarted rank reads its peers'
gloo addresses of the previous round and cannot connect. Unshared, rank 0 hosts a fresh store
each round. Launchers that start torchrun set it too."""


def agent_args(max_restarts: int) -> list[str]:
    """The torchrun arguments a launcher adds for a config's ``distributed.max_restarts``:
    ``--max-restarts N`` when it is set (a restarted job resumes from its newest checkpoint)."""
    return ["--max-restarts", str(max_restarts)] if max_restarts else []


def agent_exports() -> list[str]:
    """The shell lines that put :data:`AGENT_ENV` in a script's environment."""
    return [f"export {name}={value}" for name, value in AGENT_ENV.items()]


def _launch_config(nproc: int, max_restarts: int, start_method: str = "spawn") -> LaunchConfig:
    from torch.distributed.launcher.api import LaunchConfig

    for name, value in AGENT_ENV.items():
        os.environ.setdefault(name, value)
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"ups-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method=start_method,
    )


def run_processes(
    fn: Callable[..., T],
    *args: Any,
    nproc: int = 2,
    distributed: DistributedConfig | None = None,
    max_restarts: int = 0,
) -> T:
    """Run ``fn(ctx, *args)`` on ``nproc`` local processes joined in one process group.

    ``fn`` and ``args`` must be picklable (``fn`` defined in an importable module, not in a
    notebook cell). Returns rank 0's result. The ranks end with this process, however it ends
    (:mod:`ups.core.launch._lifeline`).

    :raises torch.distributed.elastic.multiprocessing.errors.ChildFailedError: when a rank fails.
    """
    from torch.distributed.launcher.api import elastic_launch

    from ._forkserver import start_method

    distributed = distributed or DistributedConfig()
    launch = elastic_launch(_launch_config(nproc, max_restarts, start_method()), _worker)
    results = launch(fn, args, distributed, dict(os.environ))
    return results[0]  # type: ignore[no-any-return]


def _worker(
    fn: Callable[..., T],
    args: tuple[Any, ...],
    d: DistributedConfig,
    environment: Mapping[str, str] | None = None,
) -> T:
    from ..dist._context import distributed_session

    lifeline.watch_starter()  # first: a launcher already gone ends this rank here
    if environment is not None:  # started by run_processes
        from ._forkserver import restore_environment

        restore_environment(environment)
    with distributed_session(d.enabled, d.backend, d.timeout_s) as ctx:
        logs.configure(ctx)
        return fn(ctx, *args)


def train(
    config: Config | Mapping[str, Any] | str | Path,
    *,
    nproc: int | None = None,
    overrides: Iterable[str] = (),
) -> TrainResult:
    """Train a config (a file, a mapping or a :class:`Config`) on ``nproc`` local processes.

    ``nproc`` defaults to ``distributed.nproc``; ``overrides`` (``key.path=value``) apply to a
    file or a mapping. The ranks are restarted ``distributed.max_restarts`` times at most
    (resuming from the newest checkpoint). Returns rank 0's :class:`~ups.core.TrainResult`.
    Plugins must be installed (entry points) to be seen by the spawned processes.
    """
    from ..dist._context import launched

    if isinstance(config, str | Path):
        config = load_config(config, overrides)
    elif not isinstance(config, Config):
        config = config_from_mapping(apply_overrides(dict(config), overrides))
    nproc = nproc or config.distributed.nproc
    if nproc == 1 or launched():
        return train_in_place(config)
    return run_processes(
        train_here,
        config,
        nproc=nproc,
        distributed=config.distributed,
        max_restarts=config.distributed.max_restarts,
    )


def train_in_place(config: Config) -> TrainResult:
    """Join the process group this process's environment describes, and train ``config``."""
    return _worker(train_here, (config,), config.distributed)


def tune(config: Config, *, nproc: int, start: int = 1, limit: int | None = None) -> int:
    """The largest per-rank batch size whose step fits on each of ``nproc`` local processes
    (:func:`ups.core.cli._tuning.tune_batch_size`); in place when launched already."""
    from ..cli._tuning import tune_here
    from ..dist._context import launched

    args = (config, start, limit)
    if nproc == 1 or launched():
        return _worker(tune_here, args, config.distributed)
    return run_processes(tune_here, *args, nproc=nproc, distributed=config.distributed)


def train_here(ctx: RunContext, config: Config) -> TrainResult:
    """Train ``config`` in this process, as this rank of the process group ``ctx`` describes."""
    from ..engine import _run as engine

    return engine.train_rank(config, ctx, load_plugins())


class _ReportedByUps(logging.Filter):
    """Drops the agent's lines on a failed rank and on stopping the others: ``ups train``
    reports each failed rank itself, in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("failed (exitcode", "Sending process"))


def torchrun(config: Path, nproc: int, overrides: Iterable[str], max_restarts: int = 0) -> None:
    """Run ``ups train CONFIG`` on ``nproc`` local processes under one elastic agent, which
    restarts every rank after one fails, ``max_restarts`` times at most. Each rank ends with
    this process, however it ends (:mod:`ups.core.launch._lifeline`).

    :raises ChildFailedError: when a rank fails (after ``max_restarts`` restarts).
    """
    from torch.distributed.launcher.api import elastic_launch

    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, _ReportedByUps) for f in agent_log.filters):
        agent_log.addFilter(_ReportedByUps())
    os.environ[lifeline.LAUNCHER] = str(os.getpid())  # in the environment the agent gives ranks
    try:
        elastic_launch(_launch_config(nproc, max_restarts), sys.executable)(
            *train_args(config, overrides)
        )
    finally:
        del os.environ[lifeline.LAUNCHER]


def rank_failures(error: ChildFailedError) -> list[tuple[int, str]]:
    """What the ranks of a failed launch said, one ``(rank, message)`` per distinct message,
    the cause first: a message that repeats another rank's whole message is left out, a rank's
    own error comes before a :class:`~ups.core.RankFailedError` naming another rank, then the
    first said first (when its error file was written). Each message comes with the
    lowest rank that said it, so that ranks failing alike (bad input every rank reads) are
    named the same way whichever exited first. A message is the one-line error the rank's
    error file holds, else how its process ended."""
    said: dict[str, tuple[bool, float, int]] = {}
    for rank, failure in error.failures.items():
        message = failure_message(failure)
        echo = message.startswith(("RankFailedError: ", "RankUsageError: "))
        when = _when(failure.error_file, failure.timestamp)
        first = said.get(message, (echo, when, rank))
        said[message] = (echo, min(first[1], when), min(first[2], rank))
    # A message holding another is that one repeated (RankFailedError: rank 1: <its error>)
    return [
        (key[2], message)
        for message, key in sorted(said.items(), key=lambda i: i[1])
        if not any(other in message for other in said if other != message)
    ]


def failure_message(failure: ProcessFailure) -> str:
    """A failed rank's error in one line: what its error file holds, else how it ended."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return " ".join((message or f"exit code {failure.exitcode}").split())


def _when(error_file: str, timestamp: float) -> float:
    """When a rank wrote its error file: the agent's ``timestamp`` is in whole seconds."""
    try:
        return os.stat(error_file).st_mtime
    except OSError:  # none: the process ended without one, when the agent saw it
        return timestamp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def train_args(config: Path, overrides: Iterable[str]) -> list[str]:
    """The Python arguments that run ``ups train CONFIG -o ...`` in place, on each rank a
    launcher starts: ``-m ups.core train CONFIG -o key=value ...``."""
    args = ["-m", "ups.core", "train", str(config)]
    for item in overrides:
        args += ["-o", item]
    return args
