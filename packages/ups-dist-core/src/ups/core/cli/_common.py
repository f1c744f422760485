"""What the ``ups`` commands share: the exit statuses, :class:`LauncherError`, the parser that
turns argparse's errors into usage errors, the argument types and ``-o``, the config a run
trains on and its validation, and the report of failed ranks."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from ..config._config import Config, load_config, read_config
from ..config._errors import ConfigError, UsageError
from ..plugin._manager import Registry, load_plugins

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_PREEMPTED = 75
"""A preemption signal stopped the run, every rank saved: resumable (sysexits' EX_TEMPFAIL)."""


class LauncherError(Exception):
    """A launcher's call failed for a reason other than the user's input: exit status 1."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are :class:`~ups.core.UsageError` (one line, status 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def count(text: str) -> int:
    """A count of processes or machines: a whole number >= 1 (``--nproc``, ``--nnodes``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {value}")
    return value


def add_overrides(parser: argparse.ArgumentParser) -> None:
    """Add ``-o KEY=VALUE`` (repeatable) to a command that reads a config."""
    parser.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a config value, e.g. -o training.lr=3e-4 (repeatable)",
    )


def run_config(args: argparse.Namespace) -> Config:
    """The config a run trains on (``ups train``, ``tune``, ``check``, ``launch``): a section
    that a plugin's command reads instead (ups-optuna's ``sweep``) is refused naming that
    command.

    :raises ConfigError: as :func:`~ups.core.load_config` does.
    """
    try:
        return load_config(args.config, args.override)
    except ConfigError:
        data = read_config(args.config, args.override)
        for name in load_plugins().command_sections():
            if name in data:
                raise ConfigError(
                    f"{args.config}: {name}",
                    f"is read by `ups {name}`, not by a run: `ups {name} {args.config}` "
                    "trains the configs it makes of this one",
                ) from None
        raise


def check_config(config: Config, registry: Registry, nproc: int | None) -> None:
    """Validate ``config``, logging its warnings. Under ``UPS_TRACEBACK``, the error of a
    module or file that failed to import is printed with its traceback first."""
    from ..config._user_code import TRACEBACK_ENV
    from ..config._validate import validate

    try:
        warnings = validate(config, registry, nproc)
    except UsageError as error:
        if error.__cause__ is not None and os.environ.get(TRACEBACK_ENV):
            traceback.print_exception(error.__cause__)
        raise
    for warning in warnings:
        structlog.get_logger().warning(warning)


def failed(error: ChildFailedError, logs_dir: Path | None = None) -> int:
    """Print one line for each distinct error of the failed ranks, first to fail first
    (:func:`~ups.core.launch._processes.rank_failures`), with the rank's log file in ``logs_dir``, which
    holds its traceback, if there is one. Return the exit status."""
    from ..launch._processes import failure_message, rank_failures

    # Ranks refused bad input (a usage error: exit 2 in the rank), and any other rank was
    # stopped by a signal (the launcher ending the job): so does ups, saying only the refusal.
    failures = error.failures.values()
    codes = [failure.exitcode for failure in failures]
    usage = EXIT_USAGE in codes and all(c == EXIT_USAGE or c < 0 for c in codes)
    refused = {failure_message(f) for f in failures if f.exitcode == EXIT_USAGE}
    for rank, message in rank_failures(error):
        # a rank stopped, however late it said it; but not the error a refusal names (rank 0's,
        # which another rank repeated and exited 2 with, before rank 0 was stopped)
        if usage and not any(message in said for said in refused):
            continue
        line = f"ups: rank {rank} failed: {message}"
        log_file = None if logs_dir is None else logs_dir / f"rank{rank}.jsonl"
        if log_file is not None and log_file.is_file():
            line += f" (traceback: {log_file})"
        print(line, file=sys.stderr)
    return EXIT_USAGE if usage else EXIT_FAILED
